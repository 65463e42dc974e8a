"""Scheduler test helpers (pure Python, no JAX): a fake model and request specs.

`token_at(request_id, position)` is the fake model: the token sampled at a position depends only
on (request, position), so a run with preemption, prefix hits or several steps a program must
produce the same tokens as one without (`reference_outputs` applies the stop rules by hand).
`random_specs` draws a mix of requests (shared prefixes, min_tokens, ignore_eos, stop ids, prompt
logprobs, priorities) for the randomized scheduler tests, and `drive` runs such a mix as the
engine core does (sync, or async: each update after the next schedule).
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable
from typing import Any

from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.sampling_params import SamplingParams

VOCAB = 40
EOS = 0
_arrival = itertools.count()


def token_at(request_id: str, position: int) -> int:
    return zlib.crc32(f"{request_id}/{position}".encode()) % VOCAB


def make_request(
    rid: str, prompt: list[int], eos: tuple[int, ...] = (EOS,), priority: int = 0, **sampling
) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(**sampling),
        eos_token_ids=eos,
        arrival_time=float(next(_arrival)),
        priority=priority,
    )


def reference_outputs(req: Request, max_model_len: int) -> list[int]:
    """What `req` must generate with the fake runner: the stop rules applied by hand."""
    sp, out = req.sampling, []
    while True:
        tok = token_at(req.request_id, req.num_prompt_tokens + len(out))
        out.append(tok)
        if len(out) >= sp.min_tokens and (
            tok in (sp.stop_token_ids or ()) or (not sp.ignore_eos and tok in req.eos_token_ids)
        ):
            return out
        if len(out) >= sp.max_tokens or req.num_prompt_tokens + len(out) >= max_model_len:
            return out


def random_specs(
    rng: random.Random, prefix: str, n: int, max_tokens: int
) -> list[tuple[str, list[int], tuple[int, ...], int, dict]]:
    """`n` random requests as (id, prompt, eos ids, priority, sampling fields)."""
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    specs = []
    for i in range(n):
        prompt = shared[: rng.randrange(13)] + [
            rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 14))
        ]
        limit = rng.randint(1, max_tokens)
        sampling = dict(
            max_tokens=limit,
            min_tokens=rng.randint(0, limit),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=rng.sample(range(VOCAB), 2) if rng.random() < 0.5 else None,
            prompt_logprobs=1 if rng.random() < 0.1 else None,
        )
        eos = tuple(rng.sample(range(VOCAB), 3))
        specs.append((f"{prefix}r{i}", prompt, eos, rng.randint(0, 1), sampling))
    return specs


def drive(
    sched: Scheduler,
    runner: Any,  # .execute(SchedulerOutput) -> RunnerOutput
    reqs: dict[str, Request],
    *,
    arrivals: Callable[[int], int],
    lookahead: bool,
    aborts: dict[str, int],
    stop_strings: dict[str, int] | None = None,
    check: Callable[[Scheduler], None] = lambda s: s.allocator.check_invariants(),
) -> dict[str, int]:
    """Adds `arrivals(step)` of `reqs` (in order) before each schedule, aborts / finishes by a
    stop string the requests named at their step, updates synchronously or (`lookahead`) after
    the next schedule, `check`s the scheduler after each step, until everything finished; every
    page is free at the end. Returns the counts of preemptions and multi-step steps."""
    pending = list(reqs.values())
    steps = preemptions = bursts = 0
    in_flight = None  # async scheduling: the step whose update waits for the next schedule
    while pending or sched.has_unfinished() or in_flight:
        for _ in range(arrivals(steps)):
            if pending:
                sched.add_request(pending.pop(0))
        out = sched.schedule()
        preemptions += len(out.preempted)
        bursts += out.num_steps > 1
        result = runner.execute(out)
        for rid, at in aborts.items():
            if at == steps:
                sched.abort(rid)
        if lookahead:
            if in_flight:
                sched.update(*in_flight)
            in_flight = (out, result) if out.scheduled else None
        else:
            sched.update(out, result)
        for rid, at in (stop_strings or {}).items():
            if at == steps:
                sched.finish(rid, "stop", "STOP")
        check(sched)
        steps += 1
        assert steps < 3000
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    sched.allocator.check_invariants()
    return {"preemptions": preemptions, "bursts": bursts}
