"""The training-backend contract (`services.trainer.backends.base.TrainingBackend`), run against
every registered model adapter (megatron on CPU through `services.trainer.backends.megatron_cpu`): built
from the run config by the registry, one step returns typed metrics, the exported weights load in transformers,
and a checkpoint restores model, optimizer and schedule so the next step is the same step."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from services.trainer.backends import ADAPTERS, adapter_class, build_backend
from services.trainer.backends.base import NonFiniteGradient
from services.trainer.batch import Row, StepBatch
from shared.config import load
from shared.config_error import ConfigError
from shared.records import LearnerMetrics
from shared.routes import RouteShape, route_shape
from shared.run_config import RunConfig
from tests.support.gradients import mlp_weight, poison_gradient

pytestmark = pytest.mark.integration


def _config(model_dir, backend: str, *extra: str) -> RunConfig:
    return load(
        RunConfig,
        None,
        [
            f"policy.model_name={model_dir}",
            "data.train_path=t.jsonl",
            f"trainer.backend={backend}",
            "trainer.torch_threads=1",
            *extra,
        ],
        env={},
    )


def _batch(seed: int, routes: RouteShape | None = None) -> StepBatch:
    """Four rows of 12 tokens; with ``routes``, random routes of all but their last position on
    all but the last row."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(4):
        ids = rng.integers(10, 800, size=12).astype(np.int64)
        tmask = np.zeros(12, np.float32)
        tmask[6:] = 1.0
        gen = (rng.normal(-3.0, 0.3, size=12) * tmask).astype(np.float32)
        rows.append(Row(f"t{i}", f"g{i // 2}", ids, tmask, gen, reward=float(i % 2), advantage=1.0 - 2 * (i % 2)))
    if routes is not None:
        draws = np.random.default_rng(seed + 100).random((3, 11, routes.layers, routes.num_experts))
        for i, experts in enumerate(np.argsort(draws, axis=-1)[..., : routes.top_k]):
            rows[i].routes = experts
    return StepBatch(rows)


@pytest.fixture(params=sorted(ADAPTERS))
def backend_name(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """The megatron backend joins a one-rank process group and Megatron's groups in this process;
    later tests start from none."""
    yield
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_every_backend_trains_exports_and_resumes_the_same_step(backend_name, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _config(tiny_model_dir, backend_name)
    backend = build_backend(cfg)
    assert backend.name == backend_name
    first = backend.train_step(_batch(0))
    assert isinstance(first, LearnerMetrics) and first.num_updates == 1
    assert np.isfinite([first.loss, first.grad_norm, first.lr]).all() and first.train_tokens == 4 * 6
    # NeMo-RL's divergences and ratio figures: one update, so the old policy is this pass's own
    # and every ratio is exactly 1; the generator's made-up logprobs are 3 nats below, so the
    # divergences are positive and the entropy estimate is finite
    assert (first.probs_ratio, first.probs_ratio_min, first.probs_ratio_max) == (1.0, 1.0, 1.0)
    assert first.probs_ratio_clamped == 1.0
    assert first.policy_kl_error > 0 and first.js_divergence_error > 0 and np.isfinite(first.approx_entropy)

    backend.save_weights(tmp_path / "weights")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "weights")
    assert sum(p.numel() for p in exported.parameters()) > 0

    (tmp_path / "ckpt").mkdir()
    backend.save_checkpoint(tmp_path / "ckpt")
    resumed = build_backend(cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    after, again = backend.train_step(_batch(1)), resumed.train_step(_batch(1))
    # The same state in: the same loss and gradient norm out (computed before the optimizer moves
    # anything, so float noise is not amplified), and the schedule continued where it was.
    assert again.loss == pytest.approx(after.loss, rel=1e-5, abs=1e-7)
    assert again.grad_norm == pytest.approx(after.grad_norm, rel=1e-4)
    assert again.lr == after.lr


def _weights(backend) -> list[torch.Tensor]:
    return [p.detach().clone() for p in backend.model.parameters()]


def test_a_nan_gradient_fails_the_step_naming_the_parameter_and_applies_nothing(backend_name, tiny_model_dir):
    """policy.on_nonfinite_grad: fail (the default). A NaN in one parameter's gradient: the step
    raises NonFiniteGradient naming that parameter (megatron: its DDP's own check, before the
    gradients are reduced), and neither the weights nor the schedule moved."""
    backend = build_backend(_config(tiny_model_dir, backend_name))
    backend.train_step(_batch(0))
    name = mlp_weight(backend)
    poison_gradient(backend, name)
    before, lr = _weights(backend), backend.scheduler.get_last_lr()
    with pytest.raises(NonFiniteGradient, match=rf"non-finite gradients on rank 0 in {re.escape(name)}"):
        backend.train_step(_batch(1))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(backend), strict=True))
    assert backend.scheduler.get_last_lr() == lr and backend.updates == 1


def test_a_nan_gradient_skips_the_update_when_configured_and_the_next_step_trains(backend_name, tiny_model_dir, caplog):
    """policy.on_nonfinite_grad: skip. The poisoned update is not applied (no optimizer or schedule
    step), the step record counts it and the warning names the parameter; the next step trains."""
    backend = build_backend(_config(tiny_model_dir, backend_name, "policy.on_nonfinite_grad=skip"))
    name = mlp_weight(backend)
    poison_gradient(backend, name)
    before, lr = _weights(backend), backend.scheduler.get_last_lr()
    skipped = backend.train_step(_batch(0))
    assert skipped.num_skipped_updates == 1 and skipped.num_updates == 1
    assert (skipped.loss, skipped.grad_norm) == (0.0, 0.0)  # no update applied: no figures of one
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(backend), strict=True))
    assert backend.scheduler.get_last_lr() == lr
    assert any(name in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    trained = backend.train_step(_batch(1))
    assert trained.num_skipped_updates is None and np.isfinite(trained.grad_norm) and trained.grad_norm > 0
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(backend), strict=True))


def test_skipping_nan_gradients_with_megatrons_own_nan_check_on_is_a_config_error(tiny_model_dir):
    cfg = _config(
        tiny_model_dir,
        "megatron",
        "policy.on_nonfinite_grad=skip",
        "policy.megatron_cfg.distributed_data_parallel_config.check_for_nan_in_grad=true",
    )
    with pytest.raises(ConfigError, match=r"check_for_nan_in_grad is true.*policy.on_nonfinite_grad is skip"):
        build_backend(cfg)


def test_an_unknown_backend_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.backend 'jax' is not one of: megatron, torch"):
        adapter_class("jax")


@pytest.mark.parametrize(
    ("model", "replay"),
    [
        ("tiny_model_dir", False),
        ("tiny_hybrid_moe_dir", False),
        ("tiny_hybrid_moe_dir", True),
        ("tiny_multimodal_moe_dir", False),
    ],
    ids=["Qwen3", "Qwen3.5-MoE", "Qwen3.5-MoE, routing replay", "Qwen3.5-MoE multimodal"],
)
def test_the_megatron_backend_trains_the_steps_the_torch_backend_does(model, replay, request, tmp_path):
    """The same checkpoint, rows and config through megatron-core's GPTModel (fused QKV and
    gate/up, DDP gradient buffers; on CPU through `megatron_cpu`; for Qwen3.5-MoE its Gated DeltaNet
    and gated attention layers, routed and shared experts; for the multimodal checkpoint its
    language model) and through transformers: the same loss and gradient norm at the first step,
    and the same again at the second, after each applied its own update. With routing replay the
    rows carry routes (one row none) that both backends' routers take, gradients reaching the
    routers through the weights at the given experts. Both publish the same tensors, the MTP and
    vision weights the models do not build among them, unchanged."""
    from safetensors.torch import load_file

    model_dir = request.getfixturevalue(model)
    extra = ["policy.moe_routing_replay=true"] if replay else []
    routes = route_shape(json.loads((model_dir / "config.json").read_text())) if replay else None
    megatron = build_backend(_config(model_dir, "megatron", *extra))
    plain = build_backend(_config(model_dir, "torch", *extra))
    for s in (0, 1):
        m, t = megatron.train_step(_batch(s, routes)), plain.train_step(_batch(s, routes))
        assert m.loss == pytest.approx(t.loss, rel=1e-4, abs=1e-6), s
        assert m.grad_norm == pytest.approx(t.grad_norm, rel=1e-4), s
        assert (m.train_tokens, m.num_updates) == (t.train_tokens, t.num_updates)
    megatron.save_weights(tmp_path / "megatron")
    plain.save_weights(tmp_path / "torch")
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("megatron", "torch"))
    assert ours.keys() == theirs.keys()
    start = load_file(model_dir / "model.safetensors")
    assert all(torch.equal(ours[k], start[k]) for k in start if k.startswith(("mtp.", "model.visual.")))
