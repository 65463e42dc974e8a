"""The OpenAI-compatible HTTP API's request and response shapes (pydantic), and their translation
to and from the engine's types. No I/O here: `http_server.py` serves these.

1. `CompletionRequest` / `ChatCompletionRequest` parse a request body (pydantic; a bad type is
   a 400 naming the field). Every field is honoured or refused, never silently ignored: a field
   no model declares is a 400 naming it (as OpenAI's own API answers; not vLLM's lenient
   warning: a misspelt `max_token` would otherwise run unbounded and look fine); declared
   fields we do not implement (`suffix`, `use_beam_search`, ... : `REFUSED`) are refused when
   set to anything but their no-op value. vLLM's extras are honoured: sampling (`top_k`,
   `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `logit_bias`,
   `allowed_token_ids`, `bad_words`), text (`include_stop_str_in_output`, `skip_special_tokens`,
   `return_tokens_as_token_ids`), prompts (`truncate_prompt_tokens`, `prompt_logprobs`,
   completions' `echo`, `add_special_tokens`), `priority`, `cache_salt`, `structured_outputs`
   and the legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and
   `response_format` (`json_object`, `json_schema`): structured output (`jaxinfer.structured`).
   Chat's `tools`, `tool_choice`, `parallel_tool_calls` and the reasoning split are
   `serving.chat`'s.
2. `fields(req, prompt=..., max_tokens=...)` is how this request's fields are named in errors
   (`validation.Fields`: the prompt field, `max_completion_tokens`, chat's `top_logprobs`,
   `response_format` for a constraint set there); `sampling_params(req, fields, max_tokens,
   logprobs)` builds `SamplingParams`, its FieldError becoming InvalidArgument naming the API
   field ("top_p must be in (0, 1], got 0.0", param "top_p"). A JSON schema travels to the
   engine core as its JSON text (whatever numbers it holds).
3. `completion_logprobs` / `chat_logprobs` render `TokenLogprobs` the way each endpoint does;
   `usage` renders the token counts (prompt counted once per prompt, completions summed).
4. `error_body(status, message, param)` is the OpenAI error object every failure answers with.

NOTE: `max_tokens` left unset on chat means "up to the context length" (as in vLLM); on
completions it is 16 (the OpenAI default).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.engine.output import Usage
from jaxinfer.engine.types import TokenLogprobs
from jaxinfer.sampling_params import FieldError, SamplingParams, StructuredOutputsParams
from jaxinfer.tokenizer import Tokenizer
from serving.errors import InvalidArgument
from serving.validation import HTTP, Fields

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. vLLM's continuous_usage_stats: refused

    include_usage: bool = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Declared fields this server refuses unless they hold their no-op value: name -> (is it a
# no-op?, why it is refused).
REFUSED: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: not v, "is not supported (no fill-in-the-middle)"),
    "use_beam_search": (lambda v: not v, "is not supported (no beam search)"),
    "length_penalty": (lambda v: v in (None, 1.0), "only applies to beam search (not supported)"),
    "logits_processors": (lambda v: not v, "is not supported (no custom logits processors)"),
    "prompt_embeds": (lambda v: v is None, "is not supported"),
    "kv_transfer_params": (lambda v: v is None, "is not supported (no disaggregated prefill)"),
    "vllm_xargs": (lambda v: not v, "is not supported"),
    "return_token_ids": (lambda v: not v, "is not supported; use logprobs"),
    "guided_whitespace_pattern": (lambda v: v is None, "is not supported"),
    "guided_decoding_backend": (
        lambda v: v in (None, "auto", "guidance", "llguidance"),
        "must be guidance (llguidance is this server's only grammar backend)",
    ),
    "store": (lambda v: not v, "is not supported (this server stores no completions)"),
    "modalities": (lambda v: v in (None, ["text"]), "only text is supported"),
    "audio": (lambda v: v is None, "is not supported"),
    "prediction": (lambda v: v is None, "is not supported (no predicted outputs)"),
    "web_search_options": (lambda v: v is None, "is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "is not supported"),
    "functions": (lambda v: not v, "is deprecated and not supported; use tools"),
    "function_call": (lambda v: v in (None, "none"), "is deprecated and not supported"),
    "continue_final_message": (lambda v: not v, "is not supported"),
    "documents": (lambda v: not v, "is not supported"),
    "chat_template": (lambda v: v is None, "is not supported (the checkpoint's template is used)"),
    "mm_processor_kwargs": (lambda v: not v, "is not supported (text-only models)"),
}


class _Request(BaseModel):
    """Fields both endpoints share."""

    # NOTE: an undeclared field is a 400 naming it (`http_errors.validation_error`).
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted, recorded nowhere (as OpenAI: for abuse monitoring)
    metadata: dict[str, str] | None = None  # accepted, stored nowhere
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    priority: int = 0
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    request_id: str | None = None  # vLLM's: the response's id
    add_special_tokens: bool | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # refused unless at their no-op value (`REFUSED`)
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    return_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    store: Any = None
    service_tier: Any = None

    def unsupported(self) -> list[str]:
        """ "field why" of each set field this server refuses (`REFUSED`)."""
        out = []
        for name in type(self).model_fields:
            rule = REFUSED.get(name)
            if rule is not None and not rule[0](getattr(self, name)):
                out.append(f"{name} {rule[1]}")
        return out

    def guided(self) -> StructuredOutputsRequest | None:
        """vLLM's legacy `guided_*` fields as the `structured_outputs` they stand for."""
        set_ = {
            k: getattr(self, f"guided_{k}")
            for k in ("json", "regex", "choice", "grammar")
            if getattr(self, f"guided_{k}") is not None
        }
        if not set_:
            return None
        return StructuredOutputsRequest.model_validate(set_)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            out.append("best_of other than n is not supported")
        return out

    def prompts(self) -> list[tuple[str, str | list[int]]]:
        """The prompts of the request, each (its field: "prompt", or "prompt[i]" in a batch; a
        text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [("prompt", p)]
        if not p:
            raise InvalidArgument("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [("prompt", list(p))]  # type: ignore[arg-type]
        return [(f"prompt[{i}]", x) for i, x in enumerate(p)]  # type: ignore[misc]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: Any = None  # {"url": "data:image/png;base64,..."} (`serving.images`)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (`serving.chat`)
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # checked by `serving.chat.plan`
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    # refused unless at their no-op value (`REFUSED`)
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.echo:
            out.append("echo is not supported on chat completions (only on completions)")
        if self.prompt_logprobs is not None and self.stream:
            out.append("prompt_logprobs is not supported on streamed chat completions")
        return out

    def chat(self, image_placeholder: str | None = None) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (text parts joined; an image part
        becomes `image_placeholder` when the model takes images, see `serving.images`)."""
        if not self.messages:
            raise InvalidArgument("messages is empty", "messages")
        out = []
        for i, m in enumerate(self.messages):
            if not m.role:
                raise InvalidArgument(f"messages[{i}].role is empty", f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type == "image_url" and image_placeholder is not None:
                        texts.append(image_placeholder)
                        continue
                    if part.type != "text" or part.text is None:
                        raise InvalidArgument(
                            f"messages[{i}].content[{j}]: only text parts are "
                            f"supported, got type {part.type!r}",
                            f"messages[{i}].content[{j}]",
                        )
                    texts.append(part.text)
                content = "".join(texts)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


def fields(req: _Request, *, prompt: str, max_tokens: str = "max_tokens") -> Fields:
    """How this request's fields are named in its errors (`validation.Fields`): `prompt` is the
    prompt field ("prompt", "prompt[1]", "messages"), `max_tokens` the field that set the output
    budget ("max_tokens", "max_completion_tokens")."""
    renames = [("max_tokens", max_tokens)]
    if isinstance(req, ChatCompletionRequest):
        renames.append(("logprobs", "top_logprobs"))
    guided = [k for k in ("json", "regex", "choice", "grammar") if getattr(req, f"guided_{k}")]
    renames += [(f"structured_outputs.{k}", f"guided_{k}") for k in guided]
    if guided:
        renames.append(("structured_outputs", f"guided_{guided[0]}"))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        renames.append(("structured_outputs.json", "response_format.json_schema.schema"))
    if fmt is not None and fmt.type != "text":
        renames.append(("structured_outputs.json_object", "response_format"))
        renames.append(("structured_outputs", "response_format"))
    return HTTP.with_(prompt=prompt, renames=tuple(renames))


def sampling_params(
    req: _Request,
    names: Fields,
    *,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredOutputsParams | None | Literal[False] = False,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's `SamplingParams` (InvalidArgument naming the API field as `names` does);
    `structured` replaces the request's own constraint unless False (chat's tool choice)."""
    kwargs: dict[str, Any] = dict(
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        prompt_logprobs=prompt_logprobs,
        max_tokens=max_tokens,
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else (req.stop or None),
        stop_token_ids=req.stop_token_ids or None,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        kwargs["structured_outputs"] = (
            structured_outputs(req) if structured is False else structured
        )
        return SamplingParams(**kwargs)
    except FieldError as e:
        raise names.error(e) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON keys) with int keys."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidArgument(
                f"logit_bias.{key} is not a token id (keys are token ids)", f"logit_bias.{key}"
            ) from None
    return out


def structured_outputs(req: _Request) -> StructuredOutputsParams | None:
    """The request's constraint: `response_format` (json_object / json_schema), vLLM's
    `structured_outputs` extra (json / regex / choice / grammar / json_object) or its legacy
    `guided_*` fields (one of them)."""
    fmt, so, guided = req.response_format, req.structured_outputs, req.guided()
    given = [
        name
        for name, v in (
            ("response_format", fmt if fmt is not None and fmt.type != "text" else None),
            ("structured_outputs", so),
            (
                next(
                    (
                        f"guided_{k}"
                        for k in ("json", "regex", "choice", "grammar")
                        if getattr(req, f"guided_{k}") is not None
                    ),
                    "guided_json",
                ),
                guided,
            ),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise InvalidArgument(
            f"{' and '.join(given)} are all constraints on the output; give one", given[-1]
        )
    so = so or guided
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidArgument(
                "response_format.json_schema.schema is required when "
                "response_format.type is json_schema",
                "response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=_json_text(fmt.json_schema.schema_))
    if so is None:
        return None
    return StructuredOutputsParams(
        json=_json_text(so.json_),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=bool(so.json_object),
    )


def _json_text(schema: dict[str, Any] | str | None) -> str | None:
    """A schema as JSON text: what the engine-core wire carries whatever numbers it holds (an
    int beyond 64 bits would not pack)."""
    if not isinstance(schema, dict):
        return schema
    try:
        return json.dumps(schema)
    except (ValueError, RecursionError) as e:
        raise FieldError("structured_outputs.json", f" is not a JSON schema: {e}") from None


def _token(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.token_text(token_id)


def chat_logprobs(tokenizer: Tokenizer | None, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` entries of a chat completion."""
    out = []
    for lp in lps:
        text = _token(tokenizer, lp.token_id)
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        out.append(
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := _token(tokenizer, i)), "logprob": v, "bytes": list(t.encode())}
                    for i, v in top
                ],
            }
        )
    return out


def completion_logprobs(
    tokenizer: Tokenizer | None, lps: list[TokenLogprobs], offset: int
) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion; text offsets start at `offset`."""
    return _logprob_columns(tokenizer, [(lp.token_id, lp) for lp in lps], offset)


def echo_logprobs(
    tokenizer: Tokenizer | None, prompt_ids: list[int], lps: list[TokenLogprobs | None]
) -> dict[str, Any]:
    """`choices[i].logprobs` of an echoed prompt (`echo` with `logprobs`): the first token has
    no logprob (None, as in vLLM and OpenAI); the others' come from the engine's prompt
    logprobs. Text offsets start at 0."""
    entries = [(t, lps[i] if i < len(lps) else None) for i, t in enumerate(prompt_ids)]
    return _logprob_columns(tokenizer, entries, 0)


def _logprob_columns(
    tokenizer: Tokenizer | None,
    entries: list[tuple[int, TokenLogprobs | None]],
    offset: int,
) -> dict[str, Any]:
    """The completions API's column-wise logprobs of (token id, its logprobs or None) entries."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        text = _token(tokenizer, token_id)
        tokens.append(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(
            None
            if lp is None
            else {_token(tokenizer, i): v for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def joined_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two `completion_logprobs` one after the other (an echoed prompt, then the output)."""
    if tail is None:
        return head
    return {k: head[k] + tail[k] for k in head}


def prompt_logprobs(
    tokenizer: Tokenizer | None, lps: list[TokenLogprobs | None] | None
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt position None (the first) or {token id:
    {"logprob", "decoded_token"}} holding the prompt token and the top-k."""
    if lps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entries = {lp.token_id: lp.logprob, **lp.top}
        out.append(
            {
                str(t): {"logprob": v, "decoded_token": _token(tokenizer, t)}
                for t, v in entries.items()
            }
        )
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sum_usage(per_prompt: list[list[Usage | None]]) -> dict[str, Any]:
    """Usage of a request: each prompt counted once, every sample's completion tokens summed."""
    prompt = completion = cached = 0
    for samples in per_prompt:
        done = [u for u in samples if u is not None]
        if done:
            prompt += done[0].prompt_tokens
            cached += done[0].cached_prompt_tokens
        completion += sum(u.completion_tokens for u in done)
    return usage(prompt, completion, cached)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }


def prompt_logprobs_width(req: Any, chat: bool) -> int | None:
    """SamplingParams.prompt_logprobs of a request: vLLM's `prompt_logprobs`, or completions'
    `logprobs` when `echo` returns the prompt with its logprobs (the wider of the two)."""
    widths = [req.prompt_logprobs]
    if not chat and req.echo and req.logprobs is not None:
        widths.append(req.logprobs)
    given = [w for w in widths if w is not None]
    return max(given) if given else None


def logprobs_width(req: Any, chat: bool) -> int | None:
    """SamplingParams.logprobs of a request: completions' `logprobs`; chat's `top_logprobs`
    when `logprobs` is true."""
    if not chat:
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None
