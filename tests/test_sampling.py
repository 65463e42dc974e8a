"""Sampler tests: every filter against a numpy reference, seeds, mixed batches, logprobs, one program.

Distribution tests draw one token per row from many rows that share logits and parameters but not
seeds, so one jitted call yields hundreds of independent samples.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling
from jaxinfer.sampling import SamplingMetadata, apply_penalties, compute_logprobs, sample
from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams

SAMPLE = jax.jit(sample, static_argnames="num_logprobs")
V = 1000  # vocabulary of every jitted test (one shape per batch bucket -> few compiles)
DRAWS = 512  # rows (= independent samples) per distribution check
BUCKETS = (1, 8, 16, DRAWS)  # batch sizes, as the runner pads them


def run(
    logits: np.ndarray,  # f32[S, V]
    params: list[SamplingParams],
    *,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    suppress: list[list[int]] | None = None,
    prompt_mask: np.ndarray | None = None,  # bool[S, V]
    output_counts: np.ndarray | None = None,  # i32[S, V]
    pad_to: int | None = None,
) -> sampling.SamplerOutput:
    n, vocab = len(params), logits.shape[1]
    pad_to = pad_to or next(b for b in BUCKETS if b >= n)
    meta = SamplingMetadata.from_params(
        params, seeds or list(range(n)), suppress or [[]] * n, pad_to
    )
    pos = np.zeros(pad_to, np.int32)
    pos[:n] = positions or [0] * n

    def padded(a: np.ndarray | None, dtype: type) -> np.ndarray:
        out = np.zeros((pad_to, vocab), dtype)
        if a is not None:
            out[:n] = a
        return out

    out = SAMPLE(
        padded(logits, np.float32),
        meta,
        padded(prompt_mask, bool),
        padded(output_counts, np.int32),
        pos,
    )
    return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def draws(
    logits: np.ndarray, params: SamplingParams, suppress: list[int] = (), **row_inputs
) -> np.ndarray:
    """DRAWS tokens sampled from one row of logits f32[V] with seeds 0..DRAWS-1."""
    batch = {k: np.repeat(v[None], DRAWS, 0) for k, v in row_inputs.items()}
    return run(
        np.repeat(logits[None], DRAWS, 0),
        [params] * DRAWS,
        suppress=[list(suppress)] * DRAWS,
        **batch,
    ).token_ids


def reference_distribution(
    logits: np.ndarray,  # f[V]
    p: SamplingParams,
    prompt_mask: np.ndarray | None = None,
    output_counts: np.ndarray | None = None,
    suppress: list[int] = (),
) -> np.ndarray:
    """The distribution the sampler must draw from, in float64 (one-hot for greedy)."""
    x = logits.astype(np.float64)
    counts = np.zeros(x.shape, np.int64) if output_counts is None else output_counts
    seen = (counts > 0) if prompt_mask is None else (prompt_mask | (counts > 0))
    rp = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    x[list(suppress)] = -np.inf
    if p.temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    x = x / p.temperature
    probs = np.exp(x - x.max())
    if p.top_k:
        probs[x < np.sort(x)[::-1][p.top_k - 1]] = 0
    probs /= probs.sum()
    if p.top_p < 1:
        ordered = np.sort(probs)[::-1]
        boundary = ordered[np.argmax(np.cumsum(ordered) >= p.top_p)]
        probs[probs < boundary] = 0
    probs[probs < p.min_p * probs.max()] = 0
    return probs / probs.sum()


def assert_matches(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Every draw lies in the support, and every token's frequency fits its probability."""
    support = set(np.flatnonzero(probs))
    assert set(tokens.tolist()) <= support, (
        sorted(set(tokens.tolist()) - support),
        sorted(support),
    )
    freq = np.bincount(tokens, minlength=len(probs)) / len(tokens)
    tolerance = 5 * np.sqrt(probs * (1 - probs) / len(tokens)) + 1e-9
    np.testing.assert_array_less(np.abs(freq - probs), tolerance + 1.5 / len(tokens))
    expected = probs[probs > 0] * len(tokens)
    chi2 = np.sum((freq[probs > 0] * len(tokens) - expected) ** 2 / expected)
    dof = max(len(expected) - 1, 1)
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, chi2


def probs_logits(*probs: float) -> np.ndarray:
    """f32[V] logits whose softmax is `probs` (the remaining ids are -inf)."""
    out = np.full(V, -np.inf, np.float32)
    out[: len(probs)] = np.log(probs)
    return out


def test_from_params_pads_rows_with_greedy_defaults() -> None:
    params = [
        SamplingParams(
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.1,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
        )
    ]
    meta = SamplingMetadata.from_params(
        params, [2**40 + 7], [[2, 9]], pad_to=3, suppress_until=[12]
    )
    np.testing.assert_allclose(meta.temperature, [0.7, 0, 0])
    np.testing.assert_array_equal(meta.top_k, [5, 0, 0])
    np.testing.assert_allclose(meta.top_p, [0.9, 1, 1])
    np.testing.assert_allclose(meta.min_p, [0.1, 0, 0])
    np.testing.assert_allclose(meta.repetition_penalty, [1.2, 1, 1])
    np.testing.assert_allclose(meta.frequency_penalty, [0.5, 0, 0])
    np.testing.assert_allclose(meta.presence_penalty, [-0.5, 0, 0])
    np.testing.assert_array_equal(meta.seed, [[256, 7], [0, 0], [0, 0]])
    np.testing.assert_array_equal(meta.suppress_until, [12, 0, 0])
    assert meta.suppress_ids.shape == (3, sampling.SUPPRESS_WIDTH)
    np.testing.assert_array_equal(
        meta.suppress_ids[:, :3], [[2, 9, -1], [-1, -1, -1], [-1, -1, -1]]
    )
    wide = SamplingMetadata.from_params(params, [0], [list(range(9))], pad_to=1)
    assert wide.suppress_ids.shape == (1, 2 * sampling.SUPPRESS_WIDTH)
    repeated = SamplingMetadata.from_params(params, [0], [[4] * 12], pad_to=1)
    np.testing.assert_array_equal(repeated.suppress_ids[0, :2], [4, -1])


def test_from_params_rejects_bad_input() -> None:
    p = [SamplingParams()]
    with pytest.raises(ValueError, match="pad_to"):
        SamplingMetadata.from_params(p * 2, [0, 1], [[], []], pad_to=1)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.from_params(p, [0, 1], [[]], pad_to=2)
    with pytest.raises(ValueError, match="seeds"):
        SamplingMetadata.from_params(p, [-1], [[]], pad_to=1)
    with pytest.raises(ValueError, match="suppress"):
        SamplingMetadata.from_params(p, [0], [[-3]], pad_to=1)


def test_row_key_is_jax_random_key_of_seed() -> None:
    meta = SamplingMetadata.from_params([SamplingParams()], [12345], [[]], pad_to=1)
    expected = jax.random.key_data(jax.random.key(12345))
    np.testing.assert_array_equal(meta.seed[0], expected)


def test_greedy_takes_lowest_id_of_the_maximum() -> None:
    logits = np.full((4, V), -9.0, np.float32)
    logits[:, :5] = [
        [1.0, 3.0, 0.5, 3.0, 2.0],  # tie: lowest id wins
        [1.0, 3.0, 0.5, 3.0, 2.0],  # id 1 suppressed -> the tied id 3
        [-1.0, -2.0, -0.5, -3.0, -4.0],
        [1.0, 3.0, 0.5, 3.0, 2.0],
    ]  # filters are ignored when greedy
    params = [SamplingParams(temperature=0.0)] * 3 + [
        SamplingParams(temperature=0.0, top_k=1, top_p=0.1)
    ]
    out = run(logits, params, suppress=[[], [1], [], []])
    np.testing.assert_array_equal(out.token_ids, [1, 3, 2, 1])


def test_greedy_on_a_realistic_vocab_matches_numpy_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 49152)).astype(np.float32)
    logits[1, [5, 40000]] = 10.0  # tie across blocks
    logits[2, 49151] = 10.0  # last id
    out = run(logits, [SamplingParams(temperature=0.0)] * 4)
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=1))


def test_penalties_match_numpy() -> None:
    rng = np.random.default_rng(1)
    s, vocab = 4, 37
    logits = rng.standard_normal((s, vocab)).astype(np.float32) * 3
    prompt_mask = rng.random((s, vocab)) < 0.3
    counts = (rng.random((s, vocab)) < 0.3) * rng.integers(1, 4, (s, vocab))
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0),
    ]
    meta = SamplingMetadata.from_params(params, [0] * s, [[]] * s, s)
    got = np.asarray(
        apply_penalties(jnp.asarray(logits), meta, prompt_mask, counts.astype(np.int32))
    )
    for row, p in enumerate(params):
        x = logits[row].astype(np.float64)
        seen = prompt_mask[row] | (counts[row] > 0)
        x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - p.frequency_penalty * counts[row] - p.presence_penalty * (counts[row] > 0)
        np.testing.assert_allclose(got[row], x, rtol=1e-6, atol=1e-6)


def test_penalties_steer_greedy() -> None:
    logits = np.full((3, V), -9.0, np.float32)
    logits[:, :3] = [2.0, 1.9, 1.0]
    counts = np.zeros((3, V), np.int32)
    counts[:, 0] = 1
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),  # 2.0 / 1.1 < 1.9
        SamplingParams(temperature=0.0, presence_penalty=0.2),
    ]
    out = run(logits, params, output_counts=counts)
    np.testing.assert_array_equal(out.token_ids, [0, 1, 1])


# (case id, logits f32[V], params, support the filters must leave, by hand)
FILTER_CASES = [
    (
        "temperature-1",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(temperature=1.0),
        {0, 1, 2, 3},
    ),
    (
        "temperature-0.5",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(temperature=0.5),
        {0, 1, 2, 3},
    ),
    (
        "temperature-3",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(temperature=3.0),
        {0, 1, 2, 3},
    ),
    ("top-k", probs_logits(0.1, 0.4, 0.2, 0.3), SamplingParams(top_k=2), {1, 3}),
    ("top-k-keeps-ties", probs_logits(0.4, 0.2, 0.2, 0.2), SamplingParams(top_k=2), {0, 1, 2, 3}),
    ("top-k-1", probs_logits(0.3, 0.4, 0.3), SamplingParams(top_k=1, temperature=2.0), {1}),
    ("top-p-keeps-boundary", probs_logits(0.4, 0.3, 0.2, 0.1), SamplingParams(top_p=0.65), {0, 1}),
    (
        "top-p-boundary-later",
        probs_logits(0.1, 0.2, 0.3, 0.4),
        SamplingParams(top_p=0.75),
        {1, 2, 3},
    ),
    ("top-p-small-keeps-top", probs_logits(0.4, 0.3, 0.2, 0.1), SamplingParams(top_p=0.01), {0}),
    (
        "top-p-keeps-boundary-ties",
        probs_logits(0.4, 0.2, 0.2, 0.1, 0.1),
        SamplingParams(top_p=0.5),
        {0, 1, 2},
    ),
    (
        "top-p-after-temperature",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(top_p=0.65, temperature=0.3),
        {0},
    ),
    (
        "top-k-renormalises-top-p",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(top_k=2, top_p=0.55),
        {0},
    ),
    (
        "top-k-then-top-p",
        probs_logits(0.4, 0.3, 0.2, 0.1),
        SamplingParams(top_k=3, top_p=0.7),
        {0, 1},
    ),
    ("min-p", probs_logits(0.5, 0.25, 0.15, 0.1), SamplingParams(min_p=0.25), {0, 1, 2}),
    ("min-p-tight", probs_logits(0.5, 0.25, 0.15, 0.1), SamplingParams(min_p=0.35), {0, 1}),
    (
        "all-filters",
        probs_logits(0.3, 0.25, 0.2, 0.15, 0.1),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.8, min_p=0.3),
        {0, 1, 2},
    ),
]


@pytest.mark.parametrize(
    ("logits", "params", "support"), [c[1:] for c in FILTER_CASES], ids=[c[0] for c in FILTER_CASES]
)
def test_filters_match_reference(
    logits: np.ndarray, params: SamplingParams, support: set[int]
) -> None:
    probs = reference_distribution(logits, params)
    assert set(np.flatnonzero(probs)) == support  # the hand-written support agrees with numpy
    tokens = draws(logits, params)
    assert set(tokens.tolist()) == support
    assert_matches(tokens, probs)


def test_penalties_and_suppression_shape_the_sampled_distribution() -> None:
    rng = np.random.default_rng(2)
    logits = np.full(V, -np.inf, np.float32)
    logits[:32] = rng.standard_normal(32)  # a small support, so frequencies are well estimated
    prompt_mask = rng.random(V) < 0.4
    counts = ((rng.random(V) < 0.4) * rng.integers(1, 3, V)).astype(np.int32)
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        repetition_penalty=1.4,
        frequency_penalty=0.3,
        presence_penalty=0.2,
    )
    suppress = [int(np.argmax(logits)), 3]
    probs = reference_distribution(logits, params, prompt_mask, counts, suppress)
    tokens = draws(logits, params, suppress, prompt_mask=prompt_mask, output_counts=counts)
    assert not set(tokens.tolist()) & set(suppress)
    assert_matches(tokens, probs)


def test_top_p_on_a_long_tail_needs_many_rounds() -> None:
    # Flat-ish logits: the first draw usually misses a small nucleus and the pivot climbs.
    logits = -np.linspace(0, 3, 1000, dtype=np.float32)
    for top_p in (0.02, 0.6):
        params = SamplingParams(top_p=top_p)
        tokens = run(np.repeat(logits[None], DRAWS, 0), [params] * DRAWS).token_ids
        assert_matches(tokens, reference_distribution(logits, params))


def test_top_k_beyond_the_candidate_width_is_exact() -> None:
    rng = np.random.default_rng(3)
    vocab, k = 1000, sampling.TOP_K_CANDIDATES + 37
    logits = rng.standard_normal(vocab).astype(np.float32) * 0.1
    logits[rng.choice(vocab, 20, replace=False)] = np.sort(logits)[-k]  # ties at the k-th value
    params = SamplingParams(top_k=k, temperature=5.0)
    probs = reference_distribution(logits, params)
    tokens = run(np.repeat(logits[None], DRAWS, 0), [params] * DRAWS).token_ids
    assert set(tokens.tolist()) <= set(np.flatnonzero(probs).tolist())
    assert len(set(tokens.tolist())) > 0.8 * np.count_nonzero(probs)


def test_top_k_bisection_and_blocked_top_k_match_numpy() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5 * sampling.BLOCK)).astype(np.float32)
    x[0, ::7] = x[0, 3]  # many ties
    x[1, :200] = -np.inf
    x[2] = np.round(x[2] * 4) / 4  # coarse values, ties everywhere
    k = np.array([1, 300, 77], np.int32)
    xj = jnp.asarray(x)
    key = sampling._sortable_key(xj)
    lo, hi = jnp.zeros(3, jnp.uint32), key.max(axis=1)
    t = np.asarray(sampling._from_sortable_key(sampling._bisect_top_k(key, jnp.asarray(k), lo, hi)))
    for row, kk, tt in zip(x, k, t):
        np.testing.assert_array_equal(row >= tt, row >= np.sort(row)[::-1][kk - 1])
    values, ids = sampling._top_k(xj, 20, sampling._blocks(xj).max(axis=2))
    order = np.argsort(-x, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_array_equal(values, np.take_along_axis(x, order, axis=1))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("vocab", [37, 49152])
def test_compute_logprobs_matches_numpy(vocab: int) -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, vocab)).astype(np.float32) * 4
    logits[0, [1, 8, 30]] = logits[0].max() + 1  # tied top values: lowest id first
    ids = np.array([0, vocab - 1, 5], np.int32)
    chosen, topk_ids, topk_lp = compute_logprobs(
        jnp.asarray(logits), jnp.asarray(ids), MAX_LOGPROBS
    )
    ref = log_softmax(logits)
    np.testing.assert_allclose(chosen, ref[np.arange(3), ids], rtol=1e-5, atol=1e-5)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(topk_ids, order)
    np.testing.assert_allclose(
        topk_lp, np.take_along_axis(ref, order, axis=1), rtol=1e-5, atol=1e-5
    )
    assert np.all(np.diff(np.asarray(topk_lp), axis=1) <= 0)
    assert compute_logprobs(jnp.asarray(logits), jnp.asarray(ids), 0)[1].shape == (3, 0)
    with pytest.raises(ValueError, match="logprobs"):
        compute_logprobs(jnp.asarray(logits[:, :5]), jnp.asarray(ids), 6)


def test_sampler_logprobs_are_under_the_raw_distribution() -> None:
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    counts = (rng.random((3, V)) < 0.5).astype(np.int32)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=5),
        SamplingParams(temperature=0.3, top_k=3),  # in a batch where another row asks: computed
        SamplingParams(temperature=2.0, top_p=0.5, repetition_penalty=1.5, logprobs=0),
    ]
    out = run(logits, params, output_counts=counts)
    ref = log_softmax(logits)
    k = MAX_LOGPROBS
    np.testing.assert_allclose(out.logprobs, ref[np.arange(3), out.token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.topk_ids, np.argsort(-logits, axis=1, kind="stable")[:, :k])
    np.testing.assert_allclose(
        out.topk_logprobs, np.sort(ref, axis=1)[:, ::-1][:, :k], rtol=1e-5, atol=1e-5
    )


def test_sampler_skips_logprobs_when_no_row_asks() -> None:
    logits = np.random.default_rng(7).standard_normal((3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=4, seed=1)]
    skipped = run(logits[:2], params)
    assert not np.any(skipped.logprobs) and not np.any(skipped.topk_logprobs)
    asked = run(logits[:2], [params[0], dataclasses.replace(params[1], logprobs=2)])
    np.testing.assert_array_equal(skipped.token_ids, asked.token_ids)
    ref = log_softmax(logits[:2])
    np.testing.assert_allclose(
        asked.logprobs, ref[np.arange(2), asked.token_ids], rtol=1e-5, atol=1e-5
    )


MIXED = [
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(
        temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5
    ),
    SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0, presence_penalty=1.0),
]


def mixed_inputs(vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    n = len(MIXED)
    logits = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    return logits, rng.random((n, vocab)) < 0.2, (rng.random((n, vocab)) < 0.2).astype(np.int32)


def test_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    logits, prompt_mask, counts = mixed_inputs(V)
    seeds, positions, suppress = (
        [11, 22, 33, 44, 55, 66, 77],
        [0, 1, 2, 3, 4, 5, 6],
        [[], [], [1], [], [], [], [0]],
    )
    together = run(
        logits,
        MIXED,
        seeds=seeds,
        positions=positions,
        suppress=suppress,
        prompt_mask=prompt_mask,
        output_counts=counts,
        pad_to=16,
    )
    for row in range(len(MIXED)):
        alone = run(
            logits[row : row + 1],
            MIXED[row : row + 1],
            seeds=seeds[row : row + 1],
            positions=positions[row : row + 1],
            suppress=suppress[row : row + 1],
            prompt_mask=prompt_mask[row : row + 1],
            output_counts=counts[row : row + 1],
        )
        np.testing.assert_array_equal(together.token_ids[row], alone.token_ids[0])
        if MIXED[row].logprobs is None:  # computed for the batch (row 0 asks), not for it alone
            continue
        np.testing.assert_array_equal(together.topk_ids[row], alone.topk_ids[0])
        # Programs for different batch sizes may sum in different orders: logprobs agree to rounding.
        np.testing.assert_allclose(together.logprobs[row], alone.logprobs[0], rtol=1e-6)
        np.testing.assert_allclose(together.topk_logprobs[row], alone.topk_logprobs[0], rtol=1e-6)


def test_same_seed_and_position_give_the_same_token_whatever_the_batch() -> None:
    logits, prompt_mask, counts = mixed_inputs(V)
    seeds, positions = [5, 6, 7, 8, 9, 10, 11], [3, 3, 3, 9, 9, 9, 0]
    base = run(
        logits,
        MIXED,
        seeds=seeds,
        positions=positions,
        prompt_mask=prompt_mask,
        output_counts=counts,
    ).token_ids
    perm = np.random.default_rng(8).permutation(len(MIXED))
    extra = [SamplingParams(temperature=1.0, top_p=0.3)] * 3  # other rows change which branches run
    rng = np.random.default_rng(9)
    logits2 = np.concatenate([logits[perm], rng.standard_normal((3, V)).astype(np.float32)])
    shuffled = run(
        logits2,
        [MIXED[i] for i in perm] + extra,
        seeds=[seeds[i] for i in perm] + [1, 2, 3],
        positions=[positions[i] for i in perm] + [0, 0, 0],
        prompt_mask=np.concatenate([prompt_mask[perm], np.zeros((3, V), bool)]),
        output_counts=np.concatenate([counts[perm], np.zeros((3, V), np.int32)]),
        pad_to=16,
    ).token_ids
    np.testing.assert_array_equal(shuffled[: len(MIXED)], base[perm])


def test_different_seeds_or_positions_give_different_tokens() -> None:
    logits = np.zeros((64, 1000), np.float32)  # uniform: tokens differ unless the keys agree
    p = [SamplingParams(temperature=1.0)] * 64
    by_seed = run(logits, p, seeds=list(range(64))).token_ids
    by_pos = run(logits, p, seeds=[7] * 64, positions=list(range(64))).token_ids
    same = run(logits, p, seeds=[7] * 64, positions=[5] * 64).token_ids
    assert len(set(by_seed.tolist())) > 55 and len(set(by_pos.tolist())) > 55
    assert len(set(same.tolist())) == 1


def test_one_compiled_program_serves_every_mix() -> None:
    rng = np.random.default_rng(10)
    s = 8
    logits = rng.standard_normal((s, V)).astype(np.float32)
    prompt_mask, counts = np.zeros((s, V), bool), np.zeros((s, V), np.int32)
    mixes = [
        [SamplingParams(temperature=0.0)] * s,
        [SamplingParams(temperature=1.0)] * s,
        [SamplingParams(top_k=3)] * s,
        [SamplingParams(top_k=200)] * s,  # beyond the candidate width: bisection branch
        [SamplingParams(top_p=0.5)] * s,
        [SamplingParams(min_p=0.2, repetition_penalty=1.2)] * s,
        [SamplingParams(logit_bias={i: 1.0 for i in range(300)})] * s,  # the widest bias list
        (MIXED + MIXED)[:s],
    ]
    cache_sizes = []
    for i, params in enumerate(mixes):
        suppress = [[0, 1] if i % 2 else []] * s
        meta = SamplingMetadata.from_params(params, list(range(s)), suppress, s)
        jax.block_until_ready(SAMPLE(logits, meta, prompt_mask, counts, np.full(s, i, np.int32)))
        cache_sizes.append(SAMPLE._cache_size())
    assert len(set(cache_sizes)) == 1, cache_sizes  # only the first call may have compiled


def test_logit_bias_is_added_after_the_penalties() -> None:
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    counts = np.zeros((3, V), np.int32)
    counts[:, 5] = 2
    bias = {7: 30.0, 5: 40.0}
    params = [
        SamplingParams(temperature=0.0, logit_bias=bias, presence_penalty=2.0),
        SamplingParams(temperature=0.0, logit_bias={int(np.argmax(logits[1])): -100.0}),
        SamplingParams(temperature=1.0, logit_bias={i: -100.0 for i in range(300)}),
    ]
    out = run(logits, params, output_counts=counts).token_ids
    edited = logits[0] - 2.0 * (counts[0] > 0)
    edited[[7, 5]] += [30.0, 40.0]
    assert out[0] == np.argmax(edited) == 5
    assert out[1] == np.argsort(logits[1])[-2]
    draws_ = run(np.zeros((64, V), np.float32), [params[2]] * 64, seeds=list(range(64)))
    assert (draws_.token_ids >= 300).all()
    # a biased sampled row draws what it draws alone, whatever shares its batch
    mixed = [SamplingParams(temperature=0.9, logit_bias={3: 4.0, V - 1: 2.5})] + MIXED
    logits2 = rng.standard_normal((len(mixed), V)).astype(np.float32)
    together = run(logits2, mixed, seeds=list(range(len(mixed))), pad_to=16).token_ids
    alone = run(logits2[:1], mixed[:1], seeds=[0]).token_ids
    assert together[0] == alone[0]


def test_suppression_lasts_until_its_position() -> None:
    logits = np.full((4, V), -9.0, np.float32)
    logits[:, :3] = [3.0, 2.0, 1.0]
    params = [SamplingParams(temperature=0.0)] * 4
    meta = SamplingMetadata.from_params(params, [0] * 4, [[0]] * 4, 4, suppress_until=[10] * 4)
    zeros = np.zeros((4, V), np.int32)
    out = SAMPLE(logits, meta, zeros.astype(bool), zeros, np.array([8, 9, 10, 11], np.int32))
    np.testing.assert_array_equal(out.token_ids, [1, 1, 0, 0])


def test_race_times_are_exponential_and_keyed() -> None:
    words = jnp.asarray(np.random.default_rng(11).integers(0, 2**32, (8, 2), dtype=np.uint32))
    times = np.asarray(sampling._race_times(words, (8, 4096)))
    u = np.exp(-times).ravel()  # uniform on (0, 1) if the times are Exp(1)
    counts = np.bincount((u * 64).astype(int), minlength=64)
    expected = u.size / 64
    chi2 = np.sum((counts - expected) ** 2 / expected)
    assert chi2 < 63 + 5 * np.sqrt(2 * 63), chi2
    assert abs(times.mean() - 1.0) < 0.02
    assert np.corrcoef(times[0], times[1])[0, 1] < 0.05  # rows with different keys: independent
    np.testing.assert_array_equal(
        np.asarray(sampling._race_times(words[:1], (1, 4096)))[0], times[0]
    )


def test_float_noise_in_the_logits_does_not_move_the_sample() -> None:
    """Programs for different batch shapes round a row's logits differently (~1e-5 relative, issue
    14): a flat 49k vocabulary at temperature 0.8 must give the same tokens with 10x that noise.
    (The inverse-CDF draw this replaced changed 8 of these 64 rows; 2 at 1e-5.)"""
    rng = np.random.default_rng(12)
    s, vocab = 64, 49152
    logits = (rng.standard_normal((s, vocab)) * 3).astype(np.float32)
    noisy = logits + (rng.standard_normal((s, vocab)) * 1e-4 * np.abs(logits)).astype(np.float32)
    params = [SamplingParams(temperature=0.8)] * (s // 2) + [
        SamplingParams(temperature=0.8, top_p=0.95)
    ] * (s // 2)
    a = run(logits, params, seeds=list(range(1000, 1000 + s)), positions=[5] * s).token_ids
    b = run(noisy, params, seeds=list(range(1000, 1000 + s)), positions=[5] * s).token_ids
    np.testing.assert_array_equal(a, b)
    assert len(set(a.tolist())) > s * 0.9  # really sampled, not a near-greedy row


@pytest.mark.parametrize(
    "params,suppress_until,bitmask,staged",
    [
        (SamplingParams(temperature=0.0), 0, False, False),  # a plain greedy row
        (SamplingParams(temperature=0.7), 0, False, True),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), 0, False, True),
        (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), 0, False, True),
        (SamplingParams(temperature=0.0, logprobs=2), 0, False, True),
        (SamplingParams(temperature=0.0), 10, False, True),  # min_tokens: EOS still suppressed
        (SamplingParams(temperature=0.0), 5, False, False),  # ... not any more at position 7
        (SamplingParams(temperature=0.0), 0, True, True),  # a structured-output row
    ],
)
def test_needs_staged_is_one_rule_on_host_and_device(params, suppress_until, bitmask, staged):
    """The sampler's fast-path predicate, computed by the runner on the host (numpy, with the
    metadata's part kept) and by `sample` on the device, agree."""
    meta = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0), params],
        [0, 1],
        [[], [2]],
        2,
        suppress_until=[0, suppress_until],
    )
    positions = np.array([3, 7], np.int32)
    mask = np.full((2, 1), -1, np.int32)
    if bitmask:
        mask[1, 0] = 0b1011
    host = sampling.needs_staged(meta, positions, mask, xp=np)
    kept = sampling.needs_staged(
        meta, positions, mask, np, by_meta=sampling.staged_by_meta(meta, np)
    )
    device = jax.jit(sampling.needs_staged)(jax.device_put(meta), positions, mask)
    assert bool(host) == bool(kept) == bool(device) == staged
