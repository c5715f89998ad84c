"""Whether this run is CI's: tests of what needs root or an engine (docker compose, simulated
hosts, Slurm) skip on a developer's machine without it, and fail in CI (CI set, or
STREAMRL_REQUIRE_ENGINE=1 as .ci/run sets)."""

from __future__ import annotations

import os

REQUIRED = os.environ.get("CI", "") not in ("", "0", "false") or os.environ.get("STREAMRL_REQUIRE_ENGINE") == "1"
