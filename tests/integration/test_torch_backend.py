"""The torch training backend on the tiny model: normalisation after masking, and the
sequence-level logprob-error mask taking a row out of the update entirely; on the multimodal
Qwen3.5-MoE checkpoint, training its language model and publishing the checkpoint as it was."""

import numpy as np
import pytest
import torch

from services.trainer.backends import build_backend
from services.trainer.backends.backend import Backend
from services.trainer.batch import Row, StepBatch
from services.trainer.step_plan import plan_step
from shared.config import load
from shared.run_config import RunConfig
from tests.support import published

pytestmark = pytest.mark.integration
_AS_BEFORE = ["run.seed=0", "trainer.torch_threads=1"]


def _backend(model_dir, threshold=None) -> Backend:
    overrides = [f"policy.model_name={model_dir}", "data.train_path=t.jsonl", "policy.optimizer.lr=1e-3", *_AS_BEFORE]
    if threshold is not None:
        overrides.append(f"grpo.seq_logprob_error_threshold={threshold}")
    return build_backend(load(RunConfig, None, overrides, env={}))


def _rows(backend: Backend) -> tuple[Row, Row]:
    """A row whose generator logprobs equal the trainer's, and one that disagrees by 3 nats a token."""
    rng = np.random.default_rng(0)
    rows = []
    for i, shift in enumerate((0.0, 3.0)):
        ids = rng.integers(10, 800, size=14).astype(np.int64)
        tmask = np.zeros(14, np.float32)
        tmask[6:] = 1.0
        row = Row(f"t{i}", "g0", ids, tmask, np.zeros(14, np.float32), reward=1.0, advantage=1.0 - 2 * i)
        with torch.no_grad():
            lp = backend.logprobs([row])[0].numpy()
        row.gen_logprobs = ((lp - shift) * tmask).astype(np.float32)
        rows.append(row)
    return rows[0], rows[1]


def _params(backend):
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def _grads(backend):
    """The gradient the last optimizer update applied (normalised and clipped; zero where none)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten() for p in backend.model.parameters()]
    )


def _same_update(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float summation order (BLAS kernels differ between machines and batch shapes):
    the claims are about what entered the update, so gradients are compared, never the parameters
    AdamW moved (it turns a sign flip of a near-zero gradient into a full step)."""
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_a_row_over_the_threshold_is_taken_out_of_the_update(tiny_model_dir, caplog, monkeypatch):
    monkeypatch.setenv("STREAMRL_LP_MASK_DEBUG", "1")
    masked = _backend(tiny_model_dir, threshold=2.0)
    good, bad = _rows(masked)
    metrics = masked.train_step(StepBatch([good, bad]))
    assert metrics.num_masked_seqs_by_logprob_error == 1
    assert metrics.max_seq_mult_prob_error == pytest.approx(np.exp(3.0), rel=1e-3)
    assert metrics.max_seq_mult_prob_error_after_mask == pytest.approx(1.0, abs=1e-4)
    assert metrics.masked_correct_pct == 100.0
    assert "[lp-mask-debug] masked(len,err,rew)=8,20.09,1 | kept_len mean=8.0" in caplog.text

    alone = _backend(tiny_model_dir)
    good2, _ = _rows(alone)
    m_alone = alone.train_step(StepBatch([good2]))
    # Same update as training on the kept row alone: masking also removed it from the normaliser.
    assert metrics.loss == pytest.approx(m_alone.loss, rel=1e-4)
    assert _same_update(_grads(masked), _grads(alone))

    unmasked = _backend(tiny_model_dir)
    good3, bad3 = _rows(unmasked)
    m = unmasked.train_step(StepBatch([good3, bad3]))
    assert m.num_masked_seqs_by_logprob_error is None
    assert float((_grads(unmasked) - _grads(alone)).norm()) > 0.05 * float(_grads(alone).norm())


def test_an_update_with_nothing_left_is_skipped(tiny_model_dir):
    backend = _backend(tiny_model_dir, threshold=1.5)
    _, bad = _rows(backend)
    before = _params(backend).clone()
    m = backend.train_step(StepBatch([bad]))
    assert m.num_masked_seqs_by_logprob_error == 1 and m.grad_norm == 0.0
    assert torch.equal(before, _params(backend))


def _varied_rows(n=7, seed=1):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(6, 40))
        ids = rng.integers(10, 800, size=length).astype(np.int64)
        tmask = np.zeros(length, np.float32)
        tmask[length // 2 :] = 1.0
        gen = (rng.normal(-3.0, 0.5, size=length) * tmask).astype(np.float32)
        rows.append(Row(f"t{i}", f"g{i // 2}", ids, tmask, gen, reward=float(i % 2), advantage=float(rng.normal())))
    return rows


def _packing_backend(model_dir, packed: bool) -> Backend:
    overrides = [
        f"policy.model_name={model_dir}",
        "data.train_path=t.jsonl",
        "policy.train_micro_batch_size=3",
        f"policy.sequence_packing.enabled={'true' if packed else 'false'}",
        "policy.sequence_packing.train_mb_tokens=64",
        *_AS_BEFORE,
    ]
    return build_backend(load(RunConfig, None, overrides, env={}))


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_hybrid_moe_dir"])
def test_packed_and_unpacked_training_agree(model, request):
    """Also on the hybrid model, whose linear-attention layers carry a convolution window and a
    recurrent state along the sequence: inside a pack, neither may reach into the next row."""
    model_dir = request.getfixturevalue(model)
    plain, packed = _packing_backend(model_dir, False), _packing_backend(model_dir, True)
    rows = _varied_rows()
    with torch.no_grad():
        inputs = plain.inputs(rows)
        a = plain.logprobs(rows) * inputs.attention_mask  # padding scored too
        b = packed.logprobs(rows)
    assert packed.inputs(rows).pack is not None and inputs.pack is None
    assert torch.allclose(a, b, atol=1e-5)  # no row attends to another inside a pack
    m_plain = plain.train_step(StepBatch(_varied_rows()))
    m_packed = packed.train_step(StepBatch(_varied_rows()))
    assert m_packed.loss == pytest.approx(m_plain.loss, abs=1e-5)
    assert m_packed.grad_norm == pytest.approx(m_plain.grad_norm, abs=1e-5)
    assert _same_update(_grads(packed), _grads(plain))  # the same gradient went into the optimizer
    assert m_packed.micro_batch_token_efficiency > m_plain.micro_batch_token_efficiency


def test_the_samples_of_a_rollout_split_at_a_prefix_break_keep_their_own_old_logprobs(tiny_model_dir):
    """With ``env.on_prefix_break: new_sample`` a rollout becomes rows of different tokens that
    share its task id; with several updates a step scores every row under the old policy once,
    and each row must get its own scores back (they were keyed by task id: the head's were lost,
    and a segment's scores did not even have its length)."""
    head, _ = _rows(_backend(tiny_model_dir))
    tail = Row("t0", "g0", head.input_ids[:9].copy(), head.token_mask[:9].copy(), head.gen_logprobs[:9].copy(), 1.0)
    tail.segment, tail.advantage = 1, head.advantage
    head.segments = [tail]
    other, _ = _rows(_backend(tiny_model_dir))
    other.task_id, other.advantage = "t2", -1.0
    overrides = [f"policy.model_name={tiny_model_dir}", "data.train_path=t.jsonl", "policy.train_global_batch_size=1"]
    cfg = load(RunConfig, None, [*overrides, *_AS_BEFORE], env={})
    backend = build_backend(cfg)
    shares = plan_step(StepBatch([head, other, tail]), 1, cfg.policy.train_global_batch_size)
    [share] = shares
    assert len(share.updates) == 3  # one row per update: the old-policy scores are taken first
    prev = backend.rows_logprobs(share.rows, share.filler)
    assert set(prev) == {"t0", "t0#1", "t2"}
    assert prev["t0"].shape[0] == len(head.input_ids) and prev["t0#1"].shape[0] == len(tail.input_ids)
    torch.testing.assert_close(prev["t0#1"][:9], prev["t0"][:9])  # the same prefix scores the same
    m = backend.train_share(share)
    assert m.num_updates == 3 and np.isfinite(m.loss)


def test_the_multimodal_checkpoint_trains_and_is_published_as_it_was(tiny_multimodal_moe_dir, tmp_path):
    """The released Qwen3.5-MoE format: transformers builds its language model
    (``Qwen3_5MoeForCausalLM`` from ``text_config``); the backend streams and publishes it under
    ``model.language_model.*``, carries the vision tower and MTP weights, and publishes the
    multimodal config (`tests.support.published`)."""
    backend = _backend(tiny_multimodal_moe_dir)
    published.assert_trains_and_publishes_as_started(backend, tiny_multimodal_moe_dir, tmp_path / "weights", 1e-5)
