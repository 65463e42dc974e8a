"""Fault isolation for the engine-core loop: when a step raises, find the request(s) that made it
raise, fail only those, and keep serving the rest; failures it cannot pin on a request trip the
breaker instead of looping.

1. Recover: a step raises, naming the requests it held (`EngineCore.failed_request_ids`) and how
   far each was to compute (`failed_marks`). Whatever it left half-done (pages allocated,
   `num_computed_tokens` advanced, pending tokens, runner rows patched, a launch in flight),
   `EngineCore.recover` preempts every running request: each recomputes its prompt and outputs
   when it resumes, which is always correct (greedy and seeded outputs come out the same).
2. Re-validate: each suspect is checked again (`EngineCore.check`); one that fails a check is
   failed at once, with that check's reason.
3. Bisect: the other suspects form a group known to fail. While isolating, the core steps
   synchronously (a step that returns has run) and admits only the requests cleared so far plus
   the group under probe (`EngineCore.restrict`; everyone else waits, new arrivals included).
   A known-failing group of several is split: its first half is probed, the second half waits as
   a group not known to fail. A probe steps until each member has computed past the point where
   it failed (its mark: it is cleared, or it finished) or a step fails:
   - the members of the group under probe that the failed step held become a known-failing
     group (the rest of the group waits, not known to fail); if the failed step held only one
     of them, that one is the culprit: it is failed with the step's error, everyone else goes on;
   - if the failed step held none of them, the cleared requests it held become suspects again.
   Every failure recovers again (1). The probes end when no group is left: the filter is lifted
   and async scheduling resumes.
4. Breaker: a failure is unexplained when it names no request, when an isolation convicts no
   one (the step fails only with the others: nothing to pin it on), when no step succeeds during
   an isolation (nothing shows the engine still works: every request failing alone, or a lone
   request failing on an otherwise idle engine), or when an isolation outruns its probe budget.
   `max_strikes` unexplained failures with no successful ordinary step between them break the
   core (`broken` says why); the loop then reports `Broken` and stops.

NOTE: imports no JAX (the front end imports `core_loop`, which imports this).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore

logger = logging.getLogger(__name__)

# Loop iterations a probe may go without computing anything before the isolation gives up.
MAX_IDLE_PROBE_STEPS = 200


@dataclasses.dataclass
class _Group:
    ids: list[str]
    failing: bool  # a step failed holding (among the cleared) exactly these


class FaultIsolator:
    """Isolates the requests that make engine steps raise (see the module docstring).

    The loop calls `failed(error)` when `core.step()` raised and `succeeded(busy)` when it
    returned (`busy`: it computed something); `failed` returns the requests to fail, as
    (child request ids, message) pairs. `broken` is set once the breaker trips.
    """

    def __init__(self, core: EngineCore, max_strikes: int) -> None:
        self.core, self.max_strikes = core, max_strikes
        self.strikes = 0
        self.broken: str | None = None
        self.isolating = False
        self._groups: list[_Group] = []  # a stack: the last one is probed next
        self._probe: list[str] = []  # the group under probe
        self._cleared: set[str] = set()
        self._marks: dict[str, int] = {}
        self._convicted = self._probes = self._budget = self._idle = 0
        self._worked = False  # some step succeeded during this isolation

    def failed(self, error: str) -> list[tuple[list[str], str]]:
        core = self.core
        lost = list(core.failed_request_ids)
        if not self.isolating:
            self._marks = {}
        for rid, mark in core.failed_marks.items():
            self._marks[rid] = max(self._marks.get(rid, 0), mark)
        core.recover()
        if not lost:
            self._strike(f"a step failed holding no request: {error}")
            return []
        fail: list[tuple[list[str], str]] = []
        for rid in lost:
            why = core.check(rid)
            if why is not None:
                fail.append(([rid], f"engine step failed: the request no longer passes: {why}"))
        invalid = {ids[0] for ids, _ in fail}
        lost = [rid for rid in lost if rid not in invalid]
        if not self.isolating:
            self.isolating, self._worked, self._cleared = True, False, set()
            self._groups, self._probe, self._probes = [], [], 0
            self._convicted, self._budget = len(fail), 8 + 4 * len(lost)
            logger.warning(
                "engine step failed holding %d request(s) (%s); isolating the cause: %s",
                len(lost) + len(fail),
                ", ".join(lost + sorted(invalid)),
                error,
            )
            if lost:
                self._groups.append(_Group(lost, True))
        else:
            self._convicted += len(fail)
            probe = [rid for rid in self._probe if rid not in invalid]
            held = [rid for rid in lost if rid in probe]
            rest = [rid for rid in probe if rid not in held and rid not in self._cleared]
            if rest:  # NOTE: pushed first: the failing group below is probed before it
                self._groups.append(_Group(rest, False))
            if len(held) == 1:
                self._convicted += 1
                logger.error("request %s makes the engine step raise: failing it", held[0])
                fail.append(
                    (held, f"engine step failed: the request makes the step raise: {error}")
                )
            elif held:
                self._groups.append(_Group(held, True))
            else:  # requests cleared before failed past their marks: suspects again
                self._cleared.difference_update(lost)
                self._groups.append(_Group(lost, True))
            self._probe = []
        self._next()
        return fail

    def succeeded(self, busy: bool) -> None:
        if not self.isolating:
            if busy:
                self.strikes = 0
            return
        self._worked = self._worked or busy
        core, left = self.core, []
        for rid in self._probe:
            done = core.progress(rid)
            if done is not None and done < self._marks.get(rid, 0):
                left.append(rid)
            elif done is not None:
                self._cleared.add(rid)
        self._idle = 0 if busy else self._idle + 1
        if left and self._idle > MAX_IDLE_PROBE_STEPS:
            self._end(f"the probe of {left} made no progress in {self._idle} steps")
            return
        self._probe = left
        self._next()

    def _next(self) -> None:
        """Starts probing the next group (or ends the isolation when none is left)."""
        while not self._probe:
            if not self._groups:
                self._end()
                return
            group = self._groups.pop()
            ids = [rid for rid in group.ids if self.core.progress(rid) is not None]
            if group.failing and len(ids) > 1:
                half = (len(ids) + 1) // 2
                self._groups.append(_Group(ids[half:], False))
                ids = ids[:half]
            self._probe = ids
            self._probes += bool(ids)
            if self._probes > self._budget:
                self._end(f"no culprit within {self._budget} probes")
                return
        self._idle = 0
        self.core.restrict(self._cleared | set(self._probe))

    def _end(self, trouble: str | None = None) -> None:
        self.isolating, self._groups, self._probe = False, [], []
        self.core.restrict(None)
        if trouble is None and not self._convicted:
            trouble = "no request makes the step fail without the others"
        elif trouble is None and not self._worked:
            trouble = "no step succeeded while isolating"
        if trouble is None:
            logger.warning("fault isolated: %d request(s) failed, the rest go on", self._convicted)
        else:
            self._strike(trouble)

    def _strike(self, why: str) -> None:
        self.strikes += 1
        logger.error(
            "unexplained engine step failure (%d of %d before the engine is declared broken): %s",
            self.strikes,
            self.max_strikes,
            why,
        )
        if self.strikes >= self.max_strikes:
            self.broken = f"{self.strikes} unexplained engine step failures in a row; last: {why}"
