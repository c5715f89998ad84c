"""Qwen3.5-MoE on the megatron backend (`services.trainer.backends.megatron_hybrid`), against the
tiny Qwen3.5-MoE (Gated DeltaNet layers 0-2, gated full attention in layer 3, routed experts with
a gated shared expert, MTP weights), as a text checkpoint and in the released multimodal format
(its language model under ``model.language_model.*`` and its config under ``text_config``,
beside a vision tower):

* the conversion HF -> megatron -> HF gives back every decoder tensor bit for bit, under the
  checkpoint's own names (MTP and vision weights are not converted: the backend does not build
  them);
* loaded into a megatron GPTModel on CPU (gloo, one rank; Gated DeltaNet through transformers'
  torch kernels, `megatron_cpu.gated_delta_net_kernels`), the model gives transformers' logprobs
  (float32, 2e-5), and its weights convert back bit for bit;
* the backend built on the multimodal checkpoint scores as transformers does, trains a step and
  publishes the same multimodal checkpoint: its config, exactly its tensor names, the vision and
  MTP weights byte for byte, which transformers scores as the backend does
  (`tests.support.published`);
* rows packed into one sequence give each row's own logits: the Gated DeltaNet layers run each
  row apart (`linear_attention.rows_apart`), attention keeps to the row through the mask;
* the zero-centred norm computes transformers' Qwen3.5 RMSNorm bit for bit;
* a tensor-parallel size the linear-attention heads cannot split over is refused, naming the key,
  and so is any tensor-parallel size above 1 for training (an MoE model: see `megatron_setup`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from services.trainer.backends import build_backend, megatron_cpu, megatron_hybrid  # noqa: E402
from services.trainer.backends.linear_attention import rows_apart  # noqa: E402
from services.trainer.backends.megatron_adapter import packed_mask  # noqa: E402
from services.trainer.backends.megatron_convert import (  # noqa: E402
    hf_to_megatron,
    language_model_config,
    language_model_prefix,
    megatron_to_hf,
    read_hf_state,
)
from services.trainer.backends.megatron_setup import check_supported  # noqa: E402
from shared.config import load  # noqa: E402
from shared.config_error import ConfigError  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402
from streamrl.redis_server import free_port  # noqa: E402
from tests.support import published  # noqa: E402
from tests.support.ranks import megatron_moe_ep as rig  # noqa: E402

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Checkpoint:
    """A tiny Qwen3.5-MoE folder as the megatron backend reads it."""

    folder: Path
    hf: dict  # the language model's config (a multimodal checkpoint's text_config)
    prefix: str  # where the checkpoint stores the language model's model.* weights
    state: dict[str, torch.Tensor]

    @property
    def decoder(self) -> dict[str, torch.Tensor]:
        """The tensors the megatron model builds (not the MTP module's, nor a vision tower's)."""
        return {k: v for k, v in self.state.items() if k.startswith((self.prefix, "lm_head."))}


@pytest.fixture(scope="module", params=["tiny_hybrid_moe_dir", "tiny_multimodal_moe_dir"], ids=["text", "multimodal"])
def hybrid(request) -> Checkpoint:
    folder = request.getfixturevalue(request.param)
    checkpoint = json.loads((folder / "config.json").read_text())
    hf, prefix = language_model_config(checkpoint), language_model_prefix(checkpoint)
    return Checkpoint(folder, hf, prefix, read_hf_state(folder))


def test_hf_to_megatron_and_back_is_bit_exact(hybrid):
    hf, decoder = hybrid.hf, hybrid.decoder
    assert any(k.startswith("mtp.") for k in hybrid.state)  # the tiny model ships MTP weights
    assert len(decoder) < len(hybrid.state)
    mega = hf_to_megatron(decoder, hf, prefix=hybrid.prefix)
    assert mega["decoder.layers.0.self_attention.in_proj.weight"].shape[0] == sum(megatron_hybrid.in_proj_parts(hf))
    assert mega["decoder.layers.3.self_attention.linear_qkv.weight"].shape[0] == (4 * 2 + 2 * 2) * 32
    back = megatron_to_hf(mega, hf, prefix=hybrid.prefix)
    assert back.keys() == decoder.keys()
    assert all(torch.equal(back[k], decoder[k]) for k in decoder)


def test_the_zero_centred_norm_is_transformers_bit_for_bit():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    ours, theirs = megatron_hybrid.ZeroCentredRMSNorm(config, 64, eps=1e-6), Qwen3_5MoeRMSNorm(64, eps=1e-6)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours(x.bfloat16()), theirs(x.bfloat16()))


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group and Megatron's groups in this process, torn down after the module."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    rig.init_parallel(1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_model(hybrid, one_rank) -> torch.nn.Module:
    model = rig.build_megatron(hybrid.hf, 1)
    rig.load(model, hf_to_megatron(hybrid.state, hybrid.hf, prefix=hybrid.prefix))
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = megatron_cpu.causal_mask(ids.shape[1], ids.device)
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids, position_ids=positions, attention_mask=mask)
    return out


def test_megatron_gives_the_hf_logprobs_and_converts_back_exactly(hybrid, megatron_model):
    from transformers import AutoModelForCausalLM

    hf = hybrid.hf
    reference = AutoModelForCausalLM.from_pretrained(hybrid.folder, dtype=torch.float32).eval()
    # longer than one 64-token chunk of the gated delta rule
    ids = torch.randint(3, hf["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = torch.log_softmax(reference(input_ids=ids).logits, -1)
    got = torch.log_softmax(_logits(megatron_model, ids)[..., : hf["vocab_size"]], -1)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    state = {k: v for k, v in megatron_model.state_dict().items() if not k.endswith("_extra_state")}
    back, decoder = megatron_to_hf(state, hf, prefix=hybrid.prefix), hybrid.decoder
    assert back.keys() == decoder.keys() and all(torch.equal(back[k], decoder[k]) for k in decoder)


def test_the_backend_trains_the_multimodal_checkpoint_and_publishes_it_as_it_was(
    tiny_multimodal_moe_dir, one_rank, tmp_path
):
    """The megatron backend on the released checkpoint format: built from the checkpoint's
    ``text_config``, read and published under ``model.language_model.*``, the vision tower and MTP
    weights carried, the config published as it was (in this module's one-rank groups)."""
    overrides = [f"policy.model_name={tiny_multimodal_moe_dir}", "data.train_path=t.jsonl", "trainer.torch_threads=1"]
    backend = build_backend(load(RunConfig, None, [*overrides, "trainer.backend=megatron"], env={}))
    published.assert_trains_and_publishes_as_started(backend, tiny_multimodal_moe_dir, tmp_path / "weights", 2e-5)


def test_packed_rows_run_apart_through_the_gated_deltanet_layers(hybrid, megatron_model):

    hf = hybrid.hf
    lengths = (7, 12, 5)
    rows = [torch.randint(3, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    alone = torch.cat([_logits(megatron_model, row) for row in rows], dim=1)
    ids = torch.cat(rows, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = [0, 7, 19]
    assert megatron_hybrid.separate_rows(megatron_model) == 3
    with torch.no_grad(), rows_apart(starts, ids.shape[1]):
        packed = megatron_model(input_ids=ids, position_ids=positions, attention_mask=packed_mask(positions))
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    with torch.no_grad():  # outside rows_apart the recurrent state would carry across rows
        leaked = megatron_model(input_ids=ids, position_ids=positions, attention_mask=packed_mask(positions))
    assert (leaked[:, 7:] - alone[:, 7:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("layout", "refusal"),
    [
        (
            ["tensor_model_parallel_size=4"],
            "tensor_model_parallel_size is 4; it must divide the checkpoint's 2 linear_num_key_heads",
        ),
        (
            ["tensor_model_parallel_size=2", "sequence_parallel=false"],
            "sequence_parallel is false; model_type 'qwen3_5_moe_text' trains at tensor parallelism \\(2\\) only with",
        ),
    ],
    ids=["4: more than the linear key heads", "2 without sequence parallelism"],
)
def test_a_tensor_parallel_layout_the_model_cannot_train_at_is_refused_by_key(tmp_path, layout, refusal):
    hf = {
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_size": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    base = ["policy.model_name=" + str(tmp_path), "data.train_path=t.jsonl", "trainer.backend=megatron"]
    fits = [
        *base,
        "policy.megatron_cfg.expert_model_parallel_size=2",
        "policy.megatron_cfg.pipeline_model_parallel_size=2",
    ]
    check_supported(load(RunConfig, None, fits, env={}).policy, world_size=4)
    # tensor parallelism 2, sequence parallel by default
    check_supported(
        load(RunConfig, None, [*base, "policy.megatron_cfg.tensor_model_parallel_size=2"], env={}).policy, world_size=4
    )
    refused = load(RunConfig, None, [*base, *(f"policy.megatron_cfg.{kv}" for kv in layout)], env={})
    with pytest.raises(ConfigError, match=refusal):
        check_supported(refused.policy, world_size=4)
