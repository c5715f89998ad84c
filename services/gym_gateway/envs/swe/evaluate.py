"""The reward of a SWE rollout: the hidden tests, run in a fresh copy, reach the expected statuses.

    agent's workspace --build_reward_copy--> fresh snapshot + agent files - protected + hidden tests
        --runtime: instance.test_command (eval_timeout_s)--> pytest -rA log
        --parse "short test summary info"--> {test: status} --compare with instance.expected--> 0/1

Test ids are the pytest node ids (``tests/test_x.py::TestA::test_b[1]``) or, for R2E-Gym rows,
R2E's keys (the node id without its file, parts joined by '.': ``TestA.test_b[1]``). With
``match: exact`` (native and R2E-Gym rows) the reward is 1.0 iff the run's test set equals the
expected set and every status matches; with ``match: expected`` (SWE-bench rows) every expected
test must reach its status and other tests do not count. A run past its deadline gets 0. Called by
the SWE driver after the agent finishes, and by other drivers as ``swe.evaluate(instance, ws)``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from services.gym_gateway.envs.swe.copies import build_reward_copy
from services.gym_gateway.envs.swe.instance import STATUSES, Instance
from services.gym_gateway.envs.swe.runtime import Workspace

_SUMMARY = re.compile(r"^=+ short test summary info =+\s*$", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EVAL_OUTPUT_CHARS = 4_000_000  # the summary sits at the end of the log; keep it whole


@dataclass
class EvalResult:
    reward: float
    statuses: dict[str, str]  # what the run reported, keyed like instance.expected
    expected: dict[str, str]
    timed_out: bool = False
    exit_code: int | None = None
    log_tail: str = ""
    mismatched: list[str] = field(default_factory=list)  # expected tests whose status differs

    @property
    def metrics(self) -> dict[str, float]:
        expected = len(self.expected)
        return {
            "tests_expected": float(expected),
            "tests_matched": float(expected - len(self.mismatched)),
            "tests_passed": float(sum(s == "PASSED" for s in self.statuses.values())),
            "tests_reported": float(len(self.statuses)),
            "eval_timeout": float(self.timed_out),
        }


def parse_test_log(log: str, test_ids: str = "nodeid") -> dict[str, str]:
    """{test: status} from the last "short test summary info" section of a pytest ``-rA`` log.
    Lines read ``STATUS nodeid`` or ``STATUS nodeid - message``; SKIPPED lines name no test."""
    log = _ANSI.sub("", log)
    found = list(_SUMMARY.finditer(log))
    if not found:
        return {}
    out: dict[str, str] = {}
    for line in log[found[-1].end() :].splitlines():
        status, _, rest = line.strip().partition(" ")
        if status not in STATUSES or "::" not in rest:
            continue
        node = rest.split(" - ")[0].strip()
        out[_r2e_key(node) if test_ids == "r2e" else node] = status
    return out


def _r2e_key(node: str) -> str:
    return ".".join(node.split("::")[1:])


def compare(statuses: dict[str, str], expected: dict[str, str], match: str) -> list[str]:
    """Expected tests whose status differs; with ``exact``, tests the run reported beyond the
    expected set count as mismatches too."""
    wrong = [t for t, s in expected.items() if statuses.get(t) != s]
    if match == "exact":
        wrong += sorted(set(statuses) - set(expected))
    return wrong


async def evaluate(instance: Instance, ws: Workspace, *, timeout_s: float | None = None) -> EvalResult:
    """Run the hidden tests on the agent's final files (``ws.path``) in a fresh copy of the snapshot."""
    runtime = ws.runtime
    protected = list(runtime.cfg.protected_paths)
    async with runtime.scratch(instance) as (root, repo):
        await asyncio.to_thread(build_reward_copy, instance, ws.path, repo, protected)
        fresh = Workspace(runtime, instance, repo, runtime.workdir(repo), root / "home")
        res = await fresh.run(
            instance.test_command, timeout_s or runtime.cfg.eval_timeout_s, max_output_chars=_EVAL_OUTPUT_CHARS
        )
    statuses = {} if res.timed_out else parse_test_log(res.output, instance.test_ids)
    wrong = compare(statuses, instance.expected, instance.match)
    return EvalResult(
        reward=1.0 if statuses and not wrong else 0.0,
        statuses=statuses,
        expected=dict(instance.expected),
        timed_out=res.timed_out,
        exit_code=res.exit_code,
        log_tail=res.output[-4000:],
        mismatched=wrong,
    )
