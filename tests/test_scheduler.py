"""Scheduler policy driven by fabricated runner outputs (pure Python, no JAX).

The fake runner keeps a fake KV cache that stores token ids instead of K/V: every scheduled chunk
writes its tokens into its page table's slots and then checks that every position before the
chunk's end reads back the right token. That catches wrong page tables, pages shared when they
should not be, and prefix-cache hits on the wrong content. Sampled tokens depend only on
(request id, position), so a run with preemption must produce the same tokens as one without.
With async scheduling (the next step scheduled before this one's update) a chunk's last token
may be `PENDING_TOKEN`: the fake runner feeds it the token it sampled in the previous step, as
the real runner does on the device.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from scheduler_utils import EOS, drive, make_request, random_specs, reference_outputs, token_at

from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import PENDING_TOKEN, Request, RequestStatus
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.types import RunnerOutput, SchedulerOutput
from jaxinfer.sampling_params import SamplingParams


def make_scheduler(
    num_pages: int = 64,
    page_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    threshold: int | None = None,
) -> Scheduler:
    alloc = PageAllocator(num_pages, page_size, enable_prefix_caching=prefix_caching)
    return Scheduler(
        alloc,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
    )


class FakeRunner:
    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None):
        self.sched = sched
        self.ps = sched.allocator.page_size
        self.cache: list[list[int | None]] = [
            [None] * self.ps for _ in range(sched.allocator.num_pages)
        ]
        self.script = script or {}  # request id -> output tokens, instead of token_at
        self.last: dict[str, tuple[int, int]] = {}  # request id -> (position, token) sampled
        self.tables: dict[str, list[int]] = {}  # page tables rebuilt from the schedule's diffs

    def token(self, req: Request, pos: int) -> int:
        """The token at `pos`: known on the host, or sampled by the previous step."""
        if pos < req.num_known_tokens:
            return req.all_token_ids[pos]
        assert self.last.get(req.request_id, (None,))[0] == pos, "pending token never sampled"
        return self.last[req.request_id][1]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sched, ps = self.sched, self.ps
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert 0 < out.num_batched_tokens <= sched.max_num_batched_tokens or not out.scheduled
        assert len(out.scheduled) <= sched.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        kinds = [s.is_decode for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes must come before prefills"
        for rid in out.finished + out.preempted:
            self.tables.pop(rid, None)
        for s in out.scheduled:
            rid = s.request.request_id
            assert s.is_new == (rid not in self.tables), "a row joins exactly when it is new"
            self.tables[rid] = ([] if s.is_new else self.tables[rid]) + list(s.new_page_ids)
        for s in out.scheduled:
            req, end = s.request, s.start_pos + len(s.token_ids)
            known = req.all_token_ids[s.start_pos : end]
            assert s.token_ids[: len(known)] == known
            assert s.token_ids[len(known) :] == [PENDING_TOKEN] * (len(s.token_ids) - len(known))
            assert len(s.token_ids) - len(known) <= 1, "only a decode's token may be pending"
            if req.status is RequestStatus.RUNNING:  # (not aborted since it was scheduled)
                assert s.sample == (end == req.num_tokens - 1 and req.num_pending_tokens > 0)
            table = self.tables[req.request_id]
            assert table == list(s.page_table[: -(-end // ps)]), "diffs rebuild the page table"
            assert len(table) == -(-end // ps) and 0 not in table
            for pos in range(s.start_pos, end):
                self.cache[table[pos // ps]][pos % ps] = self.token(req, pos)
        sampled = {}
        for s in out.scheduled:
            req, end = s.request, s.start_pos + len(s.token_ids)
            table = self.tables[req.request_id]
            seen = [self.cache[table[p // ps]][p % ps] for p in range(end)]
            assert seen == [self.token(req, p) for p in range(end)], req.request_id
            if s.sample:
                rid = req.request_id
                if rid in self.script:
                    index = req.num_output_tokens + req.num_pending_tokens - 1
                    sampled[rid] = self.script[rid][index]
                else:
                    sampled[rid] = token_at(rid, end)
                self.last[rid] = (end, sampled[rid])  # the position the next step feeds it at
        return RunnerOutput(sampled_token_ids=sampled)


def check_pages(sched: Scheduler) -> None:
    alloc = sched.allocator
    alloc.check_invariants()
    refs = [0] * alloc.num_pages
    for r in sched._running:
        assert len(r.page_ids) * alloc.page_size >= r.num_computed_tokens
        for p in r.page_ids:
            refs[p] += 1
    assert refs == [alloc.refcount(p) for p in range(alloc.num_pages)]


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    updates = sched.update(out, runner.execute(out))
    check_pages(sched)
    return out, updates


def run_to_end(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 2000
) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, runner)[0])
        assert len(outs) < max_steps, "no progress"
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    return outs


def test_chunked_prefill_exact_slices_and_page_tables() -> None:
    sched = make_scheduler(page_size=4, max_num_batched_tokens=8)
    prompt = list(range(1, 22))  # 21 tokens
    req = make_request("a", prompt, eos=(), max_tokens=3)
    sched.add_request(req)
    runner = FakeRunner(sched)
    outs = run_to_end(sched, runner)
    got = [
        (s.start_pos, s.token_ids, len(s.new_page_ids), s.is_new, s.sample)
        for o in outs
        for s in o.scheduled
    ]
    out_ids = req.output_token_ids
    # Diffs: the first chunk brings the whole table, later ones only the pages they add.
    assert got == [
        (0, prompt[0:8], 2, True, False),
        (8, prompt[8:16], 2, False, False),
        (16, prompt[16:21], 2, False, True),
        (21, out_ids[0:1], 0, False, True),
        (22, out_ids[1:2], 0, False, True),
    ]
    tables = [list(s.page_table) for o in outs for s in o.scheduled]
    assert all(t == tables[0] for t in tables)  # one live list, never copied
    assert sum((list(s.new_page_ids) for o in outs for s in o.scheduled), []) == tables[0]
    assert req.finish_reason == "length" and req.status is RequestStatus.FINISHED_LENGTH
    assert outs[-1].finished == [] and sched.schedule().finished == ["a"]


def test_decodes_crossing_a_page_take_one_new_page_and_offer_the_full_one() -> None:
    """A decode whose token opens a page gets exactly that page as its diff (on the live table),
    and the page it filled enters the prefix cache; with no page free it preempts instead."""
    sched = make_scheduler(page_size=4, max_num_batched_tokens=8)
    req = make_request("a", [1, 2, 3], eos=(), max_tokens=7)
    sched.add_request(req)
    runner = FakeRunner(sched)
    outs = run_to_end(sched, runner)
    got = [(s.start_pos, len(s.new_page_ids)) for o in outs for s in o.scheduled]
    assert got == [(0, 1), (3, 0), (4, 1), (5, 0), (6, 0), (7, 0), (8, 1)]
    # both full pages (tokens 0-3 and 4-7) were offered: a new request with that prefix hits them
    twin = make_request("b", [1, 2, 3] + req.output_token_ids[:5] + [9], eos=(), max_tokens=1)
    assert len(sched.allocator.match_prefix(twin.all_token_ids, twin.page_hashes)) == 2

    sched = make_scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8)  # 3 usable pages
    a = make_request("a", [1, 2, 3, 4], eos=(), max_tokens=5)
    b = make_request("b", [5, 6, 7, 8], eos=(), max_tokens=5)
    for r in (a, b):
        sched.add_request(r)
    runner = FakeRunner(sched)
    outs = run_to_end(sched, runner)
    assert ["b"] in [o.preempted for o in outs], "the newest request gives its pages up"
    assert a.output_token_ids == reference_outputs(a, 256)
    assert b.output_token_ids == reference_outputs(b, 256)


def test_long_prefill_threshold_caps_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, threshold=5)
    sched.add_request(make_request("a", list(range(1, 13)), eos=(), max_tokens=2))
    outs = run_to_end(sched, FakeRunner(sched))
    assert [o.num_batched_tokens for o in outs] == [5, 5, 2, 1]


def test_decodes_come_before_prefills() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, threshold=4)
    long_req = make_request("long", list(range(1, 21)), eos=(), max_tokens=2)
    short_req = make_request("short", [1, 2], eos=(), max_tokens=4)
    sched.add_request(long_req)
    sched.add_request(short_req)
    runner = FakeRunner(sched)
    first, _ = step(sched, runner)
    assert [s.request.request_id for s in first.scheduled] == ["long", "short"]
    second, _ = step(sched, runner)
    assert [(s.request.request_id, s.is_decode) for s in second.scheduled] == [
        ("short", True),
        ("long", False),
    ]
    assert second.num_decodes == 1


def test_budgets_respected() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [1 + i] * 7, eos=(), max_tokens=5))
    outs = run_to_end(sched, FakeRunner(sched))
    assert max(len(o.scheduled) for o in outs) == 3
    assert max(o.num_batched_tokens for o in outs) == 10


def test_prefix_hit_skips_cached_tokens() -> None:
    sched = make_scheduler(page_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 11))  # 10 tokens: 2 full pages
    first = make_request("first", prompt, eos=(), max_tokens=1)
    sched.add_request(first)
    out, _ = step(sched, runner)
    assert out.num_batched_tokens == 10 and first.num_cached_tokens == 0
    # same prefix, different tail, both admitted together: they share the 2 cached pages
    a = make_request("a", prompt + [30, 31], eos=(), max_tokens=3)
    b = make_request("b", prompt, eos=(), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert [(s.start_pos, s.token_ids) for s in out.scheduled] == [
        (8, [9, 10, 30, 31]),
        (8, [9, 10]),
    ]
    assert out.num_batched_tokens == 6
    assert a.num_cached_tokens == b.num_cached_tokens == 8
    assert a.page_ids[:2] == b.page_ids[:2]
    assert all(sched.allocator.refcount(p) == 2 for p in a.page_ids[:2])
    run_to_end(sched, runner)
    # a prompt of exactly 2 full pages keeps its last page to compute
    c = make_request("c", prompt[:8], eos=(), max_tokens=1)
    sched.add_request(c)
    out, _ = step(sched, runner)
    assert (out.scheduled[0].start_pos, c.num_cached_tokens) == (4, 4)
    # prompt_logprobs needs every position: no prefix cache
    d = make_request("d", prompt, eos=(), max_tokens=1, prompt_logprobs=1)
    sched.add_request(d)
    out, _ = step(sched, runner)
    assert (out.scheduled[0].start_pos, d.num_cached_tokens, out.num_batched_tokens) == (0, 0, 10)


def test_preemption_recomputes_and_keeps_outputs() -> None:
    # 6 usable pages of 2 tokens; each request needs up to 5 pages: one must be preempted
    sched = make_scheduler(num_pages=7, page_size=2, prefix_caching=False)
    reqs = [make_request(rid, [3, 4, 5, 6], eos=(), max_tokens=6) for rid in ("old", "new")]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    outs = run_to_end(sched, runner)
    preempted = [(i, rid) for i, o in enumerate(outs) for rid in o.preempted]
    assert preempted and all(rid == "new" for _, rid in preempted)
    assert reqs[0].num_preemptions == 0 and reqs[1].num_preemptions == len(preempted)
    i, _ = preempted[0]
    resumed = next(s for o in outs[i + 1 :] for s in o.scheduled if s.request is reqs[1])
    assert resumed.start_pos == 0 and len(resumed.token_ids) > 4  # prompt + kept outputs
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r, sched.max_model_len)
        assert r.finish_reason == "length" and len(r.output_token_ids) == 6


def test_memory_pressure_preempts_the_lower_priority_request_first() -> None:
    # as above, but the older request has the lower priority (a larger value): it gives way
    sched = make_scheduler(num_pages=7, page_size=2, prefix_caching=False)
    low = make_request("low", [3, 4, 5, 6], eos=(), max_tokens=6, priority=5)
    high = make_request("high", [3, 4, 5, 6], eos=(), max_tokens=6, priority=-5)
    sched.add_request(low)
    sched.add_request(high)
    outs = run_to_end(sched, FakeRunner(sched))
    preempted = [rid for o in outs for rid in o.preempted]
    assert preempted and set(preempted) == {"low"}
    assert high.num_preemptions == 0 and len(high.output_token_ids) == 6


def test_request_that_is_newest_preempts_itself_and_stops_the_step() -> None:
    sched = make_scheduler(num_pages=4, page_size=2, max_num_batched_tokens=8)  # 3 usable pages
    a = make_request("a", [1, 2, 3], eos=(), max_tokens=2)
    b = make_request("b", [4, 5], eos=(), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    step(sched, runner)  # a: 3 tokens on 2 pages, b: 2 tokens on 1 page; none left
    out, _ = step(sched, runner)  # a's decode fits its pages, b's needs a new one
    assert out.preempted == ["b"] and [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_output_tokens == 1 and not b.page_ids
    run_to_end(sched, runner)
    assert a.output_token_ids == reference_outputs(a, sched.max_model_len)
    assert b.output_token_ids == reference_outputs(b, sched.max_model_len)


def test_stop_conditions() -> None:
    sched = make_scheduler(max_model_len=12)
    script = {
        "eos": [5, EOS, 7],
        "min_tokens": [EOS, 7, EOS, EOS],
        "ignore_eos": [EOS] * 4,
        "stop_id": [EOS, 9, 1],
        "other_eos": [6, 3],
        "model_len": [1] * 10,
    }
    reqs = {
        "eos": make_request("eos", [1], max_tokens=5),
        "min_tokens": make_request("min_tokens", [1], max_tokens=5, min_tokens=3),
        "ignore_eos": make_request("ignore_eos", [1], max_tokens=4, ignore_eos=True),
        "stop_id": make_request("stop_id", [1], max_tokens=5, ignore_eos=True, stop_token_ids=[9]),
        "other_eos": make_request("other_eos", [1], eos=(EOS, 3), max_tokens=5),
        "model_len": make_request("model_len", [1] * 6, max_tokens=6),
    }
    for r in reqs.values():
        sched.add_request(r)
    run_to_end(sched, FakeRunner(sched, script))
    got = {k: (r.output_token_ids, r.finish_reason, r.stop_reason) for k, r in reqs.items()}
    assert got == {
        "eos": ([5, EOS], "stop", None),
        "min_tokens": ([EOS, 7, EOS], "stop", None),
        "ignore_eos": ([EOS] * 4, "length", None),
        "stop_id": ([EOS, 9], "stop", 9),
        "other_eos": ([6, 3], "stop", None),
        "model_len": ([1] * 6, "length", None),
    }
    assert reqs["model_len"].num_tokens == sched.max_model_len


def test_bad_inputs() -> None:
    sched = make_scheduler(num_pages=5, page_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="'e'.*prompt_token_ids is empty"):
        sched.add_request(make_request("e", []))
    with pytest.raises(
        ValueError, match=r"'l'.*prompt length 15 \+ max_tokens 6 .* max_model_len 20"
    ):
        sched.add_request(make_request("l", [1] * 15, max_tokens=6))
    with pytest.raises(ValueError, match="'p'.*needs 5 KV-cache pages, the cache has 4"):
        sched.add_request(make_request("p", [1] * 15, max_tokens=5))
    with pytest.raises(ValueError, match="prompt_token_ids must be non-negative"):
        sched.add_request(make_request("n", [1, -2]))
    sched.add_request(make_request("d", [1]))
    with pytest.raises(ValueError, match="'d' is already scheduled"):
        sched.add_request(make_request("d", [1]))
    for field in (
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "long_prefill_token_threshold",
    ):
        kwargs = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1, field: 0}
        with pytest.raises(ValueError, match=field):
            Scheduler(PageAllocator(4, 4), **kwargs)
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("d", "done")


def test_abort_and_finish() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    run, wait = make_request("run", [1] * 9, eos=()), make_request("wait", [2] * 3, eos=())
    sched.add_request(run)
    sched.add_request(wait)
    out = sched.schedule()
    assert run.page_ids and sched.num_running == 1 and sched.num_waiting == 1
    assert sched.abort("wait") and not sched.abort("wait") and not sched.abort("nope")
    assert sched.abort("run")  # between schedule() and update(): pages freed at once
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert sched.update(out, runner.execute(out)) == []
    assert (run.status, run.finish_reason, run.page_ids) == (
        RequestStatus.FINISHED_ABORTED,
        "abort",
        [],
    )
    assert sched.schedule().finished == ["wait", "run"] and not sched.has_unfinished()
    s = make_request("s", [1, 2, 3], eos=(), max_tokens=10)
    sched.add_request(s)
    step(sched, runner)
    assert sched.finish("s", "stop", "</s>") and not sched.finish("s", "stop")
    assert (s.status, s.stop_reason, sched.get_request("s")) == (
        RequestStatus.FINISHED_STOPPED,
        "</s>",
        None,
    )
    check_pages(sched)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_priority_then_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for rid, prio in (("late-low", 1), ("a", 0), ("urgent", -1), ("b", 0)):
        sched.add_request(make_request(rid, [1, 2], eos=(), priority=prio, max_tokens=1))
    runner = FakeRunner(sched)
    order = [step(sched, runner)[0].scheduled[0].request.request_id for _ in range(4)]
    assert order == ["urgent", "a", "b", "late-low"]


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(6))
def test_random_mix_frees_everything_and_matches_unpreempted_outputs(
    seed: int, lookahead: bool
) -> None:
    rng = random.Random(seed)
    specs = random_specs(rng, f"s{seed}", 24, max_tokens=12)
    aborts = {rid: rng.randint(0, 30) for rid, *_ in rng.sample(specs, 4)}
    stop_strings = {rid: rng.randint(0, 30) for rid, *_ in rng.sample(specs, 3)}

    def run(num_pages: int, max_num_seqs: int, budget: int, threshold: int | None) -> dict:
        sched = make_scheduler(
            num_pages=num_pages,
            page_size=3,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=40,
            threshold=threshold,
        )
        reqs = {rid: make_request(rid, p, eos, prio, **sp) for rid, p, eos, prio, sp in specs}
        counts = drive(
            sched,
            FakeRunner(sched),
            reqs,
            arrivals=lambda _: rng.randint(0, 3),
            lookahead=lookahead,
            aborts=aborts,
            stop_strings=stop_strings,
            check=check_pages,
        )
        return {"reqs": reqs, **counts}

    roomy = run(num_pages=200, max_num_seqs=16, budget=64, threshold=None)
    tight = run(num_pages=16, max_num_seqs=6, budget=7, threshold=4)
    assert roomy["preemptions"] == 0 and tight["preemptions"] > 0
    for rid, r in roomy["reqs"].items():
        ref = reference_outputs(r, 40)
        for res in (roomy, tight):
            t = res["reqs"][rid]
            assert t.is_finished
            if t.finish_reason in ("abort",) or t.stop_reason == "STOP":
                assert t.output_token_ids == ref[: t.num_output_tokens]
            else:
                assert t.output_token_ids == ref, (rid, t.num_preemptions)


def _imports_no_jax(modules: str) -> None:
    code = f"import sys; import {modules}; assert 'jax' not in sys.modules, 'jax was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_host_modules_import_no_jax() -> None:
    _imports_no_jax(
        "jaxinfer.engine.types, jaxinfer.engine.output, jaxinfer.engine.scheduler, "
        "jaxinfer.engine.page_allocator, jaxinfer.engine.request"
    )


def test_front_end_imports_no_jax() -> None:
    """What a serving front-end process imports (the engine core's process loads JAX)."""
    _imports_no_jax(
        "jaxinfer.engine.core_client, jaxinfer.engine.core_loop, serving.launch, "
        "serving.protocol, serving.openai_protocol, serving.engine_loop, serving.http_server, "
        "serving.server, serving.frontend, serving.testing, jaxinfer.model_info"
    )


def test_known_tokens_read_prompt_and_outputs_in_place():
    """`Request.known_tokens` (what the prefix cache hashes a page at a time): the prompt then the
    known outputs, sliced like a list, pending tokens excluded, nothing concatenated."""
    req = Request("k", [1, 2, 3], SamplingParams())
    req.output_token_ids = [4, 5]
    req.num_pending_tokens = 1
    known = req.known_tokens
    assert len(known) == 5 and list(known) == req.all_token_ids == [1, 2, 3, 4, 5]
    assert [known[0:2], known[2:4], known[3:5], known[4:9], known[5:5]] == [
        [1, 2],
        [3, 4],
        [4, 5],
        [5],
        [],
    ]
    assert (known[0], known[3], known[-1]) == (1, 4, 5)
    with pytest.raises(IndexError):
        known[5]
    req.output_token_ids.append(6)  # a view: it follows the request
    assert len(known) == 6 and known[4:6] == [5, 6]


def test_wire_messages_round_trip_through_msgpack() -> None:
    """The typed messages between a front end and an engine-core process: what msgpack carries
    decodes into the same types and values (logprobs and the info's limits included)."""
    import msgpack

    from jaxinfer.engine import types
    from jaxinfer.engine.limits import EngineLimits

    def through(msg):
        wire = msgpack.unpackb(msgpack.packb(types.encode(msg)), strict_map_key=False)
        return types.decode_message(wire)

    lp = types.TokenLogprobs(5, -0.5, {5: -0.5, 7: -1.5})
    out = types.TokenOutput("a", [5], [lp], {1: lp}, True, "stop", 9, 3, 1, 0)
    stats = types.EngineStats(running=2, pages_used=4, step_s=0.01, lora=[2, "a,b", ""])
    got = through(types.StepResult(outputs=[out], lost=["b"], error="x", stats=stats))
    assert isinstance(got, types.StepResult) and got.stats == stats
    assert types.wire_outputs(got) == [out] and got.lost == ["b"] and got.error == "x"
    info = types.EngineInfo(
        types.EngineCapacity(10, 16, 160, 64),
        EngineLimits(100, 64, 16, 10),
        4,
        32,
        16,
        "float32",
        None,
        "auto",
        "reference",
        "xla",
        {"tensor": 2},
        "cpu x1 (cpu)",
        7,
    )
    assert through(types.Ready(info=info)) == types.Ready(info=info)
    req = types.CoreRequest("c", [1, 2], SamplingParams(max_tokens=3), (0,), 1)
    add = through(types.AddRequests(requests=[req]))
    assert [types.request_of(w) for w in add.requests] == [req]
    assert through(types.Finish(stops=[("c", "END")])).stops == [["c", "END"]]
    assert isinstance(through(types.Shutdown()), types.Shutdown)
    assert through(types.RemoveLoRA(lora_int_id=3)) == types.RemoveLoRA(lora_int_id=3)


def test_lora_info_names_running_and_waiting_adapters() -> None:
    """`lora_info` (vLLM's lora_requests_info labels): with one slot, the second adapter's request
    waits for it while a base-only request runs."""
    from jaxinfer.lora.request import LoRARequest
    from jaxinfer.lora.slots import LoRASlots

    sched = make_scheduler()
    assert sched.lora_info() is None
    sched = Scheduler(
        PageAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
        lora_slots=LoRASlots(1),
    )  # fmt: skip
    for rid, lora in [("a", LoRARequest("ada", 1)), ("b", LoRARequest("adb", 2)), ("c", None)]:
        req = make_request(rid, [1, 2, 3], max_tokens=4)
        req.lora_request = lora
        sched.add_request(req)
    sched.schedule()
    assert sched.lora_info() == [1, "ada", "adb"]


def test_unloaded_adapter_frees_its_slot_once_its_requests_end() -> None:
    """`remove_lora` (vLLM's, from `/v1/unload_lora_adapter`): with one slot, an unloaded adapter
    pinned by a running request keeps its slot until that request ends (another adapter's
    request waits meanwhile), then the slot is free, not kept as least recently used; an
    unpinned adapter's slot is free at once; the runner is told to drop each host copy."""
    from jaxinfer.lora.request import LoRARequest
    from jaxinfer.lora.slots import LoRASlots

    slots = LoRASlots(1)
    sched = Scheduler(
        PageAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
        lora_slots=slots,
    )  # fmt: skip
    ada, adb = LoRARequest("ada", 1), LoRARequest("adb", 2)
    for rid, lora in [("a", ada), ("b", adb)]:
        req = make_request(rid, [1, 2, 3], max_tokens=4)
        req.lora_request = lora
        sched.add_request(req)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"] and out.lora_loads == [(1, ada)]
    assert sched.remove_lora(1) is False and slots.loaded() == {1: 1}  # "a" still runs under it
    out = sched.schedule()
    assert out.lora_removes == [1] and "b" not in [s.request.request_id for s in out.scheduled]
    sched.abort("a")
    assert slots.loaded() == {} and slots.adapters[1] is None
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["b"] and out.lora_loads == [(1, adb)]
    sched.abort("b")  # adb now holds the slot, unpinned (least recently used)
    assert slots.loaded() == {2: 1}
    assert sched.remove_lora(2) is True and slots.loaded() == {} and slots.take_removes() == [2]
    assert slots.acquire(ada) == 1  # the slot is free for anyone


def test_images_stay_in_one_chunk_within_the_encoder_budget() -> None:
    """An image's tokens attend to each other: a chunk ends before an image that does not fit
    whole, `max_num_encoder_input_tokens` spreads a prompt's images over steps while a running
    decode keeps its token each step, and an image larger than a step is refused by name."""
    from jaxinfer.sampling_params import FieldError
    from jaxinfer.vision.inputs import ImageInput

    def image(offset: int, length: int = 4) -> ImageInput:
        return ImageInput(offset, length, f"h{offset}", b"", (1, 1))

    alloc = PageAllocator(64, 4)
    sched = Scheduler(
        alloc, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
        max_num_encoder_input_tokens=4,
    )  # fmt: skip
    runner = FakeRunner(sched)
    sched.add_request(make_request("text", [1, 2, 3], eos=(), max_tokens=8))
    step(sched, runner)
    req = make_request("img", list(range(1, 21)), eos=(), max_tokens=1)
    req.mm_inputs = (image(2), image(6), image(13))
    sched.add_request(req)
    chunks = []
    while req.status is not RequestStatus.FINISHED_LENGTH and len(chunks) < 20:
        out, _ = step(sched, runner)
        assert any(s.request.request_id == "text" for s in out.scheduled) or not any(
            r.request_id == "text" for r in sched.running
        )
        chunks += [
            (s.start_pos, s.start_pos + len(s.token_ids))
            for s in out.scheduled
            if s.request is req and s.start_pos < 20
        ]
    # 7 tokens fit the budget (the decode takes one): [0, 6) stops before image 6..9 (the
    # encoder budget went to image 2..5); then one image a step
    assert chunks == [(0, 6), (6, 13), (13, 20)], chunks
    for im in req.mm_inputs:
        assert any(a <= im.offset and im.offset + im.length <= b for a, b in chunks)
    big = make_request("big", list(range(1, 21)), eos=(), max_tokens=1)
    big.mm_inputs = (image(2), image(8, 5))
    with pytest.raises(FieldError, match="max_num_encoder_input_tokens=4") as e:
        sched.add_request(big)
    assert e.value.field == "multi_modal_data.image[1]"
