"""A step's request updates as the `TokenOutput`s the engine core returns (`EngineCore.step`;
no JAX).

`build(updates, out, aborted, live, masks)` -> (outputs, tokens generated):
1. Each request aborted since the last step that is still `live` (the core's requests by id)
   gets a final output with finish reason "abort" and leaves `live`.
2. Each update of a request still `live` (one finished outside, by a stop string, while the
   step ran is skipped) gives its new ids, their logprobs (accepted proposals' and a multi-step
   program's earlier steps' first: `RunnerOutput.draft_logprobs`, cut where a stop cut), the
   prompt logprobs its chunk brought, and at the end its finish and stop reasons and the time it
   waited to be scheduled; a finished request leaves `live`. Structured output's matcher (`masks`)
   advances by the new ids, or forgets a finished request.
3. A prefill chunk that did not sample yet still reports its prompt logprobs.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.engine.request import Request
from jaxinfer.engine.types import RequestUpdate, RunnerOutput, TokenOutput, new_tuple


def build(
    updates: list[RequestUpdate],
    out: RunnerOutput,
    aborted: list[Request],
    live: dict[str, Any],
    masks: Any,
) -> tuple[list[TokenOutput], int]:
    """The outputs of one step and the number of tokens it generated (module docstring)."""
    outputs = []
    so = masks
    for req in aborted:
        if so is not None:
            so.remove(req.request_id)
        if live.pop(req.request_id, None) is not None:
            outputs.append(
                TokenOutput(
                    req.request_id,
                    [],
                    finished=True,
                    finish_reason="abort",
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
    # NOTE: each prefill chunk brings prompt logprobs (only the last samples): report them all
    prompt_lps = {rid: lps for rid, lps in out.prompt_logprobs.items() if rid in live}
    logprobs = out.logprobs
    if so is not None and not so.active:
        so = None  # no matcher to advance: keep the hot loop as it was
    generated = 0
    for req, new_ids, done in updates:  # NOTE: a hot loop (one pass per sampled request)
        rid = req.request_id
        if rid not in live:
            continue  # finished outside (a stop string) while this step ran
        generated += len(new_ids)
        if so is not None and so.has(rid):
            if done:
                so.remove(rid)
            else:
                so.advance(rid, list(new_ids))
        lps = None
        if logprobs and rid in logprobs:  # accepted proposals' first, cut where a stop cut
            lps = (out.draft_logprobs.get(rid, []) + [logprobs[rid]])[: len(new_ids)]
        outputs.append(
            new_tuple(
                TokenOutput,
                (
                    rid,
                    new_ids,
                    lps,
                    prompt_lps.pop(rid, None) if prompt_lps else None,
                    done,
                    req.finish_reason if done else None,
                    req.stop_reason if done else None,
                    len(req.prompt_token_ids),
                    len(req.output_token_ids),
                    req.num_cached_tokens,
                    req.scheduled_time - req.arrival_time
                    if done and req.scheduled_time is not None
                    else None,
                ),
            )
        )
        if done:
            del live[rid]
    for rid, lps in prompt_lps.items():  # a prefill chunk that did not sample yet
        outputs.append(TokenOutput(rid, [], prompt_logprobs=lps))
    return outputs, generated
