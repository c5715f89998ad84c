"""vLLM's engine construction, run in a worker thread, and what an abandoned one leaves behind.

`services.generator.vllm_engine` builds ``AsyncLLM`` in a thread (tens of seconds of model load
while the event loop answers /health). A thread cannot be cancelled: when the generator is stopped
during bring-up, the task awaiting the construction is cancelled but the thread goes on, and
spawns vLLM's engine core (``VLLM::EngineCore``) and its workers while the generator shuts down
and exits (uvicorn re-raises SIGTERM once the lifespan closed, killing the process with the
thread in it), leaving them running with nobody to stop them.

`EngineBuild` runs one construction and can abandon it: the awaiting coroutine was cancelled, or
the engine is closed while it is still building. Then the processes *this construction* spawned
are stopped (SIGTERM, then SIGKILL after `STOP_GRACE_S`): the generator process's children that
were not there when the construction began (and created after it began), and their descendants;
and an engine built after all is shut down (``llm.shutdown()``). It never touches a child that
existed before: a process may hold several engines (the engine contract tests run vLLM engines
in-process), and stopping every child of the process stopped the others'. Multiprocessing's own
helpers (the resource tracker, the fork server), which the process shares and which end when it
ends, are left alone too.

Residual race: a child spawned by *another* construction in the same process while this one was
building cannot be told apart from this one's (vLLM names its engine cores alike and nothing
outside vLLM's objects records which construction started which), so abandoning one of two
overlapping constructions stops both's processes. The generator builds one engine; tests build
them one after the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # from SIGTERM to SIGKILL for a process an abandoned construction spawned
CLOSE_WAIT_S = 15.0  # how long closing waits for the construction thread to end
_POLL_S = 0.1
# psutil's creation times are derived from the boot time, which /proc gives in whole seconds.
_CLOCK_SLACK_S = 1.0


class EngineBuild:
    """One engine construction in a worker thread (`run`), that can be abandoned (`abandon`,
    `close`). Created on the event loop just before the thread starts."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._began_at = time.time()
        self._before = {_key(p) for p in self._me.children()}
        self._lock = threading.Lock()
        self._abandoned = False
        self._finished = threading.Event()
        self._built: Any = None  # an engine built but not handed over (the awaiting coroutine went)

    def run(self, build: Callable[[], Any]) -> Any:
        """In the worker thread: ``build()``; once it ended, if abandoned meanwhile, shut down what
        it built and stop the processes it spawned."""
        built = None
        try:
            built = build()
            return built
        finally:
            with self._lock:
                self._built = built
                abandoned = self._abandoned
            try:
                if abandoned:
                    log.warning(
                        "the abandoned vLLM engine construction ended (%s): stopping what it left",
                        "built" if built is not None else "failed",
                    )
                    self.clean_up()
            finally:
                self._finished.set()

    def take_over(self) -> bool:
        """The awaiting coroutine takes the engine, unless the construction was abandoned (closed
        meanwhile: it is shut down here then). True when the engine is the caller's from now on."""
        with self._lock:
            if self._abandoned:
                return False
            self._built = None
            return True

    def abandon(self) -> None:
        """Nobody takes the engine any more (the awaiting coroutine was cancelled): the thread
        cleans up when it ends; `close` does too."""
        with self._lock:
            self._abandoned = True

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Blocking: abandon the construction, stop what it spawned so far (the construction then
        fails fast: vLLM's start-up watches its engine core), stop again whatever it spawns while
        its thread runs, at most ``wait_s``, then clean up what is left."""
        self.abandon()
        deadline = time.monotonic() + wait_s
        while not self._finished.is_set() and time.monotonic() < deadline:
            self.stop_spawned()
            self._finished.wait(_POLL_S)
        if not self._finished.is_set():
            log.warning("the vLLM engine construction still runs %.0fs after it was abandoned", wait_s)
        self.clean_up()

    def clean_up(self) -> None:
        """Shut down an engine built and not handed over, then stop the processes this
        construction spawned. Idempotent; safe from the thread and from `close` at once."""
        with self._lock:
            llm, self._built = self._built, None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:
                log.exception("shutting down the abandoned vLLM engine failed")
        self.stop_spawned()

    def spawned(self) -> list[psutil.Process]:
        """The children of this process this construction spawned (their descendants are its
        too): those that were not there when it began and were created after it began
        (multiprocessing's shared helpers excepted)."""
        shared = _multiprocessing_helpers()
        found: list[psutil.Process] = []
        for child in self._me.children():
            try:
                if _key(child) in self._before or child.pid in shared:
                    continue
                if child.create_time() < self._began_at - _CLOCK_SLACK_S:
                    continue
                found.append(child)
            except psutil.Error:  # gone meanwhile
                continue
        return found

    def stop_spawned(self) -> None:
        """Stop what `spawned` finds and their descendants: SIGTERM, then SIGKILL to what is
        still running `STOP_GRACE_S` later. A process is frozen (SIGSTOP) before its children
        are listed, so none spawns another behind the listing, and its children are listed
        again until it ended (an engine core goes on booting, and starting workers, a while
        after its SIGTERM): a worker orphaned as it starts would outlive it by seconds.
        Children are not waited for with ``waitpid`` (psutil's ``wait`` would reap them, under
        the feet of multiprocessing, which reaps its own): a zombie counts as stopped."""
        procs = _freeze(self.spawned())
        if not procs:
            return
        log.warning(
            "stopping %d process(es) the abandoned vLLM engine construction spawned: %s",
            len(procs),
            ", ".join(str(p.pid) for p in procs),
        )
        _terminate(procs)
        deadline = time.monotonic() + STOP_GRACE_S
        while (left := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
            known = {p.pid for p in procs}
            new = _freeze([c for p in left for c in _children(p) if c.pid not in known])
            if new:
                log.warning("stopping what they spawned since: %s", ", ".join(str(p.pid) for p in new))
                _terminate(new)
                procs += new
            time.sleep(_POLL_S)
        for p in _freeze(left):  # frozen again, with what they spawned last: none is orphaned
            _send(p, "kill")


def _freeze(roots: list[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and all their descendants, each stopped (SIGSTOP) before its children are listed."""
    frozen: dict[int, psutil.Process] = {}
    todo = list(roots)
    while todo:
        p = todo.pop()
        if p.pid in frozen or not _running(p):
            continue
        _send(p, "suspend")
        frozen[p.pid] = p
        todo += _children(p)
    return list(frozen.values())


def _terminate(procs: list[psutil.Process]) -> None:
    """SIGTERM to frozen processes, then SIGCONT: each handles its SIGTERM as it wakes."""
    for p in procs:
        _send(p, "terminate")
    for p in procs:
        _send(p, "resume")


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return list(p.children())
    except psutil.Error:  # gone meanwhile
        return []


def _key(p: psutil.Process) -> tuple[int, float]:
    """A process's identity: its pid and creation time (a pid can be reused)."""
    try:
        return p.pid, p.create_time()
    except psutil.Error:
        return p.pid, 0.0


def _running(p: psutil.Process) -> bool:
    try:
        # is_running also checks the creation time: a reused pid is not this process.
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _send(p: psutil.Process, how: str) -> None:
    try:
        getattr(p, how)()  # psutil checks the pid was not reused before it signals
    except psutil.Error:
        pass


def _multiprocessing_helpers() -> set[int]:
    """The pids of multiprocessing's resource tracker and fork server, if this process started
    them: shared by everything in the process (stopping the tracker would unlink shared memory
    still in use), and they exit by themselves once this process is gone."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None),
        getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
    }
    return {pid for pid in pids if isinstance(pid, int)}
