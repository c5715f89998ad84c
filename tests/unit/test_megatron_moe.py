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
  (both ranks send it the same batch), and the experts gathered from both ranks are the checkpoint's;
* with MoE routing replay (`services.trainer.backends.megatron_routing`), as padded rows and as a
  pack, each router takes the given experts where a token's route is known and its own choice
  elsewhere, in the policy and the frozen reference, with the torch backend's routing and logprobs;
  each tensor-parallel rank gets the routes of its part of the sequence (sequence parallelism) and
  each pipeline stage those of its MoE layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from services.trainer.backends import build_backend, megatron_moe  # noqa: E402
from services.trainer.backends.backend import Backend  # noqa: E402
from services.trainer.backends.layout import Layout  # noqa: E402
from services.trainer.backends.megatron_convert import read_hf_state  # noqa: E402
from services.trainer.backends.megatron_routing import MegatronReplay, rank_routes  # noqa: E402
from services.trainer.backends.micro_batch import MicroBatch, micro_batch  # noqa: E402
from services.trainer.backends.routing_replay import RouteRecorder  # noqa: E402
from services.trainer.batch import Row  # noqa: E402
from services.trainer.ranks import SINGLE, Ranks  # noqa: E402
from shared.config import load  # noqa: E402
from shared.config_error import ConfigError  # noqa: E402
from shared.run_config import RunConfig  # noqa: E402
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


def _replaying(folder: Path, backend: str) -> Backend:
    """The ``backend`` (torch or megatron) on ``folder``, one rank, routing replay on, with a
    reference policy."""
    overrides = [
        f"policy.model_name={folder}",
        "data.train_path=t.jsonl",
        "trainer.torch_threads=1",
        "policy.moe_routing_replay=true",
        "loss_fn.reference_policy_kl_penalty=0.1",
        f"trainer.backend={backend}",
    ]
    return build_backend(load(RunConfig, None, overrides, env={}))


def _megatron_pass(
    backend: Backend, mb: MicroBatch, *, reference: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``mb``'s logprobs on the megatron backend (the policy, or the frozen ``reference``), and the
    experts each MoE router took for every token ([tokens, experts] bool a layer, tokens row-major
    as in `MicroBatch.routes`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    model = backend.ref_model if reference else backend.model
    assert model is not None
    maps: list[torch.Tensor] = []
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda _m, _a, out: maps.append(out[1])) for r in routers]
    with torch.no_grad():
        lp = backend.adapter.logprobs(backend.adapter.logits(model, mb), mb)
    for h in hooks:
        h.remove()
    rows, width = mb.ids.shape  # megatron's tokens are sequence-first
    return lp, [m.unflatten(0, (width, rows)).transpose(0, 1).flatten(0, 1) for m in maps]


def _as_map(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[tokens, top_k] expert ids as [tokens, experts] bool."""
    return torch.zeros(experts.shape[0], num_experts, dtype=torch.bool).scatter(1, experts, True)


@pytest.mark.unit
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_routers_replay_the_generators_routes_as_the_torch_backend_does(models, one_rank, variant):
    """Routing replay on the megatron backend, as rows (two, right-padded: megatron's sequence-first
    token order) and as a pack: every router takes the given experts where a token's route is known
    and its own choice elsewhere (a row without routes, positions past a row's routes, padding),
    the logprobs move off the unreplayed ones, and both routing and logprobs are the torch
    backend's on the same routes (the weights: softmax over all experts at the given ones,
    renormalised where the model renormalises). The frozen reference routes as the policy."""
    folder, _ = models[variant]
    hf = _hf_config(folder)
    experts = megatron_moe.num_experts(hf)
    megatron, reference = _replaying(folder, "megatron"), _replaying(folder, "torch")
    rng = np.random.default_rng(5)
    rows = [
        Row(f"t{n}", "g0", rng.integers(3, 512, n), np.ones(n, np.float32), np.zeros(n, np.float32), reward=1.0)
        for n in (11, 16)
    ]
    plain = micro_batch(rows, megatron.pad_id, torch.device("cpu"))
    _, own = _megatron_pass(megatron, plain)
    # the first row's routes: for all but its last 3 positions, experts its routers do not take
    own_first = torch.stack([m.float().topk(hf["num_experts_per_tok"]).indices for m in own], dim=1)[:8]
    rows[0] = dataclasses.replace(rows[0], routes=((own_first + 1) % experts).numpy())
    for packed in (False, True):
        mb = micro_batch(rows, megatron.pad_id, torch.device("cpu"), packed=packed)
        assert mb.routes is not None and mb.routes_known is not None
        lp, used = _megatron_pass(megatron, mb)
        _, used_by_reference = _megatron_pass(megatron, mb, reference=True)
        lp_own, own = _megatron_pass(megatron, dataclasses.replace(mb, routes=None, routes_known=None))
        recorder = RouteRecorder(reference.model)
        with torch.no_grad():
            lp_torch = reference.adapter.logprobs(reference.adapter.logits(reference.model, mb), mb)
        [torch_used] = recorder.routes()
        known = mb.routes_known
        real = torch.ones_like(known) if packed else mb.attention_mask.flatten().bool()
        second_row = torch.arange(len(known)) >= (11 if packed else mb.input_ids.shape[1])
        assert len(used) == torch_used.shape[1] == mb.routes.shape[1]
        assert all(torch.equal(u, r) for u, r in zip(used, used_by_reference, strict=True))
        for layer, (u, o) in enumerate(zip(used, own, strict=True)):
            given = _as_map(mb.routes[:, layer], experts)
            assert torch.equal(u[known], given[known])
            assert not (o[known] == given[known]).all(dim=1).any()  # none the router would take
            assert torch.equal(u[second_row & real], o[second_row & real])  # its own
            assert torch.equal(u[real], _as_map(torch_used[:, layer], experts)[real])
        assert (lp - lp_own).abs().max() > 1e-3
        tokens = mb.attention_mask.bool()
        torch.testing.assert_close(lp[tokens], lp_torch[tokens], rtol=0, atol=1e-4)


@pytest.mark.unit
def test_each_tensor_parallel_rank_gets_the_routes_of_its_part_of_the_sequence():
    """Row-major routes of 2 rows x 5 positions, the sequence padded to 6 and split over two ranks
    (sequence parallelism): rank r's token s * 2 + b is position 3r + s of row b; padding unknown."""
    rows, length = 2, 5
    routes = torch.arange(rows * length).repeat_interleave(4).view(rows * length, 2, 2)  # token id everywhere
    known = torch.ones(rows * length, dtype=torch.bool)
    known[3] = False
    for rank in range(2):
        ids, seen = rank_routes(routes, known, rows, length, 6, rank, 2)
        assert ids.shape == (6, 2, 2) and seen.shape == (6,)
        for s in range(3):
            for b in range(rows):
                position = 3 * rank + s
                if position < length:
                    assert (ids[s * rows + b] == b * length + position).all()
                    assert seen[s * rows + b] == (b * length + position != 3)
                else:
                    assert not seen[s * rows + b]
    whole, seen = rank_routes(routes, known, rows, length, 5)
    assert torch.equal(whole[:, 0, 0], routes[:, 0, 0].view(rows, length).T.flatten())
    assert torch.equal(seen, known.view(rows, length).T.flatten())


def _stage_model(moe: list[bool]) -> SimpleNamespace:
    """A stand-in for a stage's GPTModel: a router in the MLP of each layer ``moe`` marks."""
    layers = [SimpleNamespace(mlp=SimpleNamespace(router=SimpleNamespace()) if m else SimpleNamespace()) for m in moe]
    return SimpleNamespace(decoder=SimpleNamespace(layers=layers))


@pytest.mark.unit
def test_each_pipeline_stage_replays_the_routes_of_its_own_moe_layers():
    """Layers 0-3, layer 0 dense (routes of layers 1, 2, 3), two stages of two layers: the first
    stage's router (layer 1) takes the routes' first layer, the second stage's (layers 2, 3) the
    other two; a model whose MoE layers are not the routes' is refused."""
    hf = _hf(mlp_only_layers=[0])
    routes = np.arange(5 * 3 * 2).reshape(5, 3, 2) % 8
    row = Row("t", "g", np.arange(5), np.ones(5, np.float32), np.zeros(5, np.float32), reward=0.0, routes=routes)
    mb = micro_batch([row], 0, torch.device("cpu"))
    for stage, moe, layers in ((0, [False, True], [0]), (1, [True, True], [1, 2])):
        pipeline = Ranks(rank=stage, world_size=2, device=torch.device("cpu"))
        layout = Layout(SINGLE, SINGLE, (0,), pipeline, SINGLE, layer_offset=2 * stage)
        replay, model = MegatronReplay(hf, layout, sequence_parallel=False), _stage_model(moe)
        replay.attach(model)
        replay.set(mb, 5)
        routers = [x.mlp.router for x in model.decoder.layers if hasattr(x.mlp, "router")]
        for router, layer in zip(routers, layers, strict=True):
            _, experts = router.router_replay.get_replay_topk(
                torch.zeros(5, 8), 2, None, None, lambda s, k, _g, _t: torch.topk(s, k, dim=1)
            )
            assert torch.equal(experts, torch.from_numpy(routes[:, layer]))
        with pytest.raises(ValueError, match="MoE layers"):
            replay.attach(_stage_model([True, False]))
