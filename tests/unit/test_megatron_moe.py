"""Qwen3-MoE on the megatron backend (`services.trainer.backends.megatron_moe`), against a tiny
Qwen3-MoE built here with transformers:

* the TransformerConfig arguments follow the HF config (routing, which layers have experts) and
  what the layout cannot hold is refused, naming the key;
* the checkpoint on disk names one module per expert, which the conversion reads;
* loaded into a megatron GPTModel on CPU, the model gives transformers' logits (1e-4), with experts
  in every layer, with a dense layer (``mlp_only_layers``) and with top-k weights not renormalised,
  and converts back bit-exactly;
* with two expert-parallel ranks (torchrun, gloo), each loading only its experts, the logits and
  the dense gradients are the one-rank ones, each expert's gradient is twice its one-rank gradient
  (both ranks send it the same batch), and the experts gathered from both ranks are the checkpoint's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from services.trainer.backends import megatron_moe  # noqa: E402
from services.trainer.backends.megatron_convert import read_hf_state  # noqa: E402
from shared.config_error import ConfigError  # noqa: E402
from streamrl.model_builder import build_tiny_moe  # noqa: E402
from streamrl.redis_server import free_port  # noqa: E402
from tests.support.ranks import megatron_moe_ep as rig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "ranks" / "megatron_moe_ep.py"
VARIANTS = {
    "experts in every layer": {},
    "layer 1 dense": {"mlp_only_layers": [1]},
    "top-k not renormalised": {"norm_topk_prob": False},
}


def _hf(**overrides: object) -> dict:
    base = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return {**base, **overrides}


@pytest.mark.unit
def test_config_kwargs_follow_the_hf_routing_and_layer_pattern():
    kw = megatron_moe.moe_config_kwargs(_hf(), expert_parallel=2)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"], kw["ffn_hidden_size"]) == (
        8,
        2,
        32,
        128,
    )
    # Renormalised top-k of a softmax is a softmax over the top-k logits.
    assert kw["moe_router_score_function"] == "softmax" and kw["moe_router_pre_softmax"] is False
    assert megatron_moe.moe_config_kwargs(_hf(norm_topk_prob=False), expert_parallel=1)["moe_router_pre_softmax"]
    assert (kw["moe_router_load_balancing_type"], kw["moe_aux_loss_coeff"]) == ("none", 0.0)
    assert (kw["expert_model_parallel_size"], kw["expert_tensor_parallel_size"]) == (2, 1)
    assert kw["moe_layer_freq"] == [1, 1, 1, 1]
    assert megatron_moe.moe_config_kwargs(_hf(decoder_sparse_step=2, mlp_only_layers=[3]), expert_parallel=1)[
        "moe_layer_freq"
    ] == [0, 1, 0, 0]
    # transformers 5 writes the expert count as num_local_experts.
    written = {k: v for k, v in _hf().items() if k != "num_experts"} | {"num_local_experts": 8}
    assert megatron_moe.moe_config_kwargs(written, expert_parallel=8)["num_moe_experts"] == 8
    assert megatron_moe.moe_config_kwargs({"model_type": "qwen3", "num_hidden_layers": 2}, expert_parallel=1) == {}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("hf", "ep", "key"),
    [
        (_hf(), 3, "expert_model_parallel_size"),
        (_hf(shared_expert_intermediate_size=64), 1, "shared_expert_intermediate_size"),
        (_hf(num_experts_per_tok=1), 1, "num_experts_per_tok"),
        (_hf(hidden_act="gelu"), 1, "hidden_act"),
        ({"model_type": "qwen3", "num_hidden_layers": 2}, 2, "expert_model_parallel_size"),
    ],
)
def test_what_the_layout_cannot_hold_is_refused_by_key(hf, ep, key):
    with pytest.raises(ConfigError, match=key):
        megatron_moe.moe_config_kwargs(hf, expert_parallel=ep)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("hf", "experts"),
    [
        ({"model_type": "qwen3", "num_hidden_layers": 2}, [False, False]),
        (_hf(mlp_only_layers=[0, 1, 2, 3]), [False] * 4),
        (_hf(mlp_only_layers=[1]), [True, False, True, True]),
    ],
    ids=["dense", "MoE without experts", "MoE with a dense layer"],
)
def test_each_layer_gets_the_local_spec_its_experts_ask_for(one_rank, hf, experts):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=len(experts), hidden_size=64, num_attention_heads=4)
    block = megatron_moe.layer_spec(hf, config)
    assert [spec.submodules.mlp.module is MoELayer for spec in block.layer_specs] == experts
    # norms megatron-core sums over the tensor-parallel ranks under sequence parallelism
    assert block.layer_norm is megatron_moe.RMSNorm
    assert {spec.submodules.input_layernorm for spec in block.layer_specs} == {megatron_moe.RMSNorm}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each variant's folder and transformers model."""
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        folder = tmp_path_factory.mktemp(f"tiny-moe-{i}")
        out[name] = (folder, build_tiny_moe(folder, **overrides))
    return out


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
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.unit
def test_the_checkpoint_names_one_module_per_expert(models):
    folder, model = models["experts in every layer"]
    state = read_hf_state(folder)
    assert not any("gate_up_proj" in k for k in state)
    per_expert = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")}
    assert per_expert <= state.keys() and "model.layers.0.mlp.gate.weight" in state
    # transformers keeps them fused in memory; the conversion reads both forms alike.
    hf = _hf_config(folder)
    fused = megatron_moe.mlp_hf_to_megatron(model.state_dict(), hf, 0, ep_rank=1, ep_size=2)
    on_disk = megatron_moe.mlp_hf_to_megatron(state, hf, 0, ep_rank=1, ep_size=2)
    assert fused.keys() == on_disk.keys() and all(torch.equal(fused[k], on_disk[k]) for k in fused)


@pytest.mark.unit
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_gives_the_hf_logits_and_converts_back_exactly(models, one_rank, ids, variant):
    folder, hf_model = models[variant]
    hf, state = _hf_config(folder), read_hf_state(folder)
    model = rig.build_megatron(hf, 1)
    rig.load(model, rig.to_megatron(state, hf, 0, 1))
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
    logits, _ = rig.forward_backward(model, ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    back = rig.to_hf(model.state_dict(), hf, 0, 1)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.integration
@pytest.mark.slow
def test_two_expert_parallel_ranks_match_one(models, one_rank, ids, tmp_path):
    torch.save(ids, tmp_path / "ids.pt")
    folders = [folder for folder, _ in models.values()]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*launcher, str(SCRIPT), str(tmp_path / "ids.pt"), str(tmp_path), *map(str, folders)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for folder in folders:
        hf, state = _hf_config(folder), read_hf_state(folder)
        model = rig.build_megatron(hf, 1)
        rig.load(model, rig.to_megatron(state, hf, 0, 1))
        logits, grads = rig.forward_backward(model, ids)
        expected_grads = rig.mlp_to_hf(grads, hf, 0, 1)
        gathered: dict[str, torch.Tensor] = {}
        for rank in range(2):
            result = torch.load(tmp_path / f"{folder.name}-rank{rank}.pt")
            torch.testing.assert_close(result["logits"], logits, rtol=0, atol=1e-5)
            for name, grad in result["grads"].items():
                twice = 2 if ".experts." in name else 1
                torch.testing.assert_close(grad, twice * expected_grads[name], rtol=1e-4, atol=1e-7)
            for name, weight in result["weights"].items():
                assert name not in gathered or torch.equal(gathered[name], weight)  # the router, on both
                gathered[name] = weight
        assert gathered.keys() == {k for k in state if ".mlp." in k}
        assert all(torch.equal(gathered[k], state[k]) for k in gathered)
