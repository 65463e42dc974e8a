"""`SamplingParams`: what a request asks of the sampler and the stop logic (host-side, no JAX)."""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_LOGPROBS = 20  # most top-k logprobs a request may ask for (one static width for every program)


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a formal language; exactly one field is set.

    `json`: a JSON schema (dict or its JSON text); `json_object`: any JSON object; `regex`: a
    regular expression the whole output matches; `choice`: the output is one of these strings;
    `grammar`: a Lark grammar (llguidance's dialect) or a GBNF / EBNF grammar (`root ::= ...`).
    Whether the schema, regex or grammar compiles is checked by `jaxinfer.structured.validate`.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        set_ = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object or its "
                f"text), got {type(self.json).__name__}"
            )
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{field} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling and stopping. Invalid values raise `ValueError` naming the field.

    `temperature=0` is greedy. `top_k=0` and `top_p=1` disable those filters. `seed` makes a
    request's samples reproducible whatever else shares its batch. `logprobs=k` returns, for each
    generated token, the top-k logprobs plus the chosen token's; `prompt_logprobs=k` does the same
    for every prompt position but the first (which is `None`). `structured_outputs` constrains
    the output to a JSON schema, regex, choice or grammar (see `StructuredOutputsParams`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative integer")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(self, field)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                bad(field, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if any(not isinstance(s, str) or not s for s in self.stop):
                bad("stop", "must be a list of non-empty strings")
        if isinstance(self.structured_outputs, dict):  # from the engine-core wire (asdict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
