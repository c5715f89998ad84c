"""MoE routes on the wire: the experts each token was routed to, packed to the bits they need.

With ``policy.moe_routing_replay`` the generator returns, for every token it ran through the model,
the ``top_k`` experts each MoE layer routed it to ([tokens, layers, top_k], as vLLM's
``routed_experts``), the gateway keeps them in the trajectory's turns, and the trainer routes the
same tokens the same way. At the reference run's size (60 MoE layers, top 10 of 512 experts) a
token's routes are 600 expert ids; as int16 that is 1,200 bytes a token, 78 MiB for one 65,536-token
trajectory, over the trajectory stream's entry cap (`shared.keys.MAX_ENTRY_BYTES`). Packed to
ceil(log2(experts)) bits an id (9 for 512), as many ids as fit in a 64-bit word (7), each token's
record whole words, it is 688 bytes a token and 43 MiB. Records are token-aligned, so a range of
tokens is a range of bytes.

`RouteShape` is the model's geometry and the record size; `pack` / `unpack` convert [tokens,
layers, top_k] arrays to and from the packed bytes. Used by the generator (its responses), the
gateway (turns) and the trainer (training rows).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import msgspec
import numpy as np


class RouteShape(msgspec.Struct, frozen=True, kw_only=True):
    """Routes' geometry: MoE layers, experts per token, experts per layer."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def bits(self) -> int:
        """Bits an expert id takes."""
        return max(1, (self.num_experts - 1).bit_length())

    @property
    def ids_per_word(self) -> int:
        return 64 // self.bits

    @property
    def words_per_token(self) -> int:
        return math.ceil(self.layers * self.top_k / self.ids_per_word)

    @property
    def bytes_per_token(self) -> int:
        return 8 * self.words_per_token


def _shifts(shape: RouteShape) -> np.ndarray:
    return (np.arange(shape.ids_per_word, dtype=np.uint64) * np.uint64(shape.bits)).astype(np.uint64)


def pack(routes: np.ndarray, shape: RouteShape) -> bytes:
    """[tokens, layers, top_k] expert ids as token-aligned records of ``shape.bytes_per_token``
    (little-endian 64-bit words, ``ids_per_word`` ids each, lowest bits first)."""
    ids = np.asarray(routes)
    if ids.ndim != 3 or ids.shape[1:] != (shape.layers, shape.top_k):
        raise ValueError(f"routes of shape {ids.shape} are not [tokens, {shape.layers}, {shape.top_k}]")
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        raise ValueError(f"expert ids outside [0, {shape.num_experts})")
    tokens, per = ids.shape[0], shape.ids_per_word
    flat = np.zeros((tokens, shape.words_per_token * per), dtype=np.uint64)
    flat[:, : shape.layers * shape.top_k] = ids.reshape(tokens, -1)
    words = np.zeros((tokens, shape.words_per_token), dtype=np.uint64)
    for j, shift in enumerate(_shifts(shape)):
        words |= flat[:, j::per] << shift
    return words.astype("<u8").tobytes()


def unpack(data: bytes, shape: RouteShape) -> np.ndarray:
    """Packed routes back to [tokens, layers, top_k] int64 expert ids."""
    per = shape.bytes_per_token
    if len(data) % per:
        raise ValueError(f"{len(data)} bytes of routes are not whole {per}-byte token records")
    words = np.frombuffer(data, dtype="<u8").reshape(-1, shape.words_per_token)
    mask = np.uint64((1 << shape.bits) - 1)
    ids: np.ndarray = (words[..., None] >> _shifts(shape)) & mask
    n = shape.layers * shape.top_k
    out: np.ndarray = ids.reshape(words.shape[0], -1)[:, :n].astype(np.int64)
    return out.reshape(-1, shape.layers, shape.top_k)


def to_text(data: bytes) -> str:
    """Packed routes for a JSON body (base64)."""
    return base64.b64encode(data).decode("ascii")


def from_text(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def moe_layers(config: dict[str, Any]) -> list[int]:
    """Indices of the decoder layers with routed experts, from a Hugging Face ``config.json``
    (its text part): every layer, but Qwen-MoE's ``mlp_only_layers`` and those off
    ``decoder_sparse_step``. Empty for a dense model."""
    text = config.get("text_config") or config
    if not _num_experts(text):
        return []
    skip = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step") or 1)
    return [i for i in range(int(text["num_hidden_layers"])) if i not in skip and (i + 1) % step == 0]


def route_shape(config: dict[str, Any]) -> RouteShape | None:
    """The routes of a model's ``config.json``; None for a model without routed experts."""
    layers = moe_layers(config)
    if not layers:
        return None
    text = config.get("text_config") or config
    return RouteShape(layers=len(layers), top_k=int(text["num_experts_per_tok"]), num_experts=_num_experts(text))


def _num_experts(text: dict[str, Any]) -> int:
    """Routed experts a layer: Qwen's checkpoints write ``num_experts``, transformers 5 saves a
    Qwen3-MoE's as ``num_local_experts``."""
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)
