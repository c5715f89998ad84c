"""A whole run of the demo on the tiny model, its services started as processes by the test, so
that it can kill (SIGKILL), freeze (SIGSTOP) and restart each of them by pid, and then audit what a
user would: the trainer's exit code and error, the per-step ledger of consumed trajectory ids in
metrics.jsonl, and the trajectories published per task id. Used by tests/faults, tests/soak and the
``streamrl up`` tests of tests/e2e.

* `write_run_config`: a run config (the demo's, on the tiny model with the transformers engine,
  which starts in seconds) with dotted overrides; `demo_run` the same as a `FaultRun`.
* `FaultRun`: the run's services (`tests.support.services.Service`), its output folder and
  read-only views of its Redis.
* `StreamTail`: every entry of a stream as it was published, read as it comes (the run may trim
  acknowledged entries later), riding out Redis restarts and pauses.
* `read_metrics`, `ledger` and the assertions on them.

Long variants of the tests are skipped unless STREAMRL_LONG_TESTS=1 (`long_variant`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from shared import keys as K
from shared.protocol import Heartbeat, Trajectory, decode
from tests.support.services import ROOT, Service, make_data

_skip_unless_long = pytest.mark.skipif(
    os.environ.get("STREAMRL_LONG_TESTS") != "1", reason="long variant: set STREAMRL_LONG_TESTS=1 to run it"
)


def long_variant(test):
    """Marks a long variant (``-m long`` selects them) and skips it unless STREAMRL_LONG_TESTS=1."""
    return pytest.mark.long(_skip_unless_long(test))


def batch(steps: int, prompts: int, generations: int) -> dict[str, int]:
    """The overrides of a run of ``steps`` steps of ``prompts`` groups of ``generations``."""
    return {
        "grpo.max_num_steps": steps,
        "grpo.num_prompts_per_step": prompts,
        "grpo.num_generations_per_prompt": generations,
    }


def write_run_config(
    folder: Path, model_dir: Path, redis_url: str | None, run_id: str, overrides: dict[str, Any]
) -> Path:
    """The demo config on the tiny model and the transformers engine, without validations, with
    ``overrides`` (dotted keys) on top; written to ``folder/run.yaml``. Its data (200 training
    rows, 4 validation rows) in ``folder/data``."""
    train, val = folder / "data" / "train.jsonl", folder / "data" / "val.jsonl"
    for path, n in ((train, 200), (val, 4)):
        if not path.is_file():  # the runs of one folder share it
            make_data(path, n)
    tree = yaml.safe_load((ROOT / "deploy/configs/demo.yaml").read_text())
    base = {
        "run.run_id": run_id,
        "run.output_dir": str(folder / "run"),
        "redis.url": redis_url,
        "data.train_path": str(train),
        "data.val_path": str(val),
        "policy.model_name": str(model_dir),
        "policy.generation.backend": "transformers",
        "policy.generation.max_new_tokens": 8,
        "grpo.val_at_start": False,
        "grpo.val_at_end": False,
        "logger.plot": False,
    }
    for key, value in {**base, **overrides}.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def output_dir(config: Path) -> Path:
    """Where the run of ``config`` writes (run.json, metrics.jsonl, checkpoints)."""
    return Path(yaml.safe_load(config.read_text())["run"]["output_dir"])


def read_metrics(out: Path) -> list[dict]:
    """The records of ``out/metrics.jsonl`` so far (none before it exists), as dicts."""
    path = out / "metrics.jsonl"
    records: list[dict] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line while the trainer is still writing it
            break
    return records


def demo_run(
    folder: Path, model_dir: Path, redis_url: str, run_id: str, shape: tuple[int, int, int], **more: Any
) -> FaultRun:
    """A `FaultRun` of the demo (`write_run_config`) of ``shape`` (steps, prompts per step,
    generations per prompt), with the dotted overrides ``more`` (``"a.b": v`` as ``**{...}``)."""
    return FaultRun(folder, write_run_config(folder, model_dir, redis_url, run_id, {**batch(*shape), **more}))


class StreamTail(threading.Thread):
    """Reads a stream from its start with XREAD (no consumer group: the run does not see it) and
    keeps every decoded entry; reconnects after Redis errors."""

    def __init__(self, url: str, stream: str, cls: type) -> None:
        super().__init__(daemon=True, name=f"tail-{stream}")
        self.url, self.stream, self.cls = url, stream, cls
        self.entries: list[tuple[str, Any]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        last = "0-0"
        while not self._halt.is_set():
            try:
                with redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2) as r:
                    while not self._halt.is_set():
                        for _, rows in r.xread({self.stream: last}, count=500, block=300) or []:
                            for eid, fields in rows:
                                last = eid.decode()
                                self.entries.append((last, decode(fields[K.ENTRY_FIELD], self.cls)))
            except (OSError, redis.RedisError):
                time.sleep(0.2)

    def stop(self) -> list[Any]:
        """Stop after catching up; the messages read, in order."""
        time.sleep(0.5)
        self._halt.set()
        self.join(10)
        return [m for _, m in self.entries]


class FaultRun:
    """One run's services, output folder and Redis, for a test that injects faults into it."""

    def __init__(self, folder: Path, config: Path) -> None:
        self.folder = folder
        self.config = config
        tree = yaml.safe_load(config.read_text())
        self.tree = tree
        self.out = Path(tree["run"]["output_dir"])
        self.keys = K.RunKeys(tree["run"]["run_id"])
        self.redis_url = tree["redis"]["url"]
        self.services: dict[str, Service] = {}
        self.published = StreamTail(self.redis_url, self.keys.trajectories, Trajectory)
        self.published.start()

    def start(self, module: str, worker_id: str, launcher: list[str] | None = None) -> Service:
        svc = Service(module, self.config, worker_id, self.folder / f"{worker_id}.log", launcher=launcher or [])
        svc.start()
        self.services[worker_id] = svc
        return svc

    def start_services(self, trainer_launcher: list[str] | None = None) -> Service:
        """One generator, one gateway worker and the trainer (started by ``trainer_launcher``
        when given); the trainer."""
        self.start("services.generator", "generator-0")
        self.start("services.gym_gateway", "gateway-0")
        return self.start("services.trainer", "trainer", launcher=trainer_launcher)

    def restart(self, worker_id: str) -> Service:
        """The same command again (same worker id, port and log)."""
        svc = self.services[worker_id]
        return svc.start()

    def stop_all(self) -> None:
        for svc in reversed(list(self.services.values())):
            svc.stop()
        if self.published.is_alive():
            self.published.stop()

    def logs(self, n: int = 2500) -> str:
        return "\n".join(f"--- {wid} ---\n{svc.tail(n)}" for wid, svc in self.services.items())

    # ---- what a user would check ---------------------------------------------------------------

    def records(self) -> list[dict]:
        return read_metrics(self.out)

    def wait_for_step(self, what: str, step: int, timeout_s: float = 400) -> float:
        """Until the trainer recorded training step ``step`` (`wait_for`, polling every 20 ms)."""
        trained = lambda: any(r.get("kind") == "train" and r["step"] >= step for r in self.records())  # noqa: E731
        return self.wait_for(what, trained, timeout_s, poll_s=0.02)

    def trained_steps(self) -> int:
        return len({r["step"] for r in self.records() if r.get("kind") == "train"})

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2)

    def pending_tasks(self, consumer: str) -> list[str]:
        """Entry ids of tasks ``consumer`` has read and not acked (running or held)."""
        with self.client() as r:
            rows = r.xpending_range(self.keys.tasks, K.GATEWAYS_GROUP, "-", "+", 10_000, consumername=consumer)
            return [row["message_id"].decode() for row in rows]

    def task_ids(self, entry_ids: list[str]) -> list[str]:
        from shared.protocol import Task

        with self.client() as r:
            return [decode(r.xrange(self.keys.tasks, e, e)[0][1][K.ENTRY_FIELD], Task).task_id for e in entry_ids]

    def live_workers(self) -> dict[str, Heartbeat]:
        """Registry records whose heartbeat has not expired, by worker id."""
        with self.client() as r:
            ids = [i.decode() for i in r.zrangebyscore(self.keys.registry, time.time(), "+inf")]
            raw = r.hmget(self.keys.registry_info, ids) if ids else []
        return {wid: decode(data, Heartbeat) for wid, data in zip(ids, raw, strict=True) if data is not None}

    def wait_for(
        self,
        what: str,
        cond: Callable[[], bool],
        timeout_s: float,
        poll_s: float = 0.05,
        watch: tuple[str, ...] = ("trainer",),
    ) -> float:
        """Poll ``cond`` until true; fail with the logs if it times out or a watched service exits.
        Returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            try:
                if cond():
                    return time.monotonic() - t0
            except (OSError, redis.RedisError):  # a service or Redis that is not up yet
                pass
            for wid in watch:
                svc = self.services.get(wid)
                if svc is not None and not svc.alive():
                    pytest.fail(f"{wid} exited ({svc.proc.returncode}) while waiting for {what}\n{self.logs()}")
            if time.monotonic() - t0 > timeout_s:
                pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.logs()}")
            time.sleep(poll_s)


def ledger(records: list[dict]) -> dict[int, list[str]]:
    """step -> the trajectory ids the last record of that step consumed."""
    out: dict[int, list[str]] = {}
    for r in records:
        if r.get("kind") == "train":
            out[r["step"]] = r["consumed_ids"]
    return out


def assert_resumed_without_loss(before: list[dict], after: list[dict], checkpoint: int) -> None:
    """Steps the checkpoint covered were recorded once and kept; every trajectory trained after it
    by the killed trainer was trained again after the restart or evicted by id, none skipped."""
    first, final = ledger(before), ledger(after)
    for step in range(checkpoint):  # durable: recorded once, unchanged
        assert sum(r.get("kind") == "train" and r["step"] == step for r in after) == 1
        assert final[step] == first[step]
    lost = {i for step, ids in first.items() if step >= checkpoint for i in ids}
    assert lost, "the kill should have landed after at least one step past the checkpoint"
    resumed_records = after[len(before) :]
    retrained = {i for ids in final.values() for i in ids}
    evicted = {i for r in resumed_records if r.get("kind") == "train" for i in r.get("evicted_ids", [])}
    assert lost <= retrained | evicted, sorted(lost - retrained - evicted)


def assert_every_step_trained_once(records: list[dict], steps: int, rows_per_step: int) -> None:
    """The ledger covers steps 0..steps-1, each with exactly rows_per_step ids, none twice."""
    book = ledger(records)
    assert sorted(book) == list(range(steps)), sorted(book)
    assert {s: len(ids) for s, ids in book.items() if len(ids) != rows_per_step} == {}
    ids = [i for step_ids in book.values() for i in step_ids]
    assert len(ids) == len(set(ids)), "a trajectory id was trained twice"
