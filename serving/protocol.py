"""Translation between the `jaxinfer.v1` protos and the engine's Python types, with validation.

1. `parse(cls, data)` turns request bytes into a message. Handlers receive raw bytes (see
   `server.py`) because protobuf refuses a string field holding invalid UTF-8 at parse time
   (`DecodeError: String field had bad UTF-8`), before any handler runs; gRPC would answer that
   with a generic error. Parsing here maps it to `InvalidArgument` naming the field
   (`utf8_error_path` walks the wire format to find it).
2. `sampling_params(proto)` builds `SamplingParams` (with its `structured_outputs`): its
   `FieldError` becomes InvalidArgument with the proto field path (`validation.GRPC`:
   "sampling.top_p must be in (0, 1], got 0.0"). The checks against the model are the front
   end's (`FrontEnd.submit` -> `validation.check_request`).
3. `prompt_input(request)` is whichever input is set (a text, token ids or chat messages) with
   its field name; the front end tokenizes it and checks it (`FrontEnd.submit`).
4. `response(delta, ...)` / `merge(...)` build `GenerateResponse`s from `RequestDelta`s.

NOTE: a Python client cannot even build a bad-UTF-8 request (setting such a string raises), but
clients in other languages and hand-made bytes can; the server answers INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message

from jaxinfer.engine.output import RequestDelta
from jaxinfer.engine.types import TokenLogprobs
from jaxinfer.sampling_params import FieldError, SamplingParams, StructuredOutputsParams
from serving.errors import InvalidArgument
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.validation import GRPC

FINISH_REASONS = {
    "stop": pb.GenerateResponse.STOP,
    "length": pb.GenerateResponse.LENGTH,
    "abort": pb.GenerateResponse.ABORTED,
}

# Proto field -> SamplingParams field, for the optional scalars (unset: the dataclass default).
_OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logprobs",
    "n",
    "min_tokens",
    "prompt_logprobs",
)


def parse(cls: type[_message.Message], data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except _message.DecodeError as e:
        path = utf8_error_path(cls.DESCRIPTOR, data)
        if path is not None:
            raise InvalidArgument(f"{path} is not valid UTF-8") from None
        raise InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}") from None


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def utf8_error_path(desc: _descriptor.Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path ("sampling.stop[1]") of the first string field holding invalid UTF-8, or None."""
    counts: dict[str, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                size, i = _varint(data, i)
                chunk, i = data[i : i + size], i + size
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated and not (
                    field.message_type and field.message_type.GetOptions().map_entry
                ):
                    name += f"[{counts.get(field.name, 0)}]"
                    counts[field.name] = counts.get(field.name, 0) + 1
                if field.type == _descriptor.FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == _descriptor.FieldDescriptor.TYPE_MESSAGE:
                    found = utf8_error_path(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:
                return None
    except ValueError:
        return None
    return None


def sampling_params(sp: pb.SamplingParams, req: pb.GenerateRequest | None = None) -> SamplingParams:
    """The request's `SamplingParams` (InvalidArgument naming the proto field: "sampling.top_p
    must be in (0, 1], got 0.0"); `req`: its request, for `truncate_prompt_tokens`."""
    kwargs: dict[str, Any] = {f: getattr(sp, f) for f in _OPTIONAL_SAMPLING if sp.HasField(f)}
    kwargs["stop"] = list(sp.stop) or None
    kwargs["stop_token_ids"] = list(sp.stop_token_ids) or None
    kwargs["ignore_eos"] = sp.ignore_eos
    kwargs["logit_bias"] = dict(sp.logit_bias) or None
    kwargs["allowed_token_ids"] = list(sp.allowed_token_ids) or None
    kwargs["bad_words"] = list(sp.bad_words) or None
    kwargs["include_stop_str_in_output"] = sp.include_stop_str_in_output
    kwargs["skip_special_tokens"] = not sp.keep_special_tokens
    if req is not None and req.HasField("truncate_prompt_tokens"):
        kwargs["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    try:
        if sp.HasField("structured_outputs"):
            kwargs["structured_outputs"] = structured_outputs(sp.structured_outputs)
        return SamplingParams(**kwargs)
    except FieldError as e:
        raise GRPC.error(e) from None


def structured_outputs(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    """`StructuredOutputsParams` of the proto (FieldError naming the field when none is set)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise FieldError(
            "structured_outputs",
            ": one of json_schema, regex, choice, grammar, json_object must be set",
        )
    if kind == "json_schema":
        return StructuredOutputsParams(json=so.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(so.choice.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=so.json_object)
    return StructuredOutputsParams(**{kind: getattr(so, kind)})


def _chat(messages: pb.ChatMessages, field: str) -> list[dict[str, str]]:
    if not messages.messages:
        raise InvalidArgument(f"{field}.messages is empty")
    out = []
    for i, m in enumerate(messages.messages):
        if not m.role:
            raise InvalidArgument(f"{field}.messages[{i}].role is empty")
        out.append({"role": m.role, "content": m.content})
    return out


def prompt_input(req: Any) -> tuple[str, str | list[int] | list[dict[str, str]]]:
    """(field, value) of a GenerateRequest's or TokenizeRequest's `input` oneof: the text
    ("prompt" / "text"), the token ids ("token_ids.ids") or the chat messages ("messages")."""
    which = req.WhichOneof("input")
    text_field = "prompt" if isinstance(req, pb.GenerateRequest) else "text"
    if which is None:
        fields = "prompt, token_ids or messages" if text_field == "prompt" else "text or messages"
        raise InvalidArgument(f"input: one of {fields} must be set")
    if which == text_field:
        return text_field, getattr(req, text_field)
    if which == "token_ids":
        return "token_ids.ids", list(req.token_ids.ids)
    return "messages", _chat(req.messages, "messages")


def _logprob(lp: TokenLogprobs | None) -> pb.TokenLogprob:
    if lp is None:
        return pb.TokenLogprob()
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top],
    )


def response(delta: RequestDelta, request_id: str) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id, index=delta.index, token_ids=delta.new_token_ids, text=delta.new_text
    )
    if delta.logprobs:
        msg.logprobs.extend(_logprob(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob(lp) for lp in delta.prompt_logprobs[1:])
    if delta.finished:
        msg.finish_reason = FINISH_REASONS[delta.finish_reason or "abort"]
        if delta.usage is not None:
            u = delta.usage
            msg.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                    cached_prompt_tokens=u.cached_prompt_tokens,
                )
            )
    return msg


def merge(total: pb.GenerateResponse, part: pb.GenerateResponse) -> None:
    """Appends one streamed message of a sample to the accumulated whole (GenerateOnce)."""
    total.token_ids.extend(part.token_ids)
    total.text += part.text
    total.reasoning_text += part.reasoning_text
    total.logprobs.extend(part.logprobs)
    total.prompt_logprobs.extend(part.prompt_logprobs)
    if part.finish_reason:
        total.finish_reason = part.finish_reason
    if part.HasField("usage"):
        total.usage.CopyFrom(part.usage)
