"""Sampler: one jitted program turns a batch of logits into tokens, whatever mix of per-row params.

Every per-request knob is a row of an array in `SamplingMetadata` (gathered from the persistent
`SamplingRows` of a runner's batch), so a single compiled program
serves any mix of greedy, top-k, top-p, min-p and penalised rows; `lax.cond`s on "does any row need
this" skip the costly stages for batches that do not. A batch of greedy rows with no edits,
bitmask or logprobs takes one conditional and a row argmax (one kernel on an accelerator); the
others go through the stages below (`_sample_staged`). Flow of `sample`:
  1. Penalties (repetition on prompt-or-output tokens, then frequency and presence on output
     counts), then `logit_bias` (a sparse list of fixed width `MAX_LOGIT_BIAS` per row, added),
     then suppressed ids (EOS/stop ids under `min_tokens`) to -inf, then tokens a
     structured-output row's bitmask forbids to -inf (`token_bitmask`).
  2. Greedy rows (`temperature < GREEDY_EPS`) take the first index of the row maximum.
  3. Sampling rows: the top-k threshold is the k-th largest logit (ties kept), from an exact
     blocked top-k over `TOP_K_CANDIDATES` candidates, or by bisection when a row asks for more;
     dividing by a positive temperature keeps the order, so it is taken before scaling. Weights
     `w = exp((x - max) / temperature)` in [0, 1] are zeroed outside top-k. Min-p keeps
     `w >= min_p`, a lower bound the draws below start from (it is relative to the top token, so it
     commutes with top-p's renormalisation).
  4. The draw is an exponential race: token i arrives at E_i / w_i with E_i ~ Exp(1) from a
     keyed hash of its id, the earliest wins (i.e. Gumbel-max: P(i) = w_i / sum w). Top-p without
     sorting, by rejection: the first arrival `j` above a pivot is in the nucleus iff the mass
     strictly above `w[j]` is < top_p * (top-k mass); a rejected `j` becomes the pivot and the race
     is re-read among strictly likelier tokens (still a superset of the nucleus). The same arrival
     times serve every round: by memorylessness the later arrivals are fresh exponentials, and the
     accepted token is exactly the first arrival inside the nucleus, i.e. a draw from the
     renormalised nucleus. The pass that reads the next candidate also measures the mass above the
     current one, so each round is one pass over `[S, V]`; rows without top-p accept their first
     draw. With top_p = 0.9 a first draw is accepted with probability >= 0.9.
  5. Logprobs of the chosen token and the top-`num_logprobs` under the raw model distribution,
     only when some row asks for them.

Randomness is batch-invariant: row `s` races on arrival times hashed from its token ids and two
words of `fold_in(key(seed[s]), position[s])`, where `position` is where the sampled token goes in
its sequence. Its token depends only on its own logits,
parameters, seed and position (so a preempted request that recomputes resamples the same tokens).
Programs compiled for different batch sizes may compute a row's logits with different rounding
(~1e-5); an argmax of elementwise scores moves on that only at true near-ties (two arrivals that
close), unlike an inverse CDF over a 49k-entry running sum.

NOTE: on XLA:CPU (jaxlib 0.10.2) sorting a [64, 49152] f32 array takes ~0.8 s, `argmax` ~13 ms and
a full-row reduction about twice a two-stage one, so nothing here sorts a row and every row max,
sum, argmax and top-k goes through `BLOCK`-wide vocabulary blocks.
"""

from __future__ import annotations

import functools
import operator

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.sampling_metadata import SUPPRESS_WIDTH, SamplingMetadata, SamplingRows  # noqa: F401
from jaxinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels import target

BLOCK = 128  # vocabulary block for blocked max / top-k / argmax / sums
GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
TOP_K_CANDIDATES = 64  # top_k up to this uses one blocked lax.top_k; larger k bisects
MAX_ROUNDS = 64  # rejection rounds before a row falls back to its top token (~never)


@flax.struct.dataclass
class SamplerOutput:
    """One sampled token per row and its logprobs under the raw model distribution."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S] chosen token under the raw model distribution
    topk_ids: jax.Array  # i32[S, num_logprobs]
    topk_logprobs: jax.Array  # f32[S, num_logprobs] raw log_softmax, descending


def _pad_vocab(x: jax.Array) -> jax.Array:  # f32[S, V] -> f32[S, Vp], Vp a multiple of BLOCK
    pad = -x.shape[1] % BLOCK
    return x if pad == 0 else jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)


def _blocks(x: jax.Array) -> jax.Array:  # [S, Vp] -> [S, Vp // BLOCK, BLOCK]
    return x.reshape(x.shape[0], -1, BLOCK)


def _row_sum(x: jax.Array) -> jax.Array:  # f32[S, Vp] -> f32[S]
    # NOTE: two-stage (blocks, then rows) reductions run ~2x faster than one row reduction on XLA:CPU.
    return _blocks(x).sum(axis=2).sum(axis=1)


def _argmax(x: jax.Array, block_max: jax.Array) -> jax.Array:
    """First index of each row's maximum (lowest id on ties), without XLA:CPU's slow argmax."""
    # x f32[S, Vp]; block_max f32[S, NB]
    row_max = block_max.max(axis=1, keepdims=True)
    nb = block_max.shape[1]
    block = jnp.min(jnp.where(block_max == row_max, lax.iota(jnp.int32, nb), nb), axis=1)
    values = jnp.take_along_axis(_blocks(x), block[:, None, None], axis=1)[:, 0]  # f32[S, BLOCK]
    offset = jnp.min(jnp.where(values == row_max, lax.iota(jnp.int32, BLOCK), BLOCK), axis=1)
    return block * BLOCK + offset


def _top_k(x: jax.Array, k: int, block_max: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exactly `lax.top_k(x, k)` (descending, lowest id first on ties), searching only k blocks.

    The k largest elements lie in the k blocks with the largest maxima (ties to the lower block),
    so one small top-k over block maxima and one over the k gathered blocks suffice.
    """
    # x f32[S, Vp]; block_max f32[S, NB]
    s, nb = block_max.shape
    if k >= nb:
        return lax.top_k(x, k)
    _, blocks = lax.top_k(block_max, k)
    blocks = jnp.sort(blocks, axis=1)  # keep vocabulary order so ties resolve to the lower id
    cand = jnp.take_along_axis(_blocks(x), blocks[:, :, None], axis=1).reshape(s, k * BLOCK)
    values, pos = lax.top_k(cand, k)
    ids = jnp.take_along_axis(blocks, pos // BLOCK, axis=1) * BLOCK + pos % BLOCK
    return values, ids


def compute_logprobs(
    logits: jax.Array,  # f32[T, V] raw model logits
    token_ids: jax.Array,  # i32[T]
    k: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log_softmax of `token_ids` and the top-k (also used for prompt logprobs).

    Returns:
      chosen f32[T], topk_ids i32[T, k], topk_logprobs f32[T, k] (descending, lowest id on ties).
    """
    vocab = logits.shape[1]
    if not 0 <= k <= vocab:
        raise ValueError(f"k={k} logprobs must be in [0, vocab size {vocab}]")
    with jax.named_scope("logprobs"):
        x = _pad_vocab(logits.astype(jnp.float32))
        block_max = _blocks(x).max(axis=2)  # f32[T, NB]
        row_max = block_max.max(axis=1, keepdims=True)
        lse = row_max + jnp.log(_row_sum(jnp.exp(x - row_max)))[:, None]  # f32[T, 1]
        ids = jnp.clip(token_ids, 0, vocab - 1)
        chosen = jnp.take_along_axis(x, ids[:, None], axis=1)[:, 0] - lse[:, 0]
        if k == 0:
            return (
                chosen,
                jnp.zeros((x.shape[0], 0), jnp.int32),
                jnp.zeros((x.shape[0], 0), jnp.float32),
            )
        values, topk_ids = _top_k(x, k, block_max)
        return chosen, topk_ids, values - lse


def apply_penalties(
    logits: jax.Array,  # f32[S, V]
    meta: SamplingMetadata,
    prompt_mask: jax.Array,  # bool[S, V] token appears in the prompt
    output_counts: jax.Array,  # i32[S, V] occurrences in the output so far
) -> jax.Array:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI) penalties; f32[S, V]."""
    with jax.named_scope("penalties"):
        in_output = output_counts > 0
        rep = meta.repetition_penalty[:, None]
        penalised = jnp.where(logits > 0, logits / rep, logits * rep)
        x = jnp.where(prompt_mask | in_output, penalised, logits)
        x = x - meta.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
        return x - meta.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _sortable_key(x: jax.Array) -> jax.Array:  # f32[...] -> u32[...] with the same order
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_sortable_key(key: jax.Array) -> jax.Array:  # u32[...] -> f32[...]
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_top_k(
    key: jax.Array,  # u32[S, N] sortable keys
    k: jax.Array,  # i32[S] in [1, N]
    lo: jax.Array,  # u32[S] with count(key >= lo) >= k
    hi: jax.Array,  # u32[S] at least the k-th largest key
) -> jax.Array:
    """u32[S] t with `{key >= t}` = the k largest keys (ties kept), by bisection over the keys.

    Stops once every row's interval is one key or holds exactly k keys above its low end: at most
    33 counting passes over `[S, N]`, far fewer when the bounds are tight.
    """
    blocked = key.shape[1] % BLOCK == 0

    def count(t: jax.Array) -> jax.Array:  # u32[S] -> i32[S] keys >= t
        above = key >= t[:, None]
        if blocked:
            return _blocks(above).sum(axis=2, dtype=jnp.int32).sum(axis=1)
        return above.sum(axis=1, dtype=jnp.int32)

    def halve(state):  # invariant: count(lo) >= k and the k-th largest <= hi
        lo, hi, n_lo = state
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        n = count(mid)
        ok = n >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1), jnp.where(ok, n, n_lo)

    def unresolved(state) -> jax.Array:
        lo, hi, n_lo = state
        return jnp.any((lo < hi) & (n_lo != k))

    lo, _, _ = lax.while_loop(unresolved, halve, (lo, hi, count(lo)))
    return lo


def _top_k_threshold(
    x: jax.Array,  # f32[S, Vp]
    k: jax.Array,  # i32[S] 0 = off
    block_max: jax.Array,  # f32[S, NB]
) -> jax.Array:
    """f32[S] t with `{x >= t}` = each row's top-k set (ties kept); -inf where k == 0."""
    with jax.named_scope("top_k"):
        width = min(TOP_K_CANDIDATES, x.shape[1])
        values, _ = _top_k(x, width, block_max)  # f32[S, width]
        kth = jnp.take_along_axis(values, jnp.clip(k - 1, 0, width - 1)[:, None], axis=1)[:, 0]
        threshold = jnp.where(k == 0, -jnp.inf, kth)
        large = k > width

        def bisect() -> jax.Array:
            # Rows with k > width bisect between the k-th largest block maximum (k blocks reach it,
            # so at least k values do) and the width-th largest value; other rows stop at once.
            nb = block_max.shape[1]
            kk = jnp.where(large, k, 1)
            bm_key = _sortable_key(block_max)
            bm_lo, bm_hi = bm_key.min(axis=1), bm_key.max(axis=1)
            lo = jnp.where(kk <= nb, _bisect_top_k(bm_key, jnp.minimum(kk, nb), bm_lo, bm_hi), 0)
            hi = jnp.where(large, _sortable_key(values[:, -1]), lo)
            t = _from_sortable_key(_bisect_top_k(_sortable_key(x), kk, lo, hi))
            return jnp.where(large, t, threshold)

        return lax.cond(jnp.any(large), bisect, lambda: threshold)


def _mix32(x: jax.Array) -> jax.Array:  # u32[...] -> u32[...], a bijective avalanche hash
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _race_times(
    words: jax.Array,  # u32[S, 2] per-row key words for this round
    shape: tuple[int, int],  # (S, Vp)
) -> jax.Array:
    """f32[S, Vp] i.i.d. Exp(1) arrival times, a pure function of (row key, token id).

    Each token's uniform is a keyed hash of its id (two rounds of `_mix32` around the row's two
    threefry words), so a row's times depend on nothing but its key: no batch-shaped random state.
    """
    ids = lax.broadcasted_iota(jnp.uint32, shape, 1)
    bits = _mix32(_mix32(ids ^ words[:, :1]) + words[:, 1:])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -jnp.log(u)


def _draw(
    w: jax.Array,  # f32[S, Vp] weights, 0 outside the top-k set
    pivot: jax.Array,  # f32[S] draw only among w > pivot
    speed: jax.Array,  # f32[S, Vp] w / E: inverse arrival times of the row's race
) -> tuple[jax.Array, jax.Array]:
    """First arrival of the exponential race among w > pivot: token i arrives at E_i / w_i, which
    picks i with probability w_i / sum(w > pivot). Returns (token i32[S], mass above pivot f32[S]).

    NOTE: the winner is an argmax of elementwise values, so float noise in the logits (~1e-5
    between programs compiled for different batch shapes) changes it only when two tokens'
    arrival times are that close; inverse-CDF sampling compares a running sum over the whole
    vocabulary to the draw and flipped on such noise (issue 14).
    """
    eligible = w > pivot[:, None]
    score = jnp.where(eligible, speed, -1.0)  # f32[S, Vp]
    token = _argmax(score, _blocks(score).max(axis=2))
    return token, _row_sum(jnp.where(eligible, w, 0.0))


def _sample_rows(
    x: jax.Array,  # f32[S, Vp] penalised, suppressed, padded logits
    block_max: jax.Array,  # f32[S, NB]
    vocab: int,
    meta: SamplingMetadata,
    positions: jax.Array,  # i32[S] position of the token each row samples (its random counter)
    active: jax.Array,  # bool[S] rows that sample (non-greedy)
    fallback: jax.Array,  # i32[S] token for a row that runs out of rounds (its top token)
) -> jax.Array:
    """Temperature, top-k, top-p, min-p and the draw for `active` rows; i32[S] (garbage elsewhere)."""
    with jax.named_scope("filters"):
        temperature = jnp.where(active, meta.temperature, 1.0)[:, None]
        top_k = jnp.where(active & (meta.top_k < vocab), meta.top_k, 0)
        # Top-k on the unscaled logits: dividing by a positive temperature keeps their order.
        t_k = lax.cond(
            jnp.any(top_k > 0),
            lambda: _top_k_threshold(x, top_k, block_max),
            lambda: jnp.full(x.shape[:1], -jnp.inf),
        )
        scaled_max = block_max.max(axis=1, keepdims=True) / temperature  # = max of x / temperature
        # f32[S, Vp] probabilities relative to the top token, 0 outside the top-k set
        w = jnp.where(x >= t_k[:, None], jnp.exp(x / temperature - scaled_max), 0.0)
        top_p_mass = jnp.where(active, meta.top_p, 1.0) * _row_sum(w)  # renormalised after top-k
        needs_top_p = active & (meta.top_p < 1.0)
        # Min-p keeps w >= min_p: the draws' first pivot is the largest float below min_p.
        min_p_pivot = jnp.nextafter(jnp.where(active, meta.min_p, 0.0), -1.0)

    with jax.named_scope("race"):
        words = jax.vmap(
            lambda seed, pos: jax.random.bits(
                jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos),
                (2,),
                jnp.uint32,
            )
        )(meta.seed, positions)  # u32[S, 2]
        speed = w / _race_times(words, w.shape)  # f32[S, Vp]

    def round_(state):
        r, pivot, cand, token, done = state
        draw, mass_above = _draw(w, pivot, speed)
        # Judge last round's candidate: pivot == w[cand], so mass_above is the mass strictly above it.
        judged = ~done & (r > 0) & (mass_above < top_p_mass)
        token = jnp.where(judged, cand, token)
        done = done | judged
        accept = ~done & ~needs_top_p  # no nucleus to check: the first draw is final
        token = jnp.where(accept, draw, token)
        done = done | accept
        pivot = jnp.where(done, pivot, jnp.take_along_axis(w, draw[:, None], axis=1)[:, 0])
        return r + 1, pivot, draw, token, done

    with jax.named_scope("draw"):
        # Round 0 outside the loop: rows without top-p accept their first draw, and a batch
        # with no top-p row skips the loop. NOTE: on XLA:CPU the same round inside a while loop
        # made temperature-1 sampling of [64, 49152] ~2x slower (~150 ms vs ~70 ms a call).
        draw, _ = _draw(w, min_p_pivot, speed)
        accept = active & ~needs_top_p
        done = ~active | accept
        pivot = jnp.where(done, min_p_pivot, jnp.take_along_axis(w, draw[:, None], axis=1)[:, 0])
        init = (jnp.int32(1), pivot, draw, jnp.where(accept, draw, 0), done)
        _, _, _, token, done = lax.cond(
            jnp.all(done),
            lambda: init,
            lambda: lax.while_loop(
                lambda state: (state[0] < MAX_ROUNDS) & ~jnp.all(state[4]), round_, init
            ),
        )
        return jnp.where(done, token, fallback)


def apply_token_bitmask(
    x: jax.Array,  # f32[S, V]
    bitmask: jax.Array,  # i32[S, W] W * 32 >= V; bit b of word w covers token 32 * w + b
) -> jax.Array:
    """Tokens whose bit is clear -> -inf."""
    s, vocab = x.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"token bitmask of {bitmask.shape[1]} words covers fewer than {vocab} tokens"
        )
    # bits[s, w, b] = bit b of word w
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[S, W, 32]
    allowed = bits.reshape(s, -1)[:, :vocab] != 0  # bool[S, V]
    return jnp.where(allowed, x, -jnp.inf)


def _edit_logits(
    logits: jax.Array,  # f32[S, V]
    meta: SamplingMetadata,
    prompt_mask: jax.Array,  # bool[S, V]
    output_counts: jax.Array,  # i32[S, V]
    suppressing: jax.Array,  # bool[S] the row's suppress_ids apply at this position
) -> jax.Array:
    """Penalties, then logit biases added, then suppressed ids to -inf."""
    s, vocab = logits.shape
    rows = jnp.arange(s)[:, None]
    x = apply_penalties(logits, meta, prompt_mask, output_counts)
    with jax.named_scope("logit_bias"):
        # NOTE: ids are distinct within a row (a dict's keys); padding -> out of range -> dropped
        ids = jnp.where((meta.bias_ids >= 0) & (meta.bias_ids < vocab), meta.bias_ids, vocab)
        x = x.at[rows, ids].add(meta.bias_values, mode="drop")
    with jax.named_scope("suppress"):
        ids = meta.suppress_ids
        # padding and rows not suppressing now -> out of range -> dropped
        ids = jnp.where((ids >= 0) & (ids < vocab) & suppressing[:, None], ids, vocab)
        return x.at[rows, ids].set(-jnp.inf, mode="drop")


def sample(
    logits: jax.Array,  # f32[S, V] raw model logits
    meta: SamplingMetadata,
    prompt_mask: jax.Array,  # bool[S, V] token appears in the prompt
    output_counts: jax.Array,  # i32[S, V] occurrences in the output so far
    positions: jax.Array,  # i32[S] position the sampled token takes in its sequence
    *,
    num_logprobs: int = MAX_LOGPROBS,
    token_bitmask: jax.Array | None = None,  # i32[S, ceil(V / 32)] allowed tokens; -1 rows: all
    staged: jax.Array | None = None,  # bool[1] `needs_staged` computed by the caller
) -> SamplerOutput:
    """Samples one token per row; jit with `num_logprobs` static, everything else traced.

    Args:
      logits: raw model logits of each row's last position.
      meta: per-row parameters (`SamplingMetadata.from_params` or `SamplingRows.gather`).
      prompt_mask: which tokens the row's prompt contains (repetition penalty).
      output_counts: how often each token occurs in the row's output (all three penalties).
      positions: where the sampled token goes (= tokens before it): the row's random counter with
        its seed, and the clock of `suppress_until`.
      num_logprobs: width of the returned top-k logprobs (static).
      token_bitmask: structured output (`jaxinfer.structured`): bit `t % 32` of word `t // 32`
        set = token t allowed; every other token is -inf before any filter. Rows of all ones
        (-1) are unconstrained; a batch without a constrained row skips the stage.
      staged: `needs_staged` of these inputs, when the caller has it (the runner computes it on
        the host with each step's inputs: a GPU step then launches no flag reductions, ~9
        kernels at 64 rows); None: computed here.

    Returns:
      `SamplerOutput`; logprobs are under the raw model distribution, whatever the filters. They
      are computed only when some row `wants_logprobs` (zeros otherwise): the log-sum-exp and top-k
      over the vocabulary cost about as much as greedy sampling itself (~9 ms of ~17 ms for 64
      rows of a 49k vocabulary on XLA:CPU).
    """
    logits = logits.astype(jnp.float32)
    suppressing = positions < meta.suppress_until
    greedy, penalised = _row_kinds(meta)
    if staged is None:
        staged = needs_staged(meta, positions, token_bitmask)
    s = logits.shape[0]
    # NOTE: one conditional on the common path (issue 31): a batch of greedy rows without edits,
    # constraints or logprobs takes the row argmax alone, the others the staged sampler (whose
    # own conditionals skip the stages no row needs).
    return lax.cond(
        jnp.reshape(staged, ()),
        lambda: _sample_staged(
            logits,
            meta,
            prompt_mask,
            output_counts,
            positions,
            suppressing,
            penalised,
            greedy,
            num_logprobs,
            token_bitmask,
        ),
        lambda: SamplerOutput(
            _greedy_ids(logits),
            jnp.zeros((s,), jnp.float32),
            jnp.zeros((s, num_logprobs), jnp.int32),
            jnp.zeros((s, num_logprobs), jnp.float32),
        ),
    )


def _row_kinds(meta: SamplingMetadata):
    """(greedy, penalised), bool[S] each (numpy or jnp arrays in, the same out)."""
    greedy = meta.temperature < GREEDY_EPS
    penalised = (
        (meta.repetition_penalty != 1.0)
        | (meta.frequency_penalty != 0.0)
        | (meta.presence_penalty != 0.0)
    )
    return greedy, penalised


def needs_staged(meta: SamplingMetadata, positions, token_bitmask=None, xp=jnp, by_meta=None):
    """Whether some row needs more than a plain argmax (a penalty, an active suppressed id, a
    logit bias, a temperature, logprobs, a bitmask): the predicate of `sample`'s conditional.
    The one rule for both sides: `xp=jnp` on the device, `xp=np` on the host (the runner's step
    inputs, which passes `by_meta`, the `staged_by_meta` of an unchanged `meta`, kept)."""
    flags = [staged_by_meta(meta, xp) if by_meta is None else by_meta]
    suppressing = positions < meta.suppress_until
    flags.append(xp.any((meta.suppress_ids >= 0) & suppressing[:, None]))
    if token_bitmask is not None:  # NOTE: its rows may be fewer (verify rows: unconstrained)
        flags.append(xp.any(token_bitmask != -1))
    return functools.reduce(operator.or_, flags)


def staged_by_meta(meta: SamplingMetadata, xp=jnp):
    """The part of `needs_staged` that reads `meta` alone: a penalised, sampling (temperature),
    logit-biased or logprobs row."""
    greedy, penalised = _row_kinds(meta)
    return xp.any(penalised | ~greedy | meta.wants_logprobs) | xp.any(meta.bias_ids >= 0)


def _greedy_ids(logits: jax.Array) -> jax.Array:
    """i32[S] first index of each row's maximum: one argmax kernel on an accelerator, the blocked
    `_argmax` on XLA:CPU (whose argmax is slow; module NOTE). Both pick the lowest id on ties."""
    vocab = logits.shape[1]
    if target.platform() == "cpu":
        x = _pad_vocab(logits)
        ids = _argmax(x, _blocks(x).max(axis=2))
    else:
        ids = jnp.argmax(logits, axis=1).astype(jnp.int32)
    return jnp.minimum(ids, vocab - 1)


def _sample_staged(
    logits: jax.Array,  # f32[S, V]
    meta: SamplingMetadata,
    prompt_mask: jax.Array,
    output_counts: jax.Array,
    positions: jax.Array,
    suppressing: jax.Array,  # bool[S] the row's suppress_ids apply now
    penalised: jax.Array,  # bool[S] the row has a penalty
    greedy: jax.Array,  # bool[S]
    num_logprobs: int,
    token_bitmask: jax.Array | None,
) -> SamplerOutput:
    """Steps 1-5 of the module docstring, each stage skipped by a conditional when no row needs it."""
    vocab = logits.shape[1]
    edits = (
        jnp.any(penalised)
        | jnp.any((meta.suppress_ids >= 0) & suppressing[:, None])
        | jnp.any(meta.bias_ids >= 0)
    )
    x = lax.cond(
        edits,
        lambda: _edit_logits(logits, meta, prompt_mask, output_counts, suppressing),
        lambda: logits,
    )
    if token_bitmask is not None:
        with jax.named_scope("token_bitmask"):
            x = lax.cond(
                jnp.any(token_bitmask != -1),
                lambda: apply_token_bitmask(x, token_bitmask),
                lambda: x,
            )
    x = _pad_vocab(x)
    with jax.named_scope("greedy"):
        block_max = _blocks(x).max(axis=2)  # f32[S, NB]
        greedy_ids = _argmax(x, block_max)
    token_ids = lax.cond(
        jnp.all(greedy),
        lambda: greedy_ids,
        lambda: jnp.where(
            greedy,
            greedy_ids,
            _sample_rows(x, block_max, vocab, meta, positions, ~greedy, greedy_ids),
        ),
    )
    token_ids = jnp.minimum(token_ids, vocab - 1)  # NaN logits must not yield an id past the vocab
    s = logits.shape[0]
    chosen, topk_ids, topk_logprobs = lax.cond(
        jnp.any(meta.wants_logprobs),
        lambda: compute_logprobs(logits, token_ids, num_logprobs),
        lambda: (
            jnp.zeros((s,), jnp.float32),
            jnp.zeros((s, num_logprobs), jnp.int32),
            jnp.zeros((s, num_logprobs), jnp.float32),
        ),
    )
    return SamplerOutput(token_ids, chosen, topk_ids, topk_logprobs)
