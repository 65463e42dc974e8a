"""`SamplingParams`: what a request asks of the sampler and the stop logic (host-side, no JAX).

Every field is checked here against what needs no model: types, ranges, and the widths of the
engine's arrays (`top_k`, `max_tokens`, `min_tokens`, `n` and stop ids fit an int32; `seed` is in
[0, 2**63); floats are finite and fit a float32; lists are capped). A bad value raises
`FieldError` (a ValueError) naming the field. The model-aware checks (ids within the vocabulary,
the context length) are `jaxinfer.engine.limits.check_prompt`'s.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

MAX_LOGPROBS = 20  # most top-k logprobs a request may ask for (one static width for every program)
INT32_MAX = 2**31 - 1  # top_k, max_tokens, min_tokens, n, stop ids: int32 columns in the engine
SEED_LIMIT = 2**63  # seeds lie in [0, SEED_LIMIT)
FLOAT32_MAX = 3.4028234663852886e38  # floats are float32 columns in the sampler
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 64  # stop token ids per request
# NOTE: the sampler's logit-bias columns have this fixed width for every row (no recompiles).
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's own cap)
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range)
MAX_BAD_WORDS = 64  # bad_words per request
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids per request (ids past the vocabulary refused)
_OWNER = "SamplingParams."  # how this module's errors name a field ("SamplingParams.top_k")


class FieldError(ValueError):
    """Bad input, naming the field at fault.

    `field` is the field's name in this package's spelling ("top_k", "stop_token_ids[2]",
    "structured_outputs.regex", "prompt"); `why` is the rest of the message, from the character
    after the name (" must be >= 0, got -1"). `str(e)` is `owner + field + why`. A protocol
    renders the same error with its own name for the field (`serving.validation.Fields`).
    """

    def __init__(self, field: str, why: str, *, owner: str = "") -> None:
        super().__init__(f"{owner}{field}{why}")
        self.field, self.why = field, why


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite32(value: Any) -> bool:
    """A real number that a float32 holds as a finite value (NaN and inf are not)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and abs(value) <= FLOAT32_MAX  # False for NaN and inf too
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        def bad(field: str, why: str) -> None:
            raise FieldError(f"structured_outputs.{field}", why)

        set_ = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise FieldError(
                "structured_outputs",
                f" needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {set_ or 'none'}",
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad(
                "json",
                f" must be a JSON schema (an object or its text), got {type(self.json).__name__}",
            )
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                bad(field, " must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            bad("choice", " must be a non-empty list of non-empty strings")


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling and stopping. Invalid values raise `ValueError` naming the field.

    `temperature=0` is greedy. `top_k=0` and `top_p=1` disable those filters. `seed` makes a
    request's samples reproducible whatever else shares its batch. `logprobs=k` returns, for each
    generated token, the top-k logprobs plus the chosen token's; `prompt_logprobs=k` does the same
    for every prompt position but the first (which is `None`). `structured_outputs` constrains
    the output to a JSON schema, regex, choice or grammar (see `StructuredOutputsParams`).

    vLLM's token controls: `logit_bias` ({token id: bias in [-100, 100]}, added to the logits
    after the penalties), `allowed_token_ids` (only these may be sampled), `bad_words` (strings
    whose tokenization may never complete in the output; the front end fills
    `bad_words_token_ids` from them, which is what the engine reads). Text: the stop string that
    ended a sample stays in its text with `include_stop_str_in_output`; `skip_special_tokens`
    drops special tokens from the text; `truncate_prompt_tokens=k` keeps the prompt's last k
    tokens (applied by the front end).
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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise FieldError(field, f" {why}, got {_shown(getattr(self, field))}", owner=_OWNER)

        def integer(field: str, lo: int, hi: int, why: str) -> None:
            value = getattr(self, field)
            if not _int(value) or not lo <= value <= hi:
                bad(field, why)

        def number(field: str, ok: Any, why: str) -> None:
            value = getattr(self, field)
            if not _finite32(value):
                bad(field, "must be a finite number")
            if not ok(value):
                bad(field, why)

        integer("max_tokens", 1, INT32_MAX, f"must be an integer in [1, {INT32_MAX}]")
        number("temperature", lambda t: t >= 0.0, "must be >= 0")
        if self.top_k == -1:  # vLLM's spelling of "off"
            self.top_k = 0
        integer("top_k", 0, INT32_MAX, f"must be an integer in [0, {INT32_MAX}] (0 or -1: off)")
        number("top_p", lambda p: 0.0 < p <= 1.0, "must be in (0, 1]")
        number("min_p", lambda p: 0.0 <= p <= 1.0, "must be in [0, 1]")
        number("repetition_penalty", lambda r: r > 0.0, "must be > 0")
        number("frequency_penalty", lambda f: -2.0 <= f <= 2.0, "must be in [-2, 2]")
        number("presence_penalty", lambda f: -2.0 <= f <= 2.0, "must be in [-2, 2]")
        if self.seed is not None:
            integer("seed", 0, SEED_LIMIT - 1, "must be an integer in [0, 2**63)")
        for field in ("logprobs", "prompt_logprobs"):
            if getattr(self, field) is not None:
                integer(field, 0, MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if _int(self.max_tokens):
            integer("min_tokens", 0, self.max_tokens, "must be an integer in [0, max_tokens]")
        integer("n", 1, INT32_MAX, f"must be an integer in [1, {INT32_MAX}]")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a boolean")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
                bad("stop", f"must be a list of at most {MAX_STOP_STRINGS} strings")
            for i, s in enumerate(self.stop):
                if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                    raise FieldError(
                        f"stop[{i}]",
                        f" must be a non-empty string of at most {MAX_STOP_STRING_CHARS} "
                        f"characters",
                        owner=_OWNER,
                    )
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
                bad("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
            for i, t in enumerate(ids):
                if not _int(t) or not 0 <= t <= INT32_MAX:
                    raise FieldError(
                        f"stop_token_ids[{i}]",
                        f" must be a token id (an integer in [0, {INT32_MAX}]), got {_shown(t)}",
                        owner=_OWNER,
                    )
        self._check_token_controls(bad)
        if isinstance(self.structured_outputs, dict):  # from the engine-core wire (asdict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            bad("structured_outputs", "must be a StructuredOutputsParams")

    def _check_token_controls(self, bad: Any) -> None:
        """logit_bias, allowed_token_ids, bad_words, the text flags, truncate_prompt_tokens."""
        for field in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a boolean")
        if self.spaces_between_special_tokens is not True:
            bad(
                "spaces_between_special_tokens",
                "can only be true (this server's fast tokenizers decode special tokens as they "
                "are)",
            )
        if self.truncate_prompt_tokens is not None and (
            not _int(self.truncate_prompt_tokens)
            or not 1 <= self.truncate_prompt_tokens <= INT32_MAX
        ):
            bad("truncate_prompt_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, v in self.logit_bias.items():
                if not _int(t) or not 0 <= t <= INT32_MAX:
                    raise FieldError(f"logit_bias.{_shown(t)}", " is not a token id", owner=_OWNER)
                if not _finite32(v) or abs(v) > LOGIT_BIAS_LIMIT:
                    raise FieldError(
                        f"logit_bias.{t}",
                        f" must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                        f"got {_shown(v)}",
                        owner=_OWNER,
                    )
        for field, cap in (
            ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
            ("bad_words", MAX_BAD_WORDS),
            ("bad_words_token_ids", MAX_BAD_WORDS),
        ):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, list) or not 0 < len(value) <= cap):
                bad(field, f"must be a non-empty list of at most {cap} entries")
        for i, t in enumerate(self.allowed_token_ids or ()):
            if not _int(t) or not 0 <= t <= INT32_MAX:
                raise FieldError(
                    f"allowed_token_ids[{i}]", f" must be a token id, got {_shown(t)}", owner=_OWNER
                )
        for i, w in enumerate(self.bad_words or ()):
            if not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS:
                raise FieldError(
                    f"bad_words[{i}]",
                    f" must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters",
                    owner=_OWNER,
                )
        for i, ids in enumerate(self.bad_words_token_ids or ()):
            if (
                not isinstance(ids, list)
                or not ids
                or not all(_int(t) and 0 <= t <= INT32_MAX for t in ids)
            ):
                raise FieldError(
                    f"bad_words[{i}]", " must tokenize to a non-empty list of ids", owner=_OWNER
                )

    def prepare_prompt(self, ids: list[int], tokenizer: Any) -> list[int]:
        """What every entry point does before checking a request: the prompt cut to its last
        `truncate_prompt_tokens` ids (returned), `bad_words` tokenized into
        `bad_words_token_ids` (each word alone and after a space, as vLLM does; ValueError
        naming the field without a tokenizer)."""
        if self.truncate_prompt_tokens is not None:
            ids = ids[-self.truncate_prompt_tokens :]
        if self.bad_words:
            if tokenizer is None:
                raise FieldError("bad_words", " need a tokenizer (the model has none loaded)")
            seqs: list[list[int]] = []
            for word in self.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    toks = list(tokenizer.encode(text, add_special_tokens=False))
                    if toks and toks not in seqs:
                        seqs.append(toks)
            self.bad_words_token_ids = seqs
        return ids

    @property
    def masks_tokens(self) -> bool:
        """The engine core masks this request's tokens per step (grammar or token lists)."""
        return (
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
