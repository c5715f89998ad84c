"""Children that do not outlive the process that started them.

``python -m streamrl.child_guard PARENT_PID -- CMD ARGS...`` asks the kernel to send this process
SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), checks that the parent is still
``PARENT_PID`` (it may have died already), and then replaces itself with ``CMD`` (exec), which
keeps that request. The services stop on SIGTERM as they always do (drain, then exit), so a job
whose supervisor was killed (kill -9, a closed terminal) stops instead of training on as orphans.

`guarded` builds that command line. The request follows the thread that started the child: start
guarded children from a thread that lives as long as the job (the supervisor's main thread).
Elsewhere than Linux the command runs unguarded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def guarded(cmd: list[str]) -> list[str]:
    """``cmd``, started so that it gets SIGTERM when this process dies."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-m", "streamrl.child_guard", str(os.getpid()), "--", *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m streamrl.child_guard PARENT_PID -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"child_guard: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
        return 1
    if os.getppid() != parent:  # the parent died before the request was in place
        return 0
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
