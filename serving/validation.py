"""Request validation for both protocols: every field's bounds, and each refusal naming the field
in the protocol's own spelling. No I/O, no JAX.

Where each check lives (one rule in one place):
1. Types and ranges that need no model: `SamplingParams.__post_init__` and
   `StructuredOutputsParams` (`jaxinfer.sampling_params`): integers within the engine's int32
   columns (`top_k`, `max_tokens`, `min_tokens`, `n`, stop ids), `seed` in [0, 2**63), floats
   finite and within float32, `logprobs` <= MAX_LOGPROBS, stop lists capped. They raise
   `FieldError` with this package's field name; each protocol converter (`protocol.py`,
   `openai_protocol.py`) builds them and turns the error into `InvalidArgument` with
   `Fields.error`.
2. What needs the model: `check_request` (called by `FrontEnd.submit`, both protocols, after
   `SamplingParams.prepare_prompt` truncated the prompt and tokenized `bad_words`): the
   priority within int64 (and zero unless `--scheduling-policy priority`), `cache_salt`'s
   length, then `jaxinfer.engine.limits.check_prompt` (prompt ids and stop ids
   within the vocabulary, the prompt and max_tokens within the context and the KV cache, the
   structured-output constraint compiles), `n` within what the server admits at once, features
   that need a tokenizer. `top_k` larger than the vocabulary keeps every token (the sampler's
   rule, as in vLLM): it is accepted, never clamped into an error.
3. HTTP only, on the parsed JSON body before the pydantic models: `bad_text` finds a string (or
   key) holding a lone surrogate, which JSON's `\\ud800` escapes allow but UTF-8 cannot carry
   (gRPC's protobuf refuses invalid UTF-8 at parse time: `protocol.parse`);
   `chat_template_kwargs` refuses the names the server sets itself.
4. `Fields` spells a field as the protocol does: `HTTP` ("top_k", "max_completion_tokens",
   "response_format.json_schema.schema", "messages") or `GRPC` ("sampling.top_k",
   "sampling.structured_outputs.json_schema", "token_ids.ids"). Every refusal is
   `InvalidArgument(message, field=...)`: HTTP puts the field in the error object's `param`,
   gRPC answers INVALID_ARGUMENT with the message (which starts with the field).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxinfer.engine.limits import EngineLimits, check_prompt
from jaxinfer.sampling_params import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_LIMIT,
    FieldError,
    SamplingParams,
)
from serving.errors import InvalidArgument

__all__ = [
    "FLOAT32_MAX",
    "GRPC",
    "HTTP",
    "INT32_MAX",
    "MAX_LOGPROBS",
    "MAX_CACHE_SALT_CHARS",
    "MAX_REQUEST_ID_LEN",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RESERVED_TEMPLATE_KWARGS",
    "SEED_LIMIT",
    "Fields",
    "bad_text",
    "chat_template_kwargs",
    "check_request",
]

PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # int64, as the engine-core wire packs it
MAX_REQUEST_ID_LEN = 256  # characters of a gRPC request_id
MAX_CACHE_SALT_CHARS = 256  # characters of a cache_salt
# Chat-template variables the server sets itself (`messages`) or takes from its own field.
RESERVED_TEMPLATE_KWARGS = ("messages",)


@dataclasses.dataclass(frozen=True)
class Fields:
    """How one protocol spells a request's fields.

    `self(name)` maps this package's name of a field ("top_k", "stop_token_ids[2]",
    "structured_outputs.json", "prompt[3]") to the protocol's: the first of `renames` (ours,
    theirs) whose `ours` is the name or a dotted / indexed prefix of it, else `prefix` + name.
    "prompt" is `prompt` (the input field the request used), "priority" stays "priority".
    """

    prompt: str = "prompt"
    prefix: str = ""  # before a sampling field's name ("sampling." on gRPC)
    renames: tuple[tuple[str, str], ...] = ()

    def __call__(self, name: str) -> str:
        for ours, theirs in (*self.renames, ("prompt", self.prompt), ("priority", "priority")):
            if name == ours or name.startswith((ours + ".", ours + "[")):
                return theirs + name[len(ours) :]
        return self.prefix + name

    def with_(self, prompt: str | None = None, renames: tuple[tuple[str, str], ...] = ()) -> Fields:
        """A copy naming the prompt `prompt` and renaming more fields (`renames` come first)."""
        return dataclasses.replace(
            self, prompt=prompt or self.prompt, renames=renames + self.renames
        )

    def error(self, e: FieldError) -> InvalidArgument:
        """`e` (this package's spelling) as the protocol's InvalidArgument."""
        name = self(e.field)
        return InvalidArgument(f"{name}{e.why}", field=name)


HTTP = Fields()
GRPC = Fields(
    prefix="sampling.",
    renames=(
        ("truncate_prompt_tokens", "truncate_prompt_tokens"),  # GenerateRequest's own field
        ("skip_special_tokens", "sampling.keep_special_tokens"),
        ("structured_outputs.json", "sampling.structured_outputs.json_schema"),
        ("structured_outputs.choice", "sampling.structured_outputs.choice.choices"),
    ),
)


def check_request(
    ids: Sequence[int],
    sp: SamplingParams,
    priority: int,
    limits: EngineLimits,
    fields: Fields,
    *,
    has_tokenizer: bool,
    max_in_flight: int,
    priority_scheduling: bool = True,
    cache_salt: str | None = None,
) -> None:
    """The front end's check of a tokenized request against the engine (see the module
    docstring, step 2). Raises InvalidArgument naming the field as `fields` spells it.
    `priority_scheduling`: the server runs `--scheduling-policy priority` (else a non-zero
    priority is refused, as vLLM does)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument(f"{fields('priority')} must be an integer", fields("priority"))
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidArgument(
            f"{fields('priority')} must be in [-2**63, 2**63), got {priority}", fields("priority")
        )
    if priority and not priority_scheduling:
        raise InvalidArgument(
            f"{fields('priority')}={priority}: priority scheduling is off (the server runs "
            f"--scheduling-policy fcfs; start it with --scheduling-policy priority)",
            fields("priority"),
        )
    if cache_salt is not None and (
        not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS
    ):
        raise InvalidArgument(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    if not has_tokenizer and sp.stop:
        name = fields("stop")
        raise InvalidArgument(
            f"{name}: stop strings need a tokenizer and the server runs with "
            f"--skip-tokenizer-init; use stop_token_ids",
            field=name,
        )
    if not has_tokenizer and sp.structured_outputs is not None:
        name = fields("structured_outputs")
        raise InvalidArgument(
            f"{name}: grammars are compiled against the vocabulary and the server runs with "
            f"--skip-tokenizer-init (no tokenizer)",
            field=name,
        )
    try:
        check_prompt(ids, sp, limits, name=fields)
    except FieldError as e:  # named by `fields` already
        raise InvalidArgument(str(e), field=e.field) from None
    if sp.n > max_in_flight:
        name = fields("n")
        raise InvalidArgument(
            f"{name}={sp.n} exceeds what the server admits at once ({max_in_flight} sequences: "
            f"max_num_seqs + max_queue)",
            field=name,
        )


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_text(value: Any, path: str = "") -> str | None:
    """The path ("messages[0].content", "stop[1]") of the first string or object key in a parsed
    JSON value that is not valid Unicode text (a lone surrogate), or None. Iterative: any depth."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not _utf8(v):
                return where or "body"
        elif isinstance(v, dict):
            items = []
            for k, x in v.items():
                key = f"{where}.{_printable(k)}" if where else _printable(k)
                if isinstance(k, str) and not _utf8(k):
                    return key
                items.append((key, x))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{where}[{i}]", x) for i, x in enumerate(v)]))
    return None


def chat_template_kwargs(kwargs: Mapping[str, Any] | None, field: str) -> dict[str, Any]:
    """The extra chat-template variables of a request (InvalidArgument naming `field.<key>` for
    a name the server sets itself or an `add_generation_prompt` that is not a boolean)."""
    out = dict(kwargs or {})
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in out:
            raise InvalidArgument(
                f"{field}.{key} is set by the server and cannot be passed to the chat template",
                field=f"{field}.{key}",
            )
    if not isinstance(out.get("add_generation_prompt", True), bool):
        raise InvalidArgument(
            f"{field}.add_generation_prompt must be a boolean",
            field=f"{field}.add_generation_prompt",
        )
    return out
