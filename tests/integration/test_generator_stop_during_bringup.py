"""A vLLM generator stopped (SIGTERM) while its engine is still being built leaves no process
behind: vLLM's engine core (``VLLM::EngineCore``) and its workers, spawned by the construction
the stop abandoned, go with the generator (`services.generator.vllm_engine`, the abandoned
construction). The generator runs as a process with the vLLM engine on the tiny model and a real
Valkey; the test signals it as soon as the engine core has been spawned, well before the engine
is up (loading the model and sizing the KV cache take seconds more on CPU)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.support.services import Service

pytestmark = pytest.mark.integration

SPAWN_TIMEOUT_S = 120.0  # until the generator has spawned vLLM's engine core (imports, config)
GONE_TIMEOUT_S = 10.0  # after the generator exited, for its descendants to be gone


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (a zombie has ended), each once."""
    alive: dict[int, psutil.Process] = {}
    for p in procs:
        try:
            # is_running compares the creation time too: a reused pid is not "alive".
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive[p.pid] = p
        except psutil.Error:  # gone meanwhile
            pass
    return list(alive.values())


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()!r} {' '.join(p.cmdline())[:120]!r}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


def _wait_for_engine_core(gen: Service, parent: psutil.Process) -> list[psutil.Process]:
    """Until vLLM's engine core process is a child of the generator; the generator's descendants."""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while True:
        assert gen.alive(), f"the generator exited before spawning its engine:\n{gen.tail()}"
        assert time.monotonic() < deadline, f"no engine core within {SPAWN_TIMEOUT_S:.0f}s:\n{gen.tail()}"
        try:
            children = parent.children(recursive=True)
            if any("VLLM" in p.name() or "EngineCore" in " ".join(p.cmdline()) for p in children):
                return children
        except psutil.Error:  # a child that went between the listing and the look
            pass
        time.sleep(0.05)


def _follow_until_exit(gen: Service, parent: psutil.Process, seen: list[psutil.Process]) -> list[psutil.Process]:
    """Until the generator exited (at most a minute), adding what it spawns meanwhile to ``seen``."""
    deadline = time.monotonic() + 60.0
    while gen.alive():
        assert time.monotonic() < deadline, f"the generator did not exit within 60s of SIGTERM:\n{gen.tail()}"
        try:
            seen += [p for p in parent.children(recursive=True) if p not in seen]
        except psutil.Error:  # it is exiting
            pass
        time.sleep(0.05)
    return seen


def _in_session(sid: int) -> list[psutil.Process]:
    """The processes of the generator's session (it leads one): its descendants, orphaned ones too."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != sid and os.getsid(p.pid) == sid:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def test_a_vllm_generator_stopped_during_bring_up_leaves_no_process(write_config, tiny_model_dir, redis_url, tmp_path):
    config, _ = write_config(tiny_model_dir, redis_url=redis_url, backend="vllm")
    gen = Service("services.generator", config, "gen-bringup", tmp_path / "generator.log", port=0).start()
    descendants: list[psutil.Process] = []
    try:
        parent = psutil.Process(gen.pid)
        descendants = _wait_for_engine_core(gen, parent)
        assert gen.alive() and "vLLM engine up" not in gen.tail(10**7), "the engine was up: not a bring-up stop"
        # The generator alone (the way a scale-down stops it); it must stop what it started.
        gen.proc.send_signal(signal.SIGTERM)
        descendants = _follow_until_exit(gen, parent, descendants)
        assert gen.proc.returncode in (0, 1, -signal.SIGTERM), gen.tail()
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while left := _alive(descendants + _in_session(gen.pid)):
            assert time.monotonic() < deadline, (
                f"left running after the generator exited: {_describe(left)}\n{gen.tail(6000)}"
            )
            time.sleep(0.1)
    finally:
        if gen.alive():
            gen.kill9()
        # This test's own processes, by pid (its generator's descendants and session): nothing else.
        for p in _alive(descendants + _in_session(gen.pid)):
            try:
                p.kill()
            except psutil.Error:
                pass
