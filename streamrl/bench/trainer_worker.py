"""One process of the trainer section of ``streamrl bench`` (`streamrl.bench.trainer` starts it).

    python -m streamrl.bench.trainer_worker compare MODEL OUT.json --rounds R --threads T
    torchrun --nproc-per-node N -m streamrl.bench.trainer_worker scale MODEL OUT.json --rounds R
    torchrun --nproc-per-node N -m streamrl.bench.trainer_worker state MODEL OUT.json --saves S
    torchrun --nproc-per-node N -m streamrl.bench.trainer_worker load MODEL OUT.json [--whole]

* ``compare`` (one rank): the real backend (`Backend.train_step` over the transformers adapter)
  against `BareLoop`, the same model, batch, loss and AdamW written plainly in torch, alternated
  step by step for R rounds.
* ``scale``: the learner over N ranks as the trainer runs it (`RankedLearner` on rank 0, `follow`
  on the others) against a one-rank learner (`LocalLearner`) in rank 0 with the same threads,
  alternated step by step; rank 0 times each ``train`` call.
* ``state``: the bytes of each rank's parameters, gradients and optimizer state (a DTensor's
  local shard) after one step (`plan_step`, then `train_share` on every rank), and of a one-rank
  backend after the same step; then S synchronous and S asynchronous `save_checkpoint` calls,
  alternated: the time until it returns and until the checkpoint is on disk (`wait_for_save`),
  the slowest rank's.
* ``load``: each rank's peak memory growth, seconds and checkpoint bytes read while it builds the
  policy: reading only its shards (`services.trainer.sharded_load`), or with ``--whole`` loading
  the whole checkpoint and then sharding it.

Rank 0 writes OUT.json (a `streamrl.bench.trainer_results.WorkerOut`). The batch is fixed by a
seed, so every rank and every process builds the same.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from services.trainer.backends import build_backend
from services.trainer.backends.backend import Backend
from services.trainer.backends.hf_adapter import HFAdapter
from services.trainer.batch import Row, StepBatch
from services.trainer.learner import Learner, LocalLearner
from services.trainer.rank_learner import RankedLearner, follow
from services.trainer.ranks import SINGLE, Ranks, join, launched_world_size, leaving
from services.trainer.step_plan import plan_step
from shared.config import load
from shared.run_config import RunConfig
from streamrl.bench.trainer_results import Build, PairedRound, Save, StateBytes, WorkerOut

GROUP_SIZE = 4
MICRO_BATCH = 4


def bench_batch(num_rows: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> StepBatch:
    """``num_rows`` rows in groups of 4, lengths in [min_len, max_len], the second half of each row
    generated, generator logprobs near a uniform policy's (importance weights near 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_rows):
        n = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(0, vocab_size, size=n).astype(np.int64)
        tmask = np.zeros(n, np.float32)
        tmask[n // 2 :] = 1.0
        glp = ((-np.log(vocab_size) + rng.normal(0.0, 0.05, size=n)) * tmask).astype(np.float32)
        adv = float(rng.normal())
        rows.append(Row(f"t{i}", f"g{i // GROUP_SIZE}", ids, tmask, glp, reward=adv, advantage=adv))
    return StepBatch(rows=rows)


def config(model: str, threads: int, extra: list[str]) -> RunConfig:
    """The run config the backend and the bare loop read: the trainer's defaults (float32, one
    update per step, AdamW) with 4-row micro-batches and ``threads`` torch threads."""
    return load(
        RunConfig,
        None,
        [
            f"policy.model_name={model}",
            "data.train_path=t.jsonl",
            f"policy.train_micro_batch_size={MICRO_BATCH}",
            f"trainer.torch_threads={threads}",
            "trainer.collective_timeout_s=300",
            *extra,
        ],
        env={},
    )


# -- the bare loop -----------------------------------------------------------------------------


def grpo_token_loss(
    curr_lp: torch.Tensor, gen_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: RunConfig
) -> torch.Tensor:
    """Sum over masked tokens of the clipped policy-gradient term times the truncated importance
    weight exp(old - gen); old = the current policy before the update (one update per step)."""
    loss_cfg = cfg.loss_fn
    old_lp = curr_lp.detach()
    ratio = torch.exp(curr_lp - old_lp)
    clipped = ratio.clamp(1.0 - loss_cfg.ratio_clip_min, 1.0 + loss_cfg.ratio_clip_max)
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * clipped)
    weight = torch.exp(old_lp - gen_lp).clamp(min=0.0, max=loss_cfg.truncated_importance_sampling_ratio)
    return (pg * weight * mask).sum()


class BareLoop:
    """The same training step with nothing of streamrl around it: its own copy of the model, rows
    shortest first in micro-batches padded to their longest row, the loss over the batch's valid
    tokens, gradient clipping and AdamW."""

    def __init__(self, cfg: RunConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=torch.float32)
        self.model.train()
        opt = cfg.policy.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def step(self, batch: StepBatch) -> float:
        """One optimizer update over the batch; its loss (mean over valid tokens)."""
        rows = sorted(batch.rows, key=lambda r: len(r.input_ids))
        valid = float(sum(r.token_mask.sum() for r in rows))
        micro = self.cfg.policy.train_micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for s in range(0, len(rows), micro):
            loss = self._micro_batch_loss(rows[s : s + micro]) / valid
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.policy.max_grad_norm)
        self.optimizer.step()
        return total

    def _micro_batch_loss(self, rows: list[Row]) -> torch.Tensor:
        def padded(arrays: list[np.ndarray], value: float) -> torch.Tensor:
            tensors = [torch.from_numpy(a) for a in arrays]
            return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)

        ids = padded([r.input_ids for r in rows], self.pad_id)
        attn = padded([np.ones(len(r.input_ids), np.int64) for r in rows], 0)
        mask = padded([r.token_mask for r in rows], 0.0)[:, 1:]
        gen_lp = padded([r.gen_logprobs for r in rows], 0.0)[:, 1:]
        adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
        logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        if self.cfg.policy.generation.temperature != 1.0:
            logits = logits / self.cfg.policy.generation.temperature
        curr_lp = torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(-1)
        return grpo_token_loss(curr_lp, gen_lp, adv, mask, self.cfg)


# -- modes -------------------------------------------------------------------------------------


def compare(cfg: RunConfig, batch: StepBatch, rounds: int) -> WorkerOut:
    """One warm-up step each (their losses show both sides train the same thing), then ``rounds``
    rounds of one step each, in the order backend bare, bare backend, ..."""
    backend = build_backend(cfg, SINGLE)  # trainer.backend: torch or megatron
    bare = BareLoop(cfg)
    steps: dict[str, Callable[[], object]] = {
        "backend": lambda: backend.train_step(batch),
        "bare": lambda: bare.step(batch),
    }
    backend_loss, bare_loss = backend.train_step(batch).loss, bare.step(batch)
    out = []
    for r in range(rounds):
        times = {}
        for name in ("backend", "bare") if r % 2 == 0 else ("bare", "backend"):
            t0 = time.perf_counter()
            steps[name]()
            times[name] = time.perf_counter() - t0
        out.append(PairedRound(times["backend"], times["bare"], os.getloadavg()[0]))
    return WorkerOut(rounds=out, backend_loss=backend_loss, bare_loss=bare_loss)


async def _alternate(learners: dict[str, Learner], batch: StepBatch, rounds: int) -> list[PairedRound]:
    """One warm-up step each, then ``rounds`` rounds of one step each, in the order A B, B A, ...
    (A: the side, B: the baseline)."""
    names = list(learners)
    for learner in learners.values():
        await learner.start()
        await learner.train(batch)
    out = []
    for r in range(rounds):
        times = {}
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            await learners[name].train(batch)
            times[name] = time.perf_counter() - t0
        out.append(PairedRound(times[names[0]], times[names[1]], os.getloadavg()[0]))
    for learner in learners.values():
        await learner.close()
    return out


def scale(cfg: RunConfig, ranks: Ranks, batch: StepBatch, rounds: int) -> WorkerOut | None:
    """Under torchrun: the learner over every rank (`RankedLearner` on rank 0, `follow` on the
    others) against a one-rank learner of rank 0 with the same threads, alternated step by step;
    the other ranks wait in `follow` (a gloo wait takes no CPU) while the one-rank learner trains."""
    if not ranks.is_root:
        follow(build_backend(cfg, ranks))
        return None
    learners: dict[str, Learner] = {
        "ranked": RankedLearner(
            lambda: build_backend(cfg, ranks), ranks, collective_timeout_s=cfg.trainer.collective_timeout_s
        ),
        "single": LocalLearner(lambda: build_backend(cfg)),
    }
    return WorkerOut(rounds=asyncio.run(_alternate(learners, batch, rounds)))


def alone(cfg: RunConfig, ranks: Ranks, batch: StepBatch, rounds: int) -> WorkerOut | None:
    """The learner as the trainer runs it at this world size (``trainer.backend`` either one), timed
    alone for ``rounds`` steps after a warm-up step; rank 0's training state after them."""
    if not ranks.is_root:
        follow(build_backend(cfg, ranks))
        return None
    learner: RankedLearner | LocalLearner
    if ranks.sharded:
        timeout_s = cfg.trainer.collective_timeout_s
        learner = RankedLearner(lambda: build_backend(cfg, ranks), ranks, collective_timeout_s=timeout_s)
    else:
        learner = LocalLearner(lambda: build_backend(cfg, ranks))

    async def run() -> WorkerOut:
        await learner.start()
        await learner.train(batch)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await learner.train(batch)
            times.append(time.perf_counter() - t0)
        backend = learner.backend
        assert isinstance(backend, Backend)
        out = WorkerOut(step_s=times, state=state_bytes(backend), load_avg=os.getloadavg()[0])
        await learner.close()
        return out

    return asyncio.run(run())


def _local_bytes(t: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    local: torch.Tensor = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel()) * int(local.element_size())


def state_bytes(backend: Backend) -> StateBytes:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    params = list(backend.model.parameters())
    from services.trainer.backends.megatron_optim import owned_states  # a sharded optimizer's own state too

    optim = sum(
        _local_bytes(v) for _, s in owned_states(backend.optimizer) for v in s.values() if isinstance(v, torch.Tensor)
    )
    return StateBytes(
        params=sum(_local_bytes(p) for p in params), grads=sum(_local_bytes(p.grad) for p in params), optimizer=optim
    )


def state(cfg: RunConfig, ranks: Ranks, batch: StepBatch, saves: int, work: Path) -> WorkerOut | None:
    """Under torchrun: bytes of training state per rank after one step, and rank 0's on one rank
    (a one-rank backend of its own, freed before the sharded one is built); then the saves."""
    single = None
    if ranks.is_root:
        one = build_backend(cfg)
        one.train_step(batch)
        single = state_bytes(one)
        del one
        gc.collect()
    backend = build_backend(cfg, ranks)
    shares = plan_step(batch, ranks.world_size, cfg.policy.train_global_batch_size)
    backend.train_share(shares[ranks.rank])
    out = WorkerOut(single=single, ranks=ranks.gather(state_bytes(backend)))
    for i in range(-2, 2 * saves):  # two warm-up saves (one of each), then sync/async alternated
        backend.checkpoint.async_save = i % 4 in (1, 2)  # the trainer's checkpointing.async_save
        out.saves.append(_save(backend, ranks, work / f"ckpt{i + 2}", warm_up=i < 0))
    return out if ranks.is_root else None


def building(cfg: RunConfig, ranks: Ranks, whole: bool) -> WorkerOut | None:
    """Under torchrun: what building the policy costs each rank: the growth of its peak private
    memory (anonymous pages, sampled every 2 ms: a checkpoint read through a file mapping also
    counts in the resident size, but those pages are the page cache's, shared and reclaimable), the
    seconds, and the checkpoint bytes it read. ``whole``: as every rank did before reading only
    its shards (the whole checkpoint loaded, then sharded)."""
    import threading

    import torch.distributed.fsdp  # noqa: F401  (imports are not what is measured)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the model's code imported, nothing allocated
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.policy.model_name))
    gc.collect()
    before = _anon_bytes()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    backend = build_backend(cfg, ranks, adapter=HFAdapter.from_config(cfg, ranks, read_own_shards=not whole))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _anon_bytes())
    rows = ranks.gather(Build(peak[0] - before, seconds, backend.checkpoint_bytes_read))
    return WorkerOut(builds=rows) if ranks.is_root else None


def _anon_bytes() -> int:
    """This process's resident anonymous memory (RssAnon), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _save(backend: Backend, ranks: Ranks, path: Path, *, warm_up: bool) -> Save:
    """Seconds until `save_checkpoint` returns and until the checkpoint is on disk, the slowest rank's."""
    import torch.distributed as dist

    if ranks.is_root:
        path.mkdir(parents=True)
    if ranks.sharded:
        dist.barrier()
    t0 = time.perf_counter()
    backend.save_checkpoint(path)
    blocking = time.perf_counter() - t0
    backend.wait_for_save()
    on_disk = time.perf_counter() - t0
    blocking, on_disk = ranks.all_max([blocking, on_disk])  # every rank's write is done past this
    num_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if ranks.is_root else 0
    if ranks.is_root:
        shutil.rmtree(path)
    return Save(backend.checkpoint.async_save, warm_up, blocking, on_disk, num_bytes)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("compare", "scale", "state", "load", "alone"))
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--saves", type=int, default=0)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--whole", action="store_true", help="load: the whole checkpoint on every rank")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    args = p.parse_args()
    out = Path(args.out)
    cfg = config(args.model, args.threads, args.set)
    vocab = int(msgspec.json.decode((Path(args.model) / "config.json").read_bytes())["vocab_size"])
    batch = bench_batch(args.rows, args.min_len, args.max_len, vocab)
    ranks = join(cfg.trainer.collective_timeout_s) if launched_world_size() > 1 else SINGLE
    with leaving(ranks):
        if args.mode == "compare":
            result: WorkerOut | None = compare(cfg, batch, args.rounds)
        elif args.mode == "scale":
            result = scale(cfg, ranks, batch, args.rounds)
        elif args.mode == "alone":
            result = alone(cfg, ranks, batch, args.rounds)
        elif args.mode == "state":
            result = state(cfg, ranks, batch, args.saves, out.parent / f"{out.stem}-ckpt")
        else:
            result = building(cfg, ranks, args.whole)
    if result is not None:
        tokens = sum(len(r.input_ids) for r in batch.rows)
        result = msgspec.structs.replace(result, world_size=ranks.world_size, tokens=tokens)
        out.write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
