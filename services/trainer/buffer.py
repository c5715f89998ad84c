"""Replay buffer: assembles trajectories into prompt groups and stages complete groups by the
training step they were issued for (their target step).

    trajectory --add--> PENDING group (k of G rows) --all G arrived--> STAGED[target]
    STAGED --sample(step)--> CONSUMED (ids go to the ledger)      STAGED --too old--> EVICTED

``sample(step)`` takes exactly ``n`` complete groups: those staged for ``step`` first, then late
groups staged for earlier steps that are still fresh enough, then (``allow_future``) groups staged
for later steps in ascending order. A group is usable at ``step`` when the oldest weight version
that generated any of its rows is >= ``step - max_age``; older groups are evicted and counted. It
never waits while ``n`` usable groups exist (the upstream stall), and it never hands out a
trajectory id twice (the consumed-id ledger rejects duplicates that a reclaimed task may produce).

Owned by the trainer runtime; the scheduler reads its per-target counts.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from shared.protocol import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt group: G rollouts of the same prompt, identified by an explicit group id."""

    group_id: str
    target_step: int
    group_size: int
    prompt_index: int
    rows: dict[int, Trajectory] = field(default_factory=dict)
    entry_ids: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.rows) == self.group_size

    @property
    def gen_version(self) -> int:
        """Oldest weight version that generated any token of the group (its staleness)."""
        return min(t.launch_version for t in self.rows.values())

    def ordered(self) -> list[Trajectory]:
        return [self.rows[i] for i in range(self.group_size)]


@dataclass
class SampleResult:
    groups: list[Group]
    evicted: list[Group]

    @property
    def targets(self) -> list[int]:
        return [g.target_step for g in self.groups]


class ReplayBuffer:
    def __init__(self, *, max_age: int, allow_future: bool = True) -> None:
        self.max_age = max_age
        self.allow_future = allow_future
        self._pending: dict[str, Group] = {}
        self._staged: dict[int, list[Group]] = defaultdict(list)
        self._consumed_ids: set[str] = set()
        self.evicted_total = 0
        self.duplicates_total = 0

    # ---- intake -------------------------------------------------------------------------------

    def add(self, traj: Trajectory, entry_id: str) -> Group | None | bool:
        """Stage one trajectory. Returns the group when this row completed it, None when the
        group is still incomplete, False when the row is a duplicate (already held or consumed);
        the caller acks duplicates at once."""
        if traj.task_id in self._consumed_ids:
            self.duplicates_total += 1
            return False
        group = self._pending.get(traj.group_id)
        if group is None:
            group = self._pending[traj.group_id] = Group(
                traj.group_id, traj.target_step, traj.group_size, traj.prompt_index
            )
        if traj.index_in_group in group.rows or traj.group_size != group.group_size:
            self.duplicates_total += 1
            log.warning("duplicate or inconsistent row %s of group %s ignored", traj.task_id, traj.group_id)
            return False
        group.rows[traj.index_in_group] = traj
        group.entry_ids.append(entry_id)
        if not group.complete:
            return None
        del self._pending[traj.group_id]
        self._staged[group.target_step].append(group)
        return group

    # ---- queries ------------------------------------------------------------------------------

    def usable_at(self, group: Group, step: int) -> bool:
        return group.gen_version >= step - self.max_age

    def count_usable(self, target: int) -> int:
        """Complete groups staged for ``target`` that will still be fresh enough at that step."""
        return sum(self.usable_at(g, target) for g in self._staged.get(target, ()))

    def pending_groups(self) -> int:
        return len(self._pending)

    def depth_by_target(self) -> dict[int, int]:
        return {t: len(gs) for t, gs in sorted(self._staged.items()) if gs}

    def num_staged(self) -> int:
        return sum(len(gs) for gs in self._staged.values())

    def consumed(self, task_id: str) -> bool:
        return task_id in self._consumed_ids

    # ---- consumption --------------------------------------------------------------------------

    def evict_stale(self, step: int) -> list[Group]:
        evicted: list[Group] = []
        for target in list(self._staged):
            keep = []
            for g in self._staged[target]:
                (keep if self.usable_at(g, step) else evicted).append(g)
            self._staged[target] = keep
            if not keep:
                del self._staged[target]
        if evicted:
            self.evicted_total += len(evicted)
            log.info("evicted %d stale groups at step %d (gen versions %s)", len(evicted), step,
                     sorted({g.gen_version for g in evicted}))
        return evicted

    def _candidates(self, step: int) -> list[Group]:
        """Usable groups in preference order: current target, late earlier targets, future ones."""
        current = list(self._staged.get(step, ()))
        late = [g for t in sorted(self._staged) if t < step for g in self._staged[t]]
        future = [g for t in sorted(self._staged) if t > step for g in self._staged[t]] if self.allow_future else []
        return [g for g in current + late + future if g.gen_version <= step]

    def ready(self, step: int, n: int) -> bool:
        return len(self._candidates(step)) >= n

    def sample(self, step: int, n: int) -> SampleResult:
        """Evict stale groups, then take exactly ``n`` usable groups (none if fewer exist)."""
        evicted = self.evict_stale(step)
        chosen = self._candidates(step)[:n]
        if len(chosen) < n:
            return SampleResult([], evicted)
        ids = {id(g) for g in chosen}
        for target in list(self._staged):
            self._staged[target] = [g for g in self._staged[target] if id(g) not in ids]
            if not self._staged[target]:
                del self._staged[target]
        for g in chosen:
            self._consumed_ids.update(t.task_id for t in g.rows.values())
        return SampleResult(chosen, evicted)

    # ---- checkpoint ---------------------------------------------------------------------------

    def consumed_ids(self) -> set[str]:
        return set(self._consumed_ids)

    def restore_consumed(self, ids: set[str]) -> None:
        self._consumed_ids |= ids
