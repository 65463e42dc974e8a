"""What a prompt is checked against before it reaches an engine core (JAX-free).

1. `EngineLimits`: the core's vocabulary size, context length and budgets, sent to the front end
   at start (`types.EngineInfo`).
2. `check_prompt(ids, sampling, limits, ...)` refuses a prompt the core could not run (empty,
   ids out of the vocabulary, too long for the context with its output budget, bad stop ids,
   a structured-output constraint that does not compile), raising `FieldError` named in the
   caller's spelling (`name`): one rule for both protocols and the Python API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxinfer.sampling_params import FieldError, SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What a prompt is checked against (the front end gets these from the core at start)."""

    vocab_size: int
    max_model_len: int
    page_size: int
    num_pages: int  # usable pages of one data replica (a request lives in one replica)


def _same(field: str) -> str:
    return field


def check_prompt(
    ids: Sequence[int],
    sampling: SamplingParams,
    limits: EngineLimits,
    *,
    name: Callable[[str], str] = _same,
    grammar: bool = True,
) -> None:
    """The one prompt-length / vocabulary / page check every entry point calls; a
    structured-output constraint must compile too (unless `grammar` is False: the engine core
    builds and proves the matcher itself, off its step thread). Raises `FieldError` (a ValueError) naming the
    field as `name` spells it (a protocol's spelling of "prompt", "prompt[i]", "max_tokens",
    "stop_token_ids[i]", "structured_outputs.<kind>"; default: these).

    NOTE: a prompt that alone leaves no room to generate names the prompt; a prompt that fits
    but not with `max_tokens` names max_tokens.
    """
    prompt, max_tokens = name("prompt"), name("max_tokens")
    if not ids:
        raise FieldError(prompt, " is empty (no tokens)")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise FieldError(
                name(f"prompt[{i}]"), f" = {t} is outside the vocabulary [0, {limits.vocab_size})"
            )
    listed = [(f"stop_token_ids[{i}]", t) for i, t in enumerate(sampling.stop_token_ids or ())]
    listed += [
        (f"allowed_token_ids[{i}]", t) for i, t in enumerate(sampling.allowed_token_ids or ())
    ]
    listed += [(f"logit_bias.{t}", t) for t in sampling.logit_bias or ()]
    for i, ids in enumerate(sampling.bad_words_token_ids or ()):
        listed += [(f"bad_words[{i}]", t) for t in ids]
    for field, t in listed:
        if not 0 <= t < limits.vocab_size:
            raise FieldError(
                name(field), f" = {t} is outside the vocabulary [0, {limits.vocab_size})"
            )
    n, m = len(ids), sampling.max_tokens
    # The last sampled token is never computed: at most n + m - 1 tokens hold K/V.
    pages = -(-(n + m - 1) // limits.page_size)
    if n + 1 > limits.max_model_len:
        raise FieldError(
            prompt,
            f": prompt of {n} tokens leaves no room to generate within max_model_len="
            f"{limits.max_model_len}; shorten the {prompt}",
        )
    if -(-n // limits.page_size) > limits.num_pages:
        raise FieldError(
            prompt,
            f": prompt of {n} tokens needs {-(-n // limits.page_size)} KV-cache pages, the cache "
            f"has {limits.num_pages}; shorten the {prompt}",
        )
    if n + m > limits.max_model_len:
        raise FieldError(
            max_tokens,
            f": prompt of {n} tokens + max_tokens={m} exceeds max_model_len="
            f"{limits.max_model_len}; reduce {max_tokens} to at most "
            f"{limits.max_model_len - n} or shorten the {prompt}",
        )
    if pages > limits.num_pages:
        room = limits.num_pages * limits.page_size - n + 1
        raise FieldError(
            max_tokens,
            f": prompt of {n} tokens + max_tokens={m} needs {pages} KV-cache pages, the cache "
            f"has {limits.num_pages}; reduce {max_tokens} to at most {room} or shorten "
            f"the {prompt}",
        )
    if grammar and sampling.structured_outputs is not None:
        from jaxinfer import structured  # numpy only; grammar compilers load on first use

        try:
            structured.validate(sampling.structured_outputs)
        except FieldError:
            raise
        except ValueError as e:  # "structured_outputs.<kind> is invalid: ..."
            message = str(e)
            ours = message.partition(" ")[0].rstrip(":")
            if not ours.startswith("structured_outputs"):
                raise FieldError(name("structured_outputs"), f": {message}") from None
            raise FieldError(name(ours), message[len(ours) :]) from None
