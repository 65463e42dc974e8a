"""Multi-step scheduling (`num_scheduler_steps`): config checks, scheduler rules, exactness.

1. Config: a bad `num_scheduler_steps` is named; it does not combine with speculative decoding
   or a data / pipeline mesh axis (refused by name).
2. Scheduler (no JAX), driven by a fake runner whose "model" is a hash of (request, position) and
   whose fake KV cache stores token ids: a multi-step step gives each decode pages for all its
   tokens and that many pending ones, and its ids are applied under the stop rules (a stop in the
   middle drops the rest and frees the pages); steps stay plain while a request waits, has a
   token mask or the free pages cannot hold the burst; a random mix of requests (prefix hits,
   preemption, aborts, stop ids, sync and async scheduling) produces the tokens a plain run
   does, every position reads back its token, every page is free at the end.
3. Engine on the tiny Llama: greedy, seeded sampling (n = 2 too), penalties, min_tokens, stop
   ids and stop strings give the same tokens and texts with and without multi-step programs,
   async and sync, and logprobs the same values for every token; a request with a token mask
   takes plain steps beside them; preemption and prefix hits leave every page free; a
   `tensor=8` mesh decodes the single device's tokens.
"""

from __future__ import annotations

import random

import pytest
from engine_utils import counting_steps
from scheduler_utils import drive, make_request, random_specs, reference_outputs, token_at

from jaxinfer.config import EngineConfig
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import PENDING_TOKEN, Request, RequestStatus
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.types import RunnerOutput, SchedulerOutput
from jaxinfer.sampling_params import SamplingParams


def make_scheduler(steps: int, num_pages: int = 64, **kw) -> Scheduler:
    page_size = kw.pop("page_size", 4)
    alloc = PageAllocator(num_pages, page_size, enable_prefix_caching=kw.pop("caching", True))
    options = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=40)
    return Scheduler(alloc, num_scheduler_steps=steps, **{**options, **kw})


class FakeRunner:
    """Plain and multi-step steps over a fake KV cache of token ids (module docstring, 2)."""

    def __init__(self, sched: Scheduler):
        self.ps = sched.allocator.page_size
        self.cache = [[None] * self.ps for _ in range(sched.allocator.num_pages)]
        self.tables: dict[str, list[int]] = {}
        self.sampled: dict[str, dict[int, int]] = {}  # request id -> position -> sampled id

    def token(self, req: Request, pos: int) -> int:
        tok = self.sampled.get(req.request_id, {}).get(pos)
        if pos < req.num_known_tokens:
            known = req.all_token_ids[pos]
            assert tok is None or tok == known or pos < req.num_prompt_tokens
            return known
        assert tok is not None, f"{req.request_id}: position {pos} was never sampled"
        return tok

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        steps, ps = out.num_steps, self.ps
        for rid in out.finished + out.preempted:
            self.tables.pop(rid, None)
        for s in out.scheduled:
            rid = s.request.request_id
            self.tables[rid] = ([] if s.is_new else self.tables[rid]) + list(s.new_page_ids)
        sampled, step_ids = {}, {}
        for s in out.scheduled:
            req, rid, n = s.request, s.request.request_id, len(s.token_ids)
            if steps > 1:
                assert s.sample and n == 1 and s.is_decode, "multi-step steps hold decodes only"
            known = req.all_token_ids[s.start_pos : s.start_pos + n]
            assert s.token_ids[: len(known)] == known
            assert all(t == PENDING_TOKEN for t in s.token_ids[len(known) :])
            first = s.start_pos + n  # the position the first sampled id takes
            ids = [token_at(rid, first + j) for j in range(steps)] if s.sample else []
            end = first + len(ids) - 1 if ids else first  # positions this step writes
            table = self.tables[rid]
            assert len(table) >= -(-end // ps) and 0 not in table, "pages for every step"
            assert table[: -(-end // ps)] == list(s.page_table[: -(-end // ps)])
            for pos in range(s.start_pos, first):
                self.cache[table[pos // ps]][pos % ps] = self.token(req, pos)
            for j, tok in enumerate(ids):
                self.sampled.setdefault(rid, {})[first + j] = tok
                if first + j < end:
                    self.cache[table[(first + j) // ps]][(first + j) % ps] = tok
            seen = [self.cache[table[p // ps]][p % ps] for p in range(end)]
            assert seen == [self.token(req, p) for p in range(end)], rid
            if ids:
                sampled[rid] = ids[-1]
                if steps > 1:
                    step_ids[rid] = ids
        return RunnerOutput(sampled_token_ids=sampled, step_token_ids=step_ids)


# ---- 1. config ----


def test_bad_num_scheduler_steps_is_named():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps.*speculative"):
        EngineConfig(
            num_scheduler_steps=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_scheduler(0)
    with pytest.raises(ValueError, match="num_scheduler_steps=2 does not combine"):
        make_scheduler(2, num_speculative_tokens=2, spec_max_requests=4)


# ---- 2. scheduler ----


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    return out, sched.update(out, runner.execute(out))


def test_a_burst_holds_pages_and_pending_tokens_for_every_step():
    sched = make_scheduler(4, page_size=4, max_model_len=64)
    req = make_request("a", [5, 6, 7], eos=(), max_tokens=10)
    sched.add_request(req)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # the prompt's chunk: a plain step
    assert out.num_steps == 1 and req.num_output_tokens == 1
    out = sched.schedule()
    assert out.num_steps == 4 and len(out.scheduled) == 1
    s = out.scheduled[0]
    assert (s.start_pos, s.token_ids) == (3, [req.output_token_ids[0]])
    # positions 3..6 are written: pages for 7 tokens; 4 ids pending; computed up to 7
    assert len(req.page_ids) == 2 and req.num_pending_tokens == 4 and req.num_computed_tokens == 7
    updates = sched.update(out, runner.execute(out))
    assert [u.new_token_ids for u in updates] == [req.output_token_ids[1:5]]
    assert req.num_pending_tokens == 0 and req.num_output_tokens == 5
    # 5 more allowed: another 4, then one plain step, which finishes it by length
    assert [step(sched, runner)[0].num_steps for _ in range(2)] == [4, 1]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 10
    assert req.output_token_ids == reference_outputs(req, 64)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_a_stop_inside_a_burst_drops_the_rest_and_frees_the_pages():
    rid, prompt = "b", [1, 2, 3, 4]
    # a stop id that the fake model samples as the 3rd output
    stop = token_at(rid, len(prompt) + 2)
    sched = make_scheduler(8, page_size=4, max_model_len=64)
    req = make_request(rid, prompt, eos=(), max_tokens=30, stop_token_ids=[stop])
    sched.add_request(req)
    runner = FakeRunner(sched)
    step(sched, runner)
    out, updates = step(sched, runner)
    assert out.num_steps == 8
    assert req.output_token_ids == reference_outputs(req, 64) and req.output_token_ids[-1] == stop
    assert updates[0].finished and req.stop_reason == stop
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_steps_stay_plain_while_a_request_waits_has_a_token_mask_or_pages_run_out():
    sched = make_scheduler(4, max_num_seqs=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("x", [1, 2], eos=(), max_tokens=12))
    sched.add_request(make_request("y", [3], eos=(), max_tokens=12))  # waits: one seat
    step(sched, runner)
    assert step(sched, runner)[0].num_steps == 1  # y is waiting
    sched.abort("y")
    assert step(sched, runner)[0].num_steps == 4

    sched = make_scheduler(4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("x", [1, 2], eos=(), max_tokens=12))
    sched.add_request(make_request("m", [3], eos=(), max_tokens=12, allowed_token_ids=[5, 6]))
    sched.add_request(make_request("l", [4], eos=(), max_tokens=12, logprobs=1))
    step(sched, runner)
    assert step(sched, runner)[0].num_steps == 1  # m's mask advances per token on the host
    sched.abort("m")
    assert step(sched, runner)[0].num_steps == 4  # logprobs come for every step

    # 5 usable pages of 4 tokens: two prompts of 5 hold 2 each; a burst of 7 needs a third
    # page for each, one is free
    sched = make_scheduler(8, num_pages=6, page_size=4)
    runner = FakeRunner(sched)
    for rid, first in (("p", 1), ("q", 6)):
        sched.add_request(make_request(rid, list(range(first, first + 5)), eos=(), max_tokens=8))
    step(sched, runner)
    assert sched.allocator.num_free_pages == 1
    assert step(sched, runner)[0].num_steps == 1


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_random_mix_matches_plain_outputs(seed: int, lookahead: bool) -> None:
    rng = random.Random(seed)
    specs = random_specs(rng, f"s{seed}", 16, max_tokens=20)
    aborts = {rid: rng.randint(0, 30) for rid, *_ in rng.sample(specs, 3)}

    def run(steps: int, num_pages: int, max_num_seqs: int, budget: int) -> dict:
        sched = make_scheduler(
            steps, num_pages=num_pages, page_size=3, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
        )  # fmt: skip
        reqs = {rid: make_request(rid, p, eos, prio, **sp) for rid, p, eos, prio, sp in specs}
        counts = drive(
            sched,
            FakeRunner(sched),
            reqs,
            arrivals=lambda n: rng.randint(0, 2) if n % 7 else 0,  # idle spells let bursts run
            lookahead=lookahead,
            aborts=aborts,
        )
        return {"reqs": reqs, **counts}

    plain = run(1, num_pages=200, max_num_seqs=16, budget=64)
    roomy = run(4, num_pages=200, max_num_seqs=16, budget=64)
    tight = run(5, num_pages=14, max_num_seqs=4, budget=8)
    assert plain["bursts"] == 0 and roomy["bursts"] > 0 and tight["bursts"] > 0
    assert tight["preemptions"] > 0
    for rid, r in plain["reqs"].items():
        ref = reference_outputs(r, 40)
        for res in (plain, roomy, tight):
            t = res["reqs"][rid]
            assert t.is_finished
            if t.finish_reason == "abort":
                assert t.output_token_ids == ref[: t.num_output_tokens]
            else:
                assert t.output_token_ids == ref, (rid, t.num_preemptions)


# ---- 3. engine on the tiny Llama ----
# NOTE: two token buckets, as tests/test_spec_decode.py: a decode step of up to 4 tokens, a
# prefill chunk or more; engines with the same options share their compiled programs.
BUCKETS = (4, 16)


@pytest.fixture(scope="module")
def tiny():
    from engine_utils import load_vocab, tiny_model

    return tiny_model(load_vocab())


@pytest.fixture(scope="module")
def plain(tiny):
    from engine_utils import make_engine

    return make_engine(tiny, token_buckets=BUCKETS)


@pytest.fixture(scope="module", params=["async", "sync"])
def multi(tiny, request):
    from engine_utils import make_engine

    return make_engine(
        tiny,
        token_buckets=BUCKETS,
        num_scheduler_steps=4,
        async_scheduling=request.param == "async",
    )


def test_engine_tokens_and_texts_equal_plain_steps(tiny, plain, multi):
    from engine_utils import assert_pages_free, random_prompt, run

    rng = __import__("numpy").random.default_rng(3)
    vocab = tiny.cfg.vocab_size
    prompts = [random_prompt(rng, n, vocab) for n in (5, 9, 3, 6)]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=19),
        SamplingParams(temperature=0.8, seed=11, max_tokens=14, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=11, min_tokens=6),
        SamplingParams(temperature=0.9, seed=8, max_tokens=10, n=2, frequency_penalty=0.5),
    ]
    reqs = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    ref = run(plain, reqs)
    text = ref["r0"][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stops = [
        ("s0", prompts[0], SamplingParams(temperature=0.0, max_tokens=19, stop=[stop])),
        (
            "s1",
            prompts[0],
            SamplingParams(
                temperature=0.0, max_tokens=19, stop_token_ids=[ref["r0"][0].token_ids[6]]
            ),
        ),
    ]
    ref.update(run(plain, stops))
    with counting_steps(multi) as seen:
        got = run(multi, reqs)
        got.update(run(multi, stops))
    assert max(seen) == 4, seen
    for rid in ref:
        for a, b in zip(got[rid], ref[rid], strict=True):  # n = 2: both samples
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.usage == b.usage, rid
    assert ref["s0"][0].finish_reason == ref["s1"][0].finish_reason == "stop"
    assert_pages_free(multi)


def test_engine_logprobs_of_every_step_and_masked_requests_on_plain_steps(tiny, plain, multi):
    from engine_utils import assert_pages_free, assert_same_greedy, random_prompt, run

    rng = __import__("numpy").random.default_rng(4)
    prompts = [random_prompt(rng, 6, tiny.cfg.vocab_size) for _ in range(3)]
    reqs = [
        ("lp", prompts[0], SamplingParams(temperature=0.0, max_tokens=13, logprobs=3)),
        ("lp2", prompts[1], SamplingParams(temperature=0.9, seed=2, max_tokens=9, logprobs=1)),
    ]
    ref = run(plain, reqs)
    with counting_steps(multi) as seen:
        got = run(multi, reqs)
    assert 4 in seen, seen
    assert_same_greedy(got, ref, ["lp", "lp2"])
    for rid in ("lp", "lp2"):
        a, b = got[rid][0].logprobs, ref[rid][0].logprobs
        assert len(a) == len(got[rid][0].token_ids)
        assert [set(x.top) for x in a] == [set(x.top) for x in b], rid
    allowed = sorted(set(ref["lp"][0].token_ids))  # a mask the greedy tokens pass
    masked = [
        ("m", prompts[2], SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=allowed)),
        ("free", prompts[0], SamplingParams(temperature=0.0, max_tokens=13)),
    ]  # fmt: skip
    ref = run(plain, masked)
    with counting_steps(multi) as seen:
        got = run(multi, masked)
    for rid in ("m", "free"):
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    # plain steps while "m" decodes (its prefill and 5 more tokens), bursts after it
    assert seen[:6] == [1] * 6 and 4 in seen, seen
    assert_pages_free(multi)


def test_engine_preemption_and_prefix_hits_under_bursts(tiny, plain, multi):
    """Four 42-token requests do not fit the 24 usable pages together: preemption; a repeated
    prompt hits the prefix cache. Tokens as plain steps, every page free at the end."""
    from engine_utils import assert_pages_free, random_prompt, run

    rng = __import__("numpy").random.default_rng(5)
    vocab = tiny.cfg.vocab_size
    shared = random_prompt(rng, 12, vocab)
    reqs = [
        (f"p{i}", shared + random_prompt(rng, 4, vocab), SamplingParams(temperature=0.0, max_tokens=26))
        for i in range(4)
    ]  # fmt: skip
    ref = run(plain, reqs)
    before = multi.scheduler.num_preemptions
    got = run(multi, reqs)
    for rid, *_ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    assert multi.scheduler.num_preemptions > before
    again = run(multi, reqs[:1])["p0"][0]
    assert again.token_ids == ref["p0"][0].token_ids and again.usage.cached_prompt_tokens > 0
    assert_pages_free(multi)


def test_a_tensor_mesh_bursts_the_same_tokens_and_data_axes_are_refused(tiny):
    """On the 8 virtual CPU devices (`tensor=8`, a tiny Llama of 8 heads) a multi-step engine
    decodes the tokens of a single-device plain one; `data` axes are refused by name."""
    from engine_utils import (
        assert_pages_free,
        load_vocab,
        make_engine,
        random_prompt,
        run,
        tiny_model,
    )

    with pytest.raises(ValueError, match="num_scheduler_steps=2 needs one data replica"):
        EngineConfig(mesh="data=2,tensor=4", num_scheduler_steps=2)
    model = tiny_model(load_vocab(), num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    rng = __import__("numpy").random.default_rng(6)
    prompts = [random_prompt(rng, n, model.cfg.vocab_size) for n in (4, 7)]
    reqs = [
        ("g", prompts[0], SamplingParams(temperature=0.0, max_tokens=15)),
        ("s", prompts[1], SamplingParams(temperature=0.8, seed=9, max_tokens=11, logprobs=1)),
    ]
    ref = run(make_engine(model, token_buckets=BUCKETS), reqs)
    mesh = make_engine(model, token_buckets=BUCKETS, mesh="tensor=8", num_scheduler_steps=4)
    with counting_steps(mesh) as seen:
        got = run(mesh, reqs)
    assert 4 in seen, seen
    for rid in ("g", "s"):
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    assert_pages_free(mesh)
