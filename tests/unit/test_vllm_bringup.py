"""An abandoned engine construction (`services.generator.vllm_bringup.EngineBuild`) stops the
processes it spawned, their descendants included, and only those: a child this process had before
it began (another engine's) is left alone; an engine it built after all is shut down. Plain
processes stand in for vLLM's engine core and its worker."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import psutil
import pytest

from services.generator.vllm_bringup import EngineBuild

pytestmark = pytest.mark.unit

# An "engine core": starts a "worker" of its own, then waits.
ENGINE_CORE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _until(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_closing_a_construction_stops_what_it_spawned_and_nothing_else():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another engine's
    build = EngineBuild()
    spawned: list[subprocess.Popen[bytes]] = []

    def construct() -> object:
        core = subprocess.Popen([sys.executable, "-c", ENGINE_CORE])
        spawned.append(core)
        while core.poll() is None:  # as vLLM's start-up watches its engine core
            time.sleep(0.02)
        raise RuntimeError("the engine core died during start-up")

    def thread() -> None:
        with contextlib.suppress(RuntimeError):
            build.run(construct)

    t = threading.Thread(target=thread)
    t.start()
    try:
        _until(lambda: bool(spawned) and bool(psutil.Process(spawned[0].pid).children()), "the engine core's worker")
        core = psutil.Process(spawned[0].pid)
        [worker] = core.children()
        build.close(wait_s=10.0)
        t.join(10)
        assert not t.is_alive()
        assert _gone(core) and _gone(worker)
        assert other.poll() is None  # not this construction's: left running
        assert not build.take_over()  # abandoned: nothing to hand over
    finally:
        for p in [other, *spawned]:
            p.kill()
            p.wait()


def test_an_engine_built_after_its_construction_was_abandoned_is_shut_down():
    build = EngineBuild()
    abandoned = threading.Event()

    class Engine:
        shut_down = False

        def shutdown(self) -> None:
            self.shut_down = True

    engine = Engine()

    def construct() -> Engine:
        abandoned.wait(10)
        return engine

    t = threading.Thread(target=build.run, args=(construct,))
    t.start()
    build.abandon()  # the coroutine awaiting it was cancelled
    abandoned.set()
    t.join(10)
    assert engine.shut_down
    assert not build.take_over()


def test_an_engine_taken_over_is_not_touched_by_a_later_close():
    build = EngineBuild()

    class Engine:
        shut_down = False

        def shutdown(self) -> None:
            self.shut_down = True

    engine = Engine()
    assert build.run(lambda: engine) is engine
    assert build.take_over()
    build.close(wait_s=1.0)
    assert not engine.shut_down
