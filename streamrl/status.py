"""``streamrl status``: what a run is doing, read from Redis (and the trainer, when it answers).

    Redis URL:  --redis-url, else REDIS_URL, else the run file (run.json of ``streamrl up``)
    run id:     --run-id, else the run file, else the only run found in that Redis
    -> snapshot (shared.queue_stats): services with state, weight version, in flight, heartbeat
       age; stream lengths; pending entries per group and consumer; the trainer's step and pauses;
       each generator's health (shared.fleet_health: serving, degraded, draining, lost, and why)
    -> the trainer's GET /status (bearer token sent when set) for the step budget, buffer and
       reward, if it answers within 2 s (at --url / STREAMRL_TRAINER_URL / run.json, else its
       registered URL)
    -> a table (or ``--json``)

With no Redis URL anywhere but a trainer URL (a port-forwarded cluster), the trainer's own view
is shown instead.

Nothing is written to Redis. Called by `streamrl.cli`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared import keys as K
from shared.auth import client_headers, load_api_token, redact_url
from shared.fleet_health import fleet_health
from shared.protocol import RUN_FILE, ProtocolError, RunFile, read_run_file
from shared.queue_stats import RunSnapshot, find_runs, snapshot
from shared.records import TrainerStatus, read_records, step_records

if TYPE_CHECKING:
    from rich.console import Console


class StatusError(RuntimeError):
    """The run cannot be found or reached; the message says what to set."""


def find_run_file(run_dir: Path | None) -> tuple[Path, RunFile] | None:
    """The folder and run file of ``run_dir`` (or of runs/demo, then any folder under runs/); None
    if none."""
    candidates = [run_dir] if run_dir else [Path("runs/demo"), *sorted(Path("runs").glob("*"))]
    for d in candidates:
        f = Path(d) / RUN_FILE
        if f.is_file():
            try:
                return Path(d), read_run_file(f)
            except ProtocolError as exc:
                raise StatusError(str(exc)) from None
    if run_dir:
        raise StatusError(f"no {RUN_FILE} in {run_dir} (is it the output folder of `streamrl up`?)")
    return None


def no_live_run(folder: Path, run: RunFile) -> str | None:
    """What to say when the run a run file names has ended: none of the processes it records is
    alive (a live one: None, the run's Redis may just be slow or moved). Where the last run wrote
    its records and logs, and its last step record."""
    if any(child.pid is not None and _alive(child.pid) for child in run.children.values()):
        return None
    try:
        steps = step_records(read_records(folder / "metrics.jsonl"))
        last = f"its last step record is step {steps[-1].step}" if steps else "it wrote no step record"
    except ValueError as exc:  # a line that is no record
        last = f"its records do not read: {exc}"
    return (
        f"no run is live: the last one in {folder} (run id {run.run_id!r}) has ended and none of its "
        f"processes is running; {last}. Records: {folder / 'metrics.jsonl'}, logs: {folder / 'logs'}"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def resolve_redis_url(option: str | None, run_file: RunFile | None) -> str:
    url = option or os.environ.get("REDIS_URL") or (run_file.redis_url if run_file else None)
    if not url:
        raise StatusError("no Redis to read: pass --redis-url, set REDIS_URL, or point --run-dir at a run")
    if "***" in url:
        raise StatusError(f"the run file records {url} without its password: set REDIS_URL")
    return url


async def gather(redis_url: str, run_id: str | None) -> RunSnapshot:
    from shared.streams import connect

    redis = connect(redis_url, socket_timeout_s=5.0, ride_out_restarts=False)
    try:
        if run_id is None:
            runs = await find_runs(redis)
            if len(runs) != 1:
                found = ", ".join(runs) if runs else "none"
                raise StatusError(f"pass --run-id: runs in Redis at {redact_url(redis_url)}: {found}")
            run_id = runs[0]
        snap = await snapshot(redis, run_id)
        gens = [w.heartbeat for w in snap.workers if w.heartbeat.kind == "generator"]
        snap.health = await fleet_health(redis, K.RunKeys(run_id), heartbeats=gens, record=False)
        return snap
    except StatusError:
        raise
    except Exception as exc:
        raise StatusError(f"cannot read Redis at {redact_url(redis_url)}: {type(exc).__name__}: {exc}") from None
    finally:
        await redis.aclose()


def fetch_trainer_status(url: str, timeout_s: float = 2.0) -> TrainerStatus:
    """GET <url>/status with the API token; StatusError naming the trainer and the refusal."""
    import httpx

    try:
        r = httpx.get(f"{url}/status", headers=client_headers(load_api_token()), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach the trainer at {url}: {exc}") from None
    if r.status_code != 200:
        raise StatusError(f"the trainer at {url} answered {r.status_code}: {r.text[:300]}")
    try:
        return msgspec.json.decode(r.content, type=TrainerStatus)
    except msgspec.DecodeError as exc:
        raise StatusError(f"the trainer at {url} answered /status with something unexpected: {exc}") from None


def trainer_status(snap: RunSnapshot, url: str | None = None) -> TrainerStatus | None:
    """The trainer's own /status (at ``url``, else its registered URL), or None when it does not answer."""
    trainers = [w.heartbeat.url for w in snap.workers if w.heartbeat.kind == "trainer"]
    url = url or (trainers[0] if trainers else None)
    if url is None:
        return None
    try:
        return fetch_trainer_status(url)
    except StatusError:
        return None


def render_trainer_only(trainer: TrainerStatus, console: Console | None = None) -> None:
    """Without Redis: the trainer's view (workers from its registry read, no queues)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(
        f"run {trainer.run_id}: step {trainer.step}/{trainer.max_num_steps} ({trainer.state})  "
        f"pause {', '.join(trainer.pause) or '-'}  (from the trainer; set REDIS_URL for queues)"
        + (f"\npaused by the trainer: {trainer.pause_detail}" if trainer.pause_detail else "")
    )
    t = Table(title="services")
    for col in ("kind", "id", "state", "weight version", "in flight", "health"):
        t.add_column(col)
    for w in trainer.workers:
        health = f"{w.health}: {w.health_reason}" if w.health else ""
        t.add_row(w.kind, w.id, w.state, str(w.weight_version), str(w.in_flight), health)
    console.print(t)
    _trainer_line(trainer, console)


def current_step(snap: RunSnapshot, trainer: TrainerStatus | None) -> int:
    """Steps done: the trainer writes the key after each step, so none yet (or only its REST view) is 0."""
    if snap.step is not None:
        return snap.step
    return trainer.step if trainer else 0


def to_json(snap: RunSnapshot, trainer: TrainerStatus | None) -> str:
    data = dataclasses.asdict(dataclasses.replace(snap, health={}))
    data["health"] = msgspec.to_builtins(snap.health)
    data["step"] = current_step(snap, trainer)
    data["workers"] = [{**msgspec.to_builtins(w.heartbeat), "heartbeat_age_s": w.age_s} for w in snap.workers]
    data["trainer"] = msgspec.to_builtins(trainer) if trainer else None
    return json.dumps(data, indent=2, default=str)


def render(snap: RunSnapshot, trainer: TrainerStatus | None, console: Console | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    step = str(current_step(snap, trainer))
    if trainer:
        step += f"/{trainer.max_num_steps} ({trainer.state})"
    console.print(f"run {snap.run_id}: step {step}  pause {', '.join(snap.pause) or '-'}")
    if trainer and trainer.pause_detail:
        console.print(f"paused by the trainer: {trainer.pause_detail}")
    services = Table(title="services")
    for col in ("kind", "id", "url", "state", "weight version", "in flight", "heartbeat age", "health"):
        services.add_column(col)
    for w in snap.workers:
        hb = w.heartbeat
        services.add_row(
            hb.kind,
            hb.worker_id,
            hb.url,
            hb.state + (f" ({hb.error})" if hb.error else ""),
            "-" if hb.kind == "gym_gateway" else str(hb.weight_version),
            str(hb.in_flight),
            f"{w.age_s:.1f}s",
            _health(snap, hb.worker_id),
        )
    live = {w.heartbeat.worker_id for w in snap.workers}
    for gid in sorted(set(snap.health) - live):  # lost: known to the fleet, no heartbeat any more
        services.add_row("generator", gid, "-", "gone", "-", "-", "-", _health(snap, gid))
    console.print(services)
    queues = Table(title="queues")
    for col in ("stream", "length", "group", "pending", "lag", "pending per consumer"):
        queues.add_column(col)
    groups = {g.stream: g for g in snap.groups}
    for name, length in snap.streams.items():
        g = groups.get(name)
        per = ", ".join(f"{c.name}={c.pending}" for c in g.consumers if c.pending) if g else ""
        queues.add_row(
            name,
            str(length),
            g.group if g else "",
            str(g.pending) if g else "",
            "" if g is None or g.lag is None else str(g.lag),
            per or ("-" if g else ""),
        )
    console.print(queues)
    if trainer:
        _trainer_line(trainer, console)


def _health(snap: RunSnapshot, worker_id: str) -> str:
    h = snap.health.get(worker_id)
    return f"{h.state}: {h.reason}" if h else ""


def _trainer_line(trainer: TrainerStatus, console: Console) -> None:
    reward = f"{trainer.last.batch.reward_mean:.3f}" if trainer.last else "-"
    console.print(
        f"trainer: weight version {trainer.weight_version}  buffer {trainer.buffer_depth}  "
        f"in flight {trainer.in_flight_groups}  reward {reward}"
    )
    if trainer.error:
        console.print(f"[red]error: {trainer.error}[/red]")


def run_status(
    redis_url: str | None, run_id: str | None, run_dir: Path | None, as_json: bool, trainer_url: str | None = None
) -> str | None:
    """Gather and print; returns the JSON text with ``as_json`` (printed by the caller). Without
    any Redis URL but with a trainer URL (--url, STREAMRL_TRAINER_URL) the trainer's view alone."""
    # A Redis named on the command line or in the environment is not paired with some other run's file.
    explicit = redis_url or os.environ.get("REDIS_URL")
    trainer_url = trainer_url or os.environ.get("STREAMRL_TRAINER_URL")
    found = find_run_file(run_dir) if run_dir or not (explicit or trainer_url) else None
    run_file = found[1] if found else None
    trainer_url = (trainer_url or (run_file.trainer_url if run_file else "")).rstrip("/")
    if not (explicit or (run_file and run_file.redis_url)) and trainer_url:
        alone = fetch_trainer_status(trainer_url, timeout_s=10.0)
        if as_json:
            return json.dumps({"trainer": msgspec.to_builtins(alone)}, indent=2)
        render_trainer_only(alone)
        return None
    url = resolve_redis_url(redis_url, run_file)
    try:
        snap = asyncio.run(gather(url, run_id or (run_file.run_id if run_file else None)))
    except StatusError:
        ended = no_live_run(*found) if found and not explicit else None
        if ended is None:
            raise
        raise StatusError(ended) from None
    trainer = trainer_status(snap, trainer_url or None)
    if as_json:
        return to_json(snap, trainer)
    render(snap, trainer)
    return None
