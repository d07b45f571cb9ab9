"""Isolation: which jobs to run, end or hold back after engine.step() raised. A state machine of
entry ids and token counts alone (no engine, no Redis); worker/quarantine.py carries out what it
decides.

After a failed step, the jobs that were in the engine are the suspects. They run again from
scratch, a group at a time, alone in the engine, and a group that fails is halved:

    {a b c d e f} fails -> {a b c} passes; {d e f} fails -> {d e} fails -> {d} passes;
    {e} fails alone: the culprit; {f} passes.

A suspect that fails alone is the culprit. k suspects take at most 2k - 1 group runs. It is the
engine, not a job, after more than MAX_STREAK failed steps with no successful step between
(bisection needs about log2(k) + 1).

A re-run of a job whose client already has tokens streams again only past them: its tokens are
the same when the job is greedy or seeded, so it is held back until it has produced as many
per sequence as the client has, then streams on from there. A re-run whose tokens may differ
(sampled without a seed) never streams again: its done event carries the whole output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

MAX_STREAK = 32  # failed steps in a row, none succeeding between, before the engine is blamed


@dataclass(frozen=True)
class Failure:
    """What a failed step means. broken: the engine cannot serve (no job is to blame);
    culprit: the one suspect that failed alone (to end with an error)."""

    broken: bool = False
    culprit: str | None = None


class Isolation:
    def __init__(self) -> None:
        self.groups: deque[list[str]] = deque()  # suspects waiting for their run, next first
        # A re-run held back: entry -> tokens per sequence index its client has (None: it
        # never streams again).
        self.behind: dict[str, dict[int, int] | None] = {}
        self.streak = 0  # failed steps in a row with no successful step between
        self._steps_at_failure = -1  # the engine's step count at the last failure

    @property
    def num_waiting(self) -> int:
        return sum(len(group) for group in self.groups)

    def failed(self, held: Collection[str], num_steps: int) -> Failure:
        """A step raised. `held`: the worker's jobs, oldest first (those not waiting in a group
        were in the engine: the suspects); `num_steps`: the engine's successful steps so far.
        The suspects' groups are decided here; the caller empties the engine."""
        self.streak = self.streak + 1 if num_steps == self._steps_at_failure else 1
        self._steps_at_failure = num_steps
        if self.streak > MAX_STREAK:
            return Failure(broken=True)
        waiting = {entry for group in self.groups for entry in group}
        suspects = [entry for entry in held if entry not in waiting]
        if len(suspects) == 1:
            self.behind.pop(suspects[0], None)
            return Failure(culprit=suspects[0])
        if suspects:
            half = (len(suspects) + 1) // 2
            self.groups.appendleft(suspects[half:])
            self.groups.appendleft(suspects[:half])
        return Failure()

    def next_group(self) -> list[str] | None:
        """The suspects to put into the emptied engine next (None: every suspect has run)."""
        return self.groups.popleft() if self.groups else None

    def rerun(self, entry: str, streamed: Mapping[int, int], same_tokens: bool) -> bool:
        """A suspect starts again from its first token. `streamed`: tokens per sequence index
        its client has ({}: none, or the job does not stream); `same_tokens`: whether the re-run
        produces the same tokens (greedy or seeded). True: it must not stream (yet)."""
        if entry not in self.behind and streamed:
            self.behind[entry] = dict(streamed) if same_tokens else None
        return entry in self.behind

    def caught_up(self, produced: Mapping[str, Mapping[int, int]]) -> list[str]:
        """After a step: the held-back re-runs that stream again from here. `produced`: tokens
        per sequence index of each held job's current run (a job missing from it has ended)."""
        resumed = []
        for entry, had in list(self.behind.items()):
            now = produced.get(entry)
            if now is None:
                del self.behind[entry]
            elif had is not None and all(now.get(i, 0) >= n for i, n in had.items()):
                del self.behind[entry]
                resumed.append(entry)
        return resumed

    def settle(self, held: Collection[str]) -> None:
        """The isolation is over: forget the re-runs that ended (nothing more to resume)."""
        self.behind = {entry: had for entry, had in self.behind.items() if entry in held}
