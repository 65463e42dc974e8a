"""Chat requests' tools and reasoning: what `/v1/chat/completions` adds to plain generation.

1. `ChatOptions` are the server's flags (`--enable-auto-tool-choice`, `--tool-call-parser`,
   `--reasoning-parser`). `plan(req, options)` checks a request's `tools` / `tool_choice` /
   `parallel_tool_calls` (400s naming the field; vLLM's refusal of `auto` without the flags) and
   returns its `ChatPlan`: the messages for the chat template (assistant `tool_calls`, with their
   arguments as objects, and `tool` messages' `tool_call_id` kept), the template variables
   (`tools`, `chat_template_kwargs`), and the constraint on the output.
2. The constraint (`ChatPlan.structured`): a named `tool_choice` constrains the output to the
   function's `parameters` schema; `required` to `[{"name": ..., "parameters": {...}}, ...]` over
   the tools (one item when `parallel_tool_calls` is false; `auto` then keeps the first call the
   model made, as vLLM). Both are generated without free
   whitespace (compact JSON; `x-guidance.whitespace_flexible` false). `auto` is unconstrained and
   parsed by the `--tool-call-parser`; `none` passes the tools to the template and parses
   nothing. With a `--reasoning-parser`, any constraint (these, `response_format`,
   `structured_outputs`) applies to the answer after `</think>` (`reasoning.after_reasoning`);
   a request with `chat_template_kwargs={"enable_thinking": false}` does not think: nothing is
   split off its output and its constraint applies from the first token.
3. `ChatPlan.output()` is one choice's `ChatOutput`: `message(text, finish)` builds a whole
   response's message (`reasoning_content`, `content`, `tool_calls`) and finish reason
   (`tool_calls` when calls were made, `stop` for a named choice, as vLLM); `feed(delta)` /
   `close(finish)` build the streamed deltas (`reasoning_content`, `content`, `tool_calls`
   entries with `index`, id, type, name and arguments; a named call's arguments stream as they
   are generated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

from jaxinfer.sampling_params import FieldError, StructuredOutputsParams
from serving import openai_protocol as oai
from serving.errors import InvalidArgument
from serving.images import image_urls
from serving.reasoning import REASONING_PARSERS, ReasoningParser, after_reasoning
from serving.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolCall, ToolParser

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
COMPACT = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """The server's chat flags (`scripts/serve.py`)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    image_placeholder: str | None = None  # the model's, when it takes images (`serving.images`)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r} is not one of {sorted(TOOL_PARSERS)}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                f"{sorted(REASONING_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclasses.dataclass
class ChatPlan:
    """How one chat request is rendered, constrained and answered (module docstring)."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    mode: str  # none | auto | required | named
    function: str | None  # the named choice's function
    structured: StructuredOutputsParams | None
    renames: tuple[tuple[str, str], ...]
    options: ChatOptions
    thinking: bool  # a reasoning parser splits the output
    parallel: bool = True  # `parallel_tool_calls`: more than one call is kept
    images: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (field, url)

    def output(self) -> ChatOutput:
        return ChatOutput(self)

    @property
    def keep_special_tokens(self) -> bool:
        """`auto` with a parser whose call marker is a special token: the output's text keeps
        special tokens (`skip_special_tokens=False`)."""
        parser = TOOL_PARSERS.get(self.options.tool_call_parser or "")
        return self.mode == "auto" and parser is not None and parser.keeps_special_tokens


def _tools(req: oai.ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """The request's functions by name (400 naming the field of a malformed tool)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools or []):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type must be 'function'", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidArgument(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"{where}.function.name must be a non-empty string", f"{where}.function.name"
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidArgument(
                f"{where}.function.parameters must be a JSON schema object",
                f"{where}.function.parameters",
            )
        out[name] = params
    return out


def _choice(req: oai.ChatCompletionRequest, tools: dict[str, Any]) -> tuple[str, str | None]:
    """(mode, named function) of `tool_choice` (default: auto with tools, else none)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidArgument(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                "tool_choice",
            )
        if choice == "required" and not tools:
            raise InvalidArgument('tool_choice "required" needs tools', "tools")
        return choice, None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidArgument(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in tools:
        raise InvalidArgument(
            f"tool_choice names the function {name!r}, which is not among tools",
            "tool_choice.function.name",
        )
    return "named", name


def _messages(
    req: oai.ChatCompletionRequest, image_placeholder: str | None
) -> list[dict[str, Any]]:
    """The template's messages: assistant `tool_calls` (arguments as objects, as chat templates
    expect) and `tool_call_id` kept."""
    out = req.chat(image_placeholder)
    for i, (msg, m) in enumerate(zip(out, req.messages, strict=True)):
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                call = dict(call)
                fn = call.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    where = f"messages[{i}].tool_calls[{j}].function"
                    raise InvalidArgument(f"{where} must be an object with a name", where)
                fn = dict(fn)
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):  # else the template gets the text
                        fn["arguments"] = json.loads(fn["arguments"])
                call["function"] = fn
                calls.append(call)
            msg["tool_calls"] = calls
    return out


def plan(req: oai.ChatCompletionRequest, options: ChatOptions) -> ChatPlan:
    """Checks a chat request's tool fields and plans its rendering and output (InvalidArgument
    naming the field)."""
    tools = _tools(req)
    mode, function = _choice(req, tools)
    if mode == "auto" and not options.enable_auto_tool_choice:
        raise InvalidArgument(AUTO_NEEDS_FLAGS, "tool_choice")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs.setdefault("tools", req.tools)
    constrained = req.response_format is not None and req.response_format.type != "text"
    if mode in ("required", "named") and (constrained or req.structured_outputs is not None):
        raise InvalidArgument(
            f"tool_choice {mode!r} constrains the output itself: it cannot be combined with "
            f"response_format or structured_outputs",
            "tool_choice",
        )
    origin = {"named": "tool_choice", "required": "tools"}.get(mode)
    if mode == "named":
        schema = {"x-guidance": COMPACT, **tools[function]}
        structured = StructuredOutputsParams(json=json.dumps(schema))
    elif mode == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in tools.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "x-guidance": COMPACT}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        structured = StructuredOutputsParams(json=json.dumps(schema))
    else:
        try:
            structured = oai.structured_outputs(req)
        except FieldError as e:  # e.g. structured_outputs={"json_object": false}: nothing set
            raise oai.fields(req, prompt="messages").error(e) from None
    thinking = options.reasoning_parser is not None and kwargs.get("enable_thinking") is not False
    renames: tuple[tuple[str, str], ...] = ()
    if structured is not None and thinking:
        structured, field = after_reasoning(structured, options.reasoning_parser)
        theirs = origin or oai.fields(req, prompt="messages")(field)
        renames = (("structured_outputs.grammar", theirs),)
    elif origin is not None:
        renames = (("structured_outputs.json", origin),)
    parallel = req.parallel_tool_calls is not False
    images = image_urls(req) if options.image_placeholder is not None else []
    return ChatPlan(
        _messages(req, options.image_placeholder), kwargs, mode, function, structured, renames,
        options, thinking, parallel, images,
    )  # fmt: skip


class ChatOutput:
    """One choice's answer: reasoning split off, tool calls parsed (module docstring, step 3)."""

    def __init__(self, chat_plan: ChatPlan) -> None:
        self.plan = chat_plan
        opts = chat_plan.options
        self.reasoning: ReasoningParser | None = None
        if chat_plan.thinking:
            self.reasoning = REASONING_PARSERS[opts.reasoning_parser]()  # type: ignore[index]
        self.tools: ToolParser | None = None
        if chat_plan.mode == "auto":
            self.tools = TOOL_PARSERS[opts.tool_call_parser]()  # type: ignore[index]
        elif chat_plan.mode == "required":
            self.tools = JsonArrayToolParser()
        self._named: ToolCall | None = None
        self._calls = 0

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's message and finish reason."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.plan.options.reasoning_parser is not None:
            msg["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if self.plan.mode == "named":
            calls = [ToolCall(self.plan.function, (content or "").strip())]  # type: ignore[arg-type]
            msg["content"] = None
        elif self.tools is not None:
            found = self.tools.extract(content or "")
            msg["content"], calls = found.content, found.calls
            calls = calls if self.plan.parallel else calls[:1]
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg, self._finish(finish, bool(calls))

    def _finish(self, finish: str | None, called: bool) -> str | None:
        if finish == "stop" and called and self.plan.mode != "named":
            return "tool_calls"
        return finish

    def feed(self, text: str) -> dict[str, Any]:
        """The streamed delta for `text` (empty when everything is held back)."""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.stream(text)
        else:
            reasoning, content = "", text
        return self._delta(reasoning, content, final=False)

    def close(self, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta (what was held back) and the finish reason."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        delta = self._delta(reasoning, content, final=True)
        return delta, self._finish(finish, self._calls > 0)

    def _delta(self, reasoning: str, content: str, *, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[dict[str, Any]] = []
        if self.plan.mode == "named":
            if self._named is None and (content or final):
                self._named = ToolCall(self.plan.function, "")  # type: ignore[arg-type]
                calls.append(self._named.to_openai(0))
                self._calls = 1
            if content:
                calls.append({"index": 0, "function": {"arguments": content}})
            content = ""
        elif self.tools is not None:
            content, new = self.tools.stream(content)
            if final:
                more_content, more = self.tools.finish()
                content, new = content + more_content, new + more
            for call in new:
                if self._calls and not self.plan.parallel:
                    break
                calls.append(call.to_openai(self._calls))
                self._calls += 1
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two streamed deltas as one (texts joined, tool-call entries in order)."""
    out = dict(first)
    for key, value in second.items():
        out[key] = out[key] + value if key in out else value
    return out
