"""The transformers fallback engine: a hand-written KV-cache sampling loop behind the `Engine`
protocol, for machines or tests where vLLM is not wanted (``policy.generation.backend:
transformers``).

It serves one request at a time (the n choices of a request are one batch) and has no prefix
cache, so it is only for small models. Sampling mirrors vLLM's: logits / temperature, top-p mask
(vLLM's ascending-sort rule), sample; the reported logprob is under that processed distribution,
or under the raw distribution for greedy (temperature 0) requests, as vLLM's
``processed_logprobs`` mode reports them.

Pause states (the sampling loop checks them between forward passes)::

    open --pause(drain)--> closed: no new request starts; returns when no generation is active
    open --pause(keep)---> closed + frozen: the active generation parks after its current step
    open --pause(interrupt)--> closed: the active generation ends after its current step, its
                               choices unfinished so far ending with finish reason "abort"
    closed/frozen --resume--> open

Forward passes run in the engine's own worker thread so the event loop keeps serving HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.generator.engine import ChoiceOutput, EngineInfo, EngineStats, FinishReason, GenerationParams, PauseMode
from shared.routes import RouteShape, moe_layers, route_shape
from shared.run_config import RunConfig
from shared.weights_format import safetensors_files

log = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5
_DTYPES = {"auto": "float32", "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class HfEngine:
    def __init__(self, cfg: RunConfig) -> None:
        self._cfg = cfg
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._layout: Any = None  # StoredLayout of the model, built on the first weight load
        self._info = EngineInfo(name="transformers", model=cfg.policy.model_name, max_model_len=0)
        self._lock = asyncio.Lock()
        self._open = asyncio.Event()
        self._running = asyncio.Event()
        self._quiet = asyncio.Event()
        self._idle = asyncio.Event()
        for ev in (self._open, self._running, self._quiet, self._idle):
            ev.set()
        # One thread owns every forward pass (torch's per-thread state stays warm, one pass at a time).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._waiting = 0
        self._active = 0
        self._interrupted = False
        self._generated_tokens_total = 0
        self._group: Any = None  # the weight-transfer group joined (collective refits)
        self._bucket_bytes = 256 << 20
        self._receive_buffers: list[Any] = []  # kept across transfers (`shared_torch.weight_wire`)
        self._reshard: dict[str, Any] | None = None  # a resharding group's init info
        self._reshard_delta: Any = None  # its `shared_torch.reshard_delta.DeltaState`
        self._route_shape: RouteShape | None = None
        self._routed: list[Any] = []  # each MoE router's expert ids of the forward pass that just ran

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def prefix_caching_enabled(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    async def start(self) -> None:
        self._model = await asyncio.get_running_loop().run_in_executor(self._executor, self._load_model)
        config = self._model.config
        max_len = self._cfg.policy.generation.vllm_cfg.max_model_len or int(config.max_position_embeddings)
        self._info = EngineInfo(
            name="transformers",
            model=self._cfg.policy.model_name,
            max_model_len=max_len,
            route_shape=self._route_shape,
        )
        log.info("transformers engine up: max_model_len=%d eos=%s", max_len, sorted(self._eos_ids))

    def _load_model(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self._cfg.policy.tokenizer_path)
        dtype_name = _DTYPES.get(self._cfg.policy.generation.vllm_cfg.dtype)
        if dtype_name is None:
            raise ValueError(
                f"policy.generation.vllm_cfg.dtype {self._cfg.policy.generation.vllm_cfg.dtype!r} is not supported"
            )
        model = AutoModelForCausalLM.from_pretrained(self._cfg.policy.model_name, dtype=getattr(torch, dtype_name))
        model.eval()
        eos = model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._cfg.policy.moe_routing_replay:
            self._record_routes(model)
        return model

    def _record_routes(self, model: Any) -> None:
        """Hook every MoE layer's router to keep the expert ids it chose in the last forward pass
        (a router returns (logits, weights, expert ids))."""
        config = model.config.to_dict()
        self._route_shape = route_shape(config)
        if self._route_shape is None:
            raise ValueError(
                f"policy.moe_routing_replay is on, but {self._cfg.policy.model_name} has no routed experts "
                f"(model_type {config.get('model_type')!r})"
            )
        layers = model.model.layers
        for i in moe_layers(config):
            layers[i].mlp.gate.register_forward_hook(lambda _m, _a, out: self._routed.append(out[-1]))

    async def generate(self, prompt_ids: list[int], params: GenerationParams, request_id: str) -> list[ChoiceOutput]:
        self._waiting += 1
        started = False
        try:
            async with self._lock:
                await self._open.wait()
                self._waiting -= 1
                started = True
                self._active += 1
                self._idle.clear()
                try:
                    return await self._sample_loop(prompt_ids, params)
                finally:
                    self._active -= 1
                    self._idle.set()
        finally:
            if not started:  # cancelled while queued
                self._waiting -= 1

    async def _sample_loop(self, prompt_ids: list[int], params: GenerationParams) -> list[ChoiceOutput]:
        import torch

        loop = asyncio.get_running_loop()
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        rows = [_Row(i, params.stop_strings, self._tokenizer) for i in range(params.n)]
        state: Any = None
        next_input = torch.tensor([prompt_ids] * params.n, dtype=torch.long)
        steps: list[Any] = []  # per forward pass: [n, positions, layers, top_k] expert ids
        for _ in range(params.max_tokens):
            await self._running.wait()
            if self._interrupted:
                for row in rows:
                    row.finish_reason = row.finish_reason or "abort"
                break
            self._quiet.clear()
            try:
                logits, state = await loop.run_in_executor(self._executor, self._forward, next_input, state)
            finally:
                self._quiet.set()
            if params.routes_from is not None:
                steps.append(self._take_routes(params.n, next_input.shape[1]))
            tokens, logprobs = _sample(logits, params.temperature, params.top_p, gen)
            top = torch.topk(logprobs, params.top_logprobs, dim=-1) if params.top_logprobs > 0 else None
            for row in rows:
                if row.finish_reason is None:
                    row.add(int(tokens[row.index]), float(logprobs[row.index, tokens[row.index]]), top, stop_ids)
                    self._generated_tokens_total += 1
            if all(r.finish_reason is not None for r in rows):
                break
            next_input = tokens.unsqueeze(1)
        choices = [r.to_choice(params.top_logprobs > 0) for r in rows]
        if params.routes_from is not None and steps:
            routes = torch.cat(steps, dim=1).numpy()
            for c in choices:  # positions the model ran: the prompt and every sampled token but the last
                c.routes = routes[c.index, params.routes_from : len(prompt_ids) + len(c.token_ids) - 1]
                c.routes_start = params.routes_from
        return choices

    def _take_routes(self, n: int, positions: int) -> Any:
        """The last forward pass's routes as [n, positions, layers, top_k]."""
        import torch

        taken = [ids.reshape(n, positions, -1) for ids in self._routed]
        self._routed.clear()
        return torch.stack(taken, dim=2).to(torch.int16)

    def _forward(self, input_ids: Any, past: Any) -> tuple[Any, Any]:
        import torch

        self._routed.clear()  # the routers' hooks record this pass only
        with torch.inference_mode():
            out = self._model(input_ids=input_ids, past_key_values=past, use_cache=True)
        return out.logits[:, -1, :].float(), out.past_key_values

    async def score(self, token_ids: list[int]) -> list[float]:
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._score, token_ids)

    def _score(self, token_ids: list[int]) -> list[float]:
        import torch

        with torch.inference_mode():
            logits = self._model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids[1:]).unsqueeze(1))
        return [float(x) for x in lp.squeeze(1)]

    async def load_weights(self, path: str) -> None:
        if self._active and self._running.is_set():
            raise RuntimeError("load_weights called while a generation is running; pause the engine first")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load_state, path)

    def _stored_layout(self) -> Any:
        """Where each tensor of a checkpoint of this model goes (fused experts are stored one by
        one: `shared_torch.stored_names`); built once."""
        from shared_torch.stored_names import StoredLayout

        if self._layout is None:
            self._layout = StoredLayout(self._model)
        return self._layout

    def _load_state(self, path: str) -> None:
        import torch
        from safetensors.torch import load_file

        from shared_torch.stored_names import foreign

        state: dict[str, Any] = {}
        for f in safetensors_files(Path(path)):
            state.update(load_file(str(f)))
        for name in foreign(self._model, state):  # modules the model does not have (MTP weights)
            del state[name]
        layout = self._stored_layout()
        unknown = sorted(set(state) - layout.names)
        missing = sorted(layout.names - set(state))
        if unknown or missing:
            raise ValueError(f"weights in {path} do not fit the model: unknown {unknown[:5]}, missing {missing[:5]}")
        with torch.no_grad():
            for name, tensor in state.items():
                layout.copy_(name, tensor)

    async def join_weight_group(self, init_info: dict[str, Any]) -> None:
        from shared_torch.reshard_delta import DeltaState
        from shared_torch.weight_wire import open_group

        if self._group is not None:
            self._group.close()
            self._group = None
        info = dict(init_info)
        if "group_id" not in info:
            raise RuntimeError(
                "the transformers engine receives weights only over gloo (refit.collective.backend: gloo)"
            )
        self._bucket_bytes = int(info.get("bucket_bytes", self._bucket_bytes))
        self._reshard = info if "receives" in info else None
        self._reshard_delta = DeltaState() if info.get("delta") else None  # a new group: whole payloads first
        self._group = await asyncio.to_thread(
            open_group,
            str(info["master_address"]),
            int(info["master_port"]),
            int(info["rank_offset"]),
            int(info["world_size"]),
            str(info["group_id"]),
            float(info.get("timeout_s", 300.0)),
        )

    async def receive_weights(self, update_info: dict[str, Any]) -> str | None:
        """The gloo wire format of `shared_torch.weight_wire`, copied into the parameters by name (a
        transfer in vLLM's checkpoint names is the Hugging Face state dict)."""
        if self._active and self._running.is_set():
            raise RuntimeError("receive_weights called while a generation is running; pause the engine first")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._receive, update_info)

    def _receive(self, update_info: dict[str, Any]) -> str:
        import torch

        from shared_torch.weight_wire import TransferError, metas_from_update, receive_buckets, transfer_checksum

        if self._group is None:
            raise TransferError("no weight-transfer group joined")
        layout = self._stored_layout()
        if self._reshard is not None:
            return self._receive_reshard(layout)
        metas = metas_from_update(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        unknown = [m.name for m in metas if m.name not in layout.names]
        if unknown:
            raise ValueError(f"the transfer names parameters the model does not have: {unknown[:5]}")
        digests: list[bytes] = []
        try:
            with torch.no_grad():
                for pairs, got in receive_buckets(self._group, metas, self._bucket_bytes, self._receive_buffers):
                    for name, tensor in pairs:
                        layout.copy_(name, tensor)
                    digests.append(got)
        except Exception:
            self._group.close()
            self._group = None
            raise
        return transfer_checksum(digests)

    def _receive_reshard(self, layout: Any) -> str:
        """A resharding transfer (`shared_torch.gloo_reshard`): one engine rank, every tensor whole."""
        import torch

        from shared_torch.reshard_wire import decode_links, engine_checksum, receive_links

        info = self._reshard
        assert info is not None
        unknown = [name for name in info["shapes"] if name not in layout.names]
        if unknown:
            raise ValueError(f"the transfer names parameters the model does not have: {unknown[:5]}")
        try:
            with torch.no_grad():
                checksum = receive_links(
                    self._group,
                    decode_links(info["receives"][0]),
                    {n: tuple(s) for n, s in info["shapes"].items()},
                    getattr(torch, info["dtype"]),
                    int(info["slot_bytes"]),
                    layout.copy_,
                    self._reshard_delta,
                )
        except Exception:
            self._group.close()
            self._group = None
            raise
        return engine_checksum([checksum])

    async def weight_checksum(self) -> str | None:
        return None  # no engine-side checksums beyond the transfer's own

    async def reset_prefix_cache(self) -> bool:
        # No prefix cache: nothing to invalidate, and nothing was reset.
        return False

    async def pause(self, mode: PauseMode) -> None:
        self._open.clear()
        if mode == "keep":
            self._running.clear()
            await self._quiet.wait()
            return
        if mode == "interrupt":
            self._interrupted = True  # the running generation ends after its current step
        await self._idle.wait()

    async def resume(self) -> None:
        self._interrupted = False
        self._running.set()
        self._open.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._active, waiting=self._waiting, generated_tokens_total=self._generated_tokens_total
        )

    async def aclose(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._model = None


class _Row:
    """The tokens sampled so far for one choice."""

    def __init__(self, index: int, stop_strings: tuple[str, ...] = (), tokenizer: Any = None) -> None:
        self.index = index
        self.stop_strings = stop_strings
        self.tokenizer = tokenizer
        # A stop string of c characters is completed within the last c tokens (each decodes to at
        # least part of one character); a few more cover multi-byte characters split over tokens.
        self._window = max((len(s) for s in stop_strings), default=0) + 4
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: FinishReason | None = None

    def add(self, token: int, logprob: float, top: Any, stop_ids: set[int]) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            vals, ids = top.values[self.index].tolist(), top.indices[self.index].tolist()
            self.top.append(list(zip(ids, vals, strict=True)))
        if token in stop_ids or (self.stop_strings and self._completes_stop_string()):
            self.finish_reason = "stop"

    def _completes_stop_string(self) -> bool:
        text = self.tokenizer.decode(self.token_ids[-self._window :], skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)

    def to_choice(self, with_top: bool) -> ChoiceOutput:
        return ChoiceOutput(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            top_logprobs=self.top if with_top else None,
        )


def _sample(logits: Any, temperature: float, top_p: float, gen: Any) -> tuple[Any, Any]:
    """(sampled ids [n], logprobs [n, V] of the processed distribution)."""
    import torch

    if temperature < _GREEDY_EPS:
        logprobs = torch.log_softmax(logits, dim=-1)
        return logits.argmax(dim=-1), logprobs
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = _top_p_mask(scaled, top_p)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=gen).squeeze(1)
    return tokens, logprobs


def _top_p_mask(logits: Any, top_p: float) -> Any:
    """vLLM's rule (`shared_torch.nucleus`): the tokens outside the nucleus set to -inf."""
    from shared_torch.nucleus import top_p_mask

    return top_p_mask(logits, top_p)
