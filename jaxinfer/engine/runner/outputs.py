"""A step's fetched device results -> `RunnerOutput` (plain Python, per request).

1. Sampled ids of the rows that sample (`UnpackPlan.sample_slots`).
2. Speculative rows: the longest prefix of the proposals equal to the verify rows' samples
   (`spec_decode.rejection.accept`) becomes `accepted_draft_ids`, the next sample the sampled id.
3. Multi-step programs (`UnpackPlan.num_steps` > 1): every step's id of each row, in order
   (`RunnerOutput.step_token_ids`), the last one as its sampled id; the rows asking for
   logprobs get every step's (the earlier steps' as `draft_logprobs`, as for accepted
   proposals: the tokens before the sampled one).
4. Logprobs of the rows that asked (the accepted proposals' too), prompt logprobs of the token
   rows of requests that asked for them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxinfer.engine.runner.step_inputs import UnpackPlan
from jaxinfer.engine.types import RunnerOutput, TokenLogprobs
from jaxinfer.spec_decode import rejection


def fetch_results(results: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """A launched step's device results as numpy (waiting for them): `jax.device_get`, with the
    common step's (sampled ids alone) fetched without its tree walks.

    NOTE: on a small CPU host this runs beside the next step, whose weight stream keeps the
    caches cold: there every numpy or jax call costs tens of microseconds, and the decode step's
    fetch and unpack went from ~300 to ~80 us of the engine thread's CPU with one of each
    (BENCHMARKS.md "The engine thread's host work, call by call")."""
    token_ids, out, prompt = results
    if out is None and prompt is None:
        return np.asarray(token_ids), None, None
    return jax.device_get(results)


def unpack_results(
    plan: UnpackPlan,
    # i32[R] sampled ids of every result row (verify rows after S); multi-step: i32[steps, S]
    token_ids: np.ndarray,
    out: Any,  # the sampler's output as numpy (logprob arrays), or None when no row asked
    prompt: Any,  # (chosen, top ids, top logprobs) of every token row, or None
) -> RunnerOutput:
    """A step's fetched results as plain Python, per request (see the module docstring)."""
    if plan.num_steps > 1:
        return _unpack_steps(plan, token_ids, out)
    ids = token_ids.tolist()  # NOTE: plain lists: one numpy call, not a gather (see fetch_results)
    sampled = {rid: ids[i] for rid, i in zip(plan.sample_ids, plan.sample_slots)}
    accepted, draft_lps, final_row = {}, {}, {}
    for rid, slot, lo, drafts in plan.spec:
        k = len(drafts)
        targets = token_ids[lo : lo + k].tolist() + [sampled[rid]]
        emitted, a = rejection.accept(drafts, targets)
        accepted[rid], sampled[rid] = emitted[:-1], emitted[-1]
        final_row[rid] = (lo + a if a < k else slot, lo)

    def token_lps(i: int, k: int) -> TokenLogprobs:
        return _logprobs(token_ids[i], out.logprobs[i], out.topk_ids[i], out.topk_logprobs[i], k)

    logprobs, prompt_lps = {}, {}
    for rid, i, k in plan.logprob_rows:
        if rid in final_row:
            i, lo = final_row[rid]
            draft_lps[rid] = [token_lps(lo + j, k) for j in range(len(accepted[rid]))]
        logprobs[rid] = token_lps(i, k)
    for rid, lo, hi, start, num_prompt, k in plan.prompt_rows:
        chosen, top_ids, top_lps = prompt
        entries = {}
        for t in range(lo, hi):
            pos = start + (t - lo) + 1  # the prompt position this row predicts
            if pos >= num_prompt:
                break
            entries[pos] = _logprobs(plan.target_ids[t], chosen[t], top_ids[t], top_lps[t], k)
        prompt_lps[rid] = entries
    return RunnerOutput(
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs=prompt_lps,
        accepted_draft_ids=accepted,
        draft_logprobs=draft_lps,
    )


def _unpack_steps(plan: UnpackPlan, token_ids: np.ndarray, out: Any) -> RunnerOutput:
    """A multi-step program's results (step 3): `token_ids` i32[steps, S], `out` the stacked
    sampler outputs (or None when no row asked for logprobs)."""
    n = plan.num_steps
    steps = token_ids[:n, plan.sample_slots].T.tolist()
    logprobs, earlier = {}, {}
    for rid, i, k in plan.logprob_rows:
        lps = [
            _logprobs(
                token_ids[j, i], out.logprobs[j, i], out.topk_ids[j, i], out.topk_logprobs[j, i], k
            )
            for j in range(n)
        ]
        earlier[rid], logprobs[rid] = lps[:-1], lps[-1]
    return RunnerOutput(
        sampled_token_ids={rid: ids[-1] for rid, ids in zip(plan.sample_ids, steps)},
        logprobs=logprobs,
        draft_logprobs=earlier,
        step_token_ids=dict(zip(plan.sample_ids, steps)),
    )


def _logprobs(
    token: Any, logprob: Any, top_ids: np.ndarray, top_lps: np.ndarray, k: int
) -> TokenLogprobs:
    """One token's `TokenLogprobs`: its id and logprob, and the first `k` of the top ids."""
    return TokenLogprobs(
        int(token), float(logprob), dict(zip(top_ids[:k].tolist(), top_lps[:k].tolist()))
    )
