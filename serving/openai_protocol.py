"""The OpenAI-compatible HTTP API's request and response shapes (pydantic), and their translation
to and from the engine's types. No I/O here: `http_server.py` serves these.

1. `CompletionRequest` / `ChatCompletionRequest` parse a request body (pydantic; a bad type is
   a 400 naming the field). Fields of the OpenAI API we do not implement (`echo`, `suffix`,
   `logit_bias`, `tools`, ...) are refused when set, never silently ignored; vLLM's extras
   (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
   `priority`, `structured_outputs`) are accepted, and so is `response_format` (`json_object`,
   `json_schema`): structured output (`jaxinfer.structured`). Chat's `tools`, `tool_choice`,
   `parallel_tool_calls` and the reasoning split are `serving.chat`'s.
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
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class StreamOptions(BaseModel):
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
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

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
    user: str | None = None
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

    def unsupported(self) -> list[str]:
        """Names of set fields this server does not implement."""
        return ["logit_bias"] if self.logit_bias else []


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.echo:
            out.append("echo")
        if self.suffix:
            out.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            out.append("best_of (other than n)")
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

    def chat(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (text parts joined)."""
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
) -> SamplingParams:
    """The request's `SamplingParams` (InvalidArgument naming the API field as `names` does);
    `structured` replaces the request's own constraint unless False (chat's tool choice)."""
    kwargs: dict[str, Any] = dict(
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


def structured_outputs(req: _Request) -> StructuredOutputsParams | None:
    """The request's constraint: `response_format` (json_object / json_schema) or vLLM's
    `structured_outputs` extra (json / regex / choice / grammar / json_object)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text":
        if so is not None:
            raise InvalidArgument(
                "response_format and structured_outputs are both set; give one",
                "structured_outputs",
            )
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
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text = _token(tokenizer, lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append(
            {_token(tokenizer, i): v for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


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
