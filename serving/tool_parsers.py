"""Tool-call parsers: a model's own tool-call format in its text, as OpenAI `tool_calls`.

`--tool-call-parser NAME` with `--enable-auto-tool-choice` picks one (vLLM's names); it reads the
answer of a chat request whose `tool_choice` is `auto` (the reasoning part, if a reasoning parser
split one off, is never parsed).

1. `TOOL_PARSERS[name]` is the parser class: `hermes` (Qwen / Hermes: `<tool_call>{"name": ...,
   "arguments": {...}}</tool_call>` blocks after optional text), `llama3_json` (Llama 3.x: the
   answer is `{"name": ..., "parameters": {...}}` objects separated by `;`, optionally after
   `<|python_tag|>`), `mistral` (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after
   optional text).
2. `parser.extract(text)` -> `Extracted(content, calls)`: the text outside the calls (None when
   it is empty) and each call as `ToolCall(name, arguments)` (arguments: JSON text). Text that
   looks like a call but does not parse stays content: nothing is lost.
3. Streaming, `parser.stream(delta)` -> `(content delta, calls completed by this delta)`: text
   before the format's start marker streams as content at once; from the marker on, text is
   held until a call is complete (each call is sent whole: its id, name and arguments in one
   `tool_calls` delta); `parser.finish()` returns what is left (held text that never became a
   call is content then).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as a `tool_calls` entry (with `index` in a streamed delta)."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(
            id=self.id, type="function", function={"name": self.name, "arguments": self.arguments}
        )
        return out


@dataclasses.dataclass(frozen=True)
class Extracted:
    content: str | None
    calls: list[ToolCall]


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A parsed `{"name": ..., "arguments"|"parameters": {...}}` as a ToolCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of `text` separated by whitespace, `;` or `,` (None if any is not JSON)."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


class ToolParser:
    """Base: `extract` a whole answer; `stream` / `finish` a streamed one (module docstring)."""

    name = ""
    start = ""  # where calls begin; text before it is content
    # NOTE: true where `start` is a special token of the model's tokenizer (Mistral's
    # `[TOOL_CALLS]`, Llama's `<|python_tag|>`): the output must keep special tokens in its text
    # for the parser to see it (vLLM sets skip_special_tokens=False for these parsers too).
    keeps_special_tokens = False

    def __init__(self) -> None:
        self._text = ""  # what was streamed so far
        self._sent = 0  # characters of it sent as content
        self._calls = 0  # calls sent
        self._in_calls = False

    def extract(self, text: str) -> Extracted:
        at = self._start_of_calls(text)
        if at < 0:
            return Extracted(text or None, [])
        calls = self._parse_calls(text[at:], final=True)
        if calls is None or not calls:
            return Extracted(text or None, [])
        return Extracted(text[:at] or None, calls)

    def _start_of_calls(self, text: str) -> int:
        return text.find(self.start)

    def _parse_calls(self, text: str, *, final: bool) -> list[ToolCall] | None:
        """The complete calls of `text` (from the start marker on); None if it does not parse
        (when `final`: as a whole)."""
        raise NotImplementedError

    def stream(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._text += delta
        if not self._in_calls:
            at = self._start_of_calls(self._text)
            if at < 0:
                keep = _partial_suffix(self._text, self._markers())
                out = self._text[self._sent : len(self._text) - keep]
                self._sent += len(out)
                return out, []
            self._in_calls = True
            out = self._text[self._sent : at]
            self._sent = at
            return out, self._new_calls(final=False)
        return "", self._new_calls(final=False)

    def _markers(self) -> tuple[str, ...]:
        return (self.start,)

    def _new_calls(self, *, final: bool) -> list[ToolCall]:
        calls = self._parse_calls(self._text[self._sent :], final=final) or []
        new = calls[self._calls :]
        self._calls = len(calls)
        return new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the stream has ended: held text as content, or the last calls."""
        if not self._in_calls:
            out = self._text[self._sent :]
            self._sent = len(self._text)
            return out, []
        calls = self._parse_calls(self._text[self._sent :], final=True)
        if calls is None or (not calls and not self._calls):
            out = self._text[self._sent :] if not self._calls else ""
            self._sent = len(self._text)
            return out, []
        new = calls[self._calls :]
        self._calls = len(calls)
        return "", new

    @property
    def called(self) -> bool:
        """Some call was sent by `stream` / `finish`."""
        return self._calls > 0


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the start of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks (Qwen, Hermes)."""

    name = "hermes"
    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def _parse_calls(self, text: str, *, final: bool) -> list[ToolCall] | None:
        calls = []
        for m in self._BLOCK.finditer(text):
            body = m.group(1) if m.group(1) is not None else m.group(2)
            if m.group(1) is None and not final:
                break  # still being written
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return None if final else calls
            calls.append(call)
        return calls


class Llama3JsonToolParser(ToolParser):
    """The whole answer is `{"name": "f", "parameters": {...}}` objects (`;`-separated), after
    an optional `<|python_tag|>` (Llama 3.1-3.3's JSON tool calling)."""

    name = "llama3_json"
    keeps_special_tokens = True
    start = "<|python_tag|>"

    def _start_of_calls(self, text: str) -> int:
        stripped = len(text) - len(text.lstrip())
        if text.startswith(self.start, stripped) or text.startswith("{", stripped):
            return 0
        return -1

    def _markers(self) -> tuple[str, ...]:
        return (self.start,)

    def _parse_calls(self, text: str, *, final: bool) -> list[ToolCall] | None:
        body = text.strip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        if final:
            values = _json_values(body)
        else:
            values = _complete_prefix(body)
        if values is None:
            return None
        calls = [_call(v, ("parameters", "arguments")) for v in values]
        if any(c is None for c in calls):
            return None if final else [c for c in calls if c is not None]
        return calls  # type: ignore[return-value]


def _complete_prefix(text: str) -> list[Any]:
    """The JSON values `text` completes so far (the last, unfinished one left out)."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` after optional text (Mistral)."""

    keeps_special_tokens = True
    name = "mistral"
    start = "[TOOL_CALLS]"

    def _parse_calls(self, text: str, *, final: bool) -> list[ToolCall] | None:
        body = text[len(self.start) :].lstrip()
        if not final:  # the complete objects of the array so far
            if not body.startswith("["):
                return []
            values = _complete_prefix(body[1:])
            calls = [_call(v) for v in values if isinstance(v, dict)]
            return [c for c in calls if c is not None]
        values = _json_values(body)
        if values is None or not values:
            return None
        items: list[Any] = []
        for v in values:
            items.extend(v if isinstance(v, list) else [v])
        calls = [_call(v) for v in items]
        if any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]


class JsonArrayToolParser(ToolParser):
    """`[{"name": "f", "parameters": {...}}, ...]`: what `tool_choice="required"` constrains the
    output to (`serving.chat`); not a `--tool-call-parser`."""

    name = "json_array"
    start = "["

    def _parse_calls(self, text: str, *, final: bool) -> list[ToolCall] | None:
        if not final:
            calls = [_call(v) for v in _complete_prefix(text[1:]) if isinstance(v, dict)]
            return [c for c in calls if c is not None]
        try:
            values = json.loads(text)
        except ValueError:
            return None
        calls = [_call(v) for v in values] if isinstance(values, list) else [None]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
