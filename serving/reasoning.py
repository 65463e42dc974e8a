"""Reasoning parsers: a thinking model's `<think>...</think>` output as `reasoning_content`.

`--reasoning-parser NAME` picks one (vLLM's names); chat responses then carry the reasoning in
`message.reasoning_content` (streamed as `delta.reasoning_content`) and only the answer in
`content`. Tool-call parsing and structured output apply to the answer part only
(`answer_grammar`).

1. `REASONING_PARSERS[name]`: `deepseek_r1` (the output starts inside the reasoning, its template
   having opened `<think>` in the prompt; a leading `<think>` is dropped; everything up to
   `</think>` is reasoning, all of it while `</think>` has not come) and `qwen3` (reasoning only
   inside an explicit `<think>...</think>` at the start; without one the output is all answer,
   as with `chat_template_kwargs={"enable_thinking": false}`). A request that sets
   `enable_thinking` false is not split at all (`serving.chat`): its output is all answer.
2. `parser.split(text)` -> `(reasoning, content)`, each None when empty.
3. Streaming, `parser.stream(delta)` -> `(reasoning delta, content delta)`; a tag cut across
   deltas is held back until it is whole; `parser.finish()` returns what was held.
4. `answer_grammar(parser_name, answer_lark)` is a Lark grammar (llguidance's dialect) that lets
   the reasoning through unconstrained and constrains what follows `</think>` to the answer's
   grammar: how a constrained request keeps its reasoning; `after_reasoning(params, parser)`
   rewrites a request's `StructuredOutputsParams` so (both protocols' chat requests). As in vLLM (which applies the
   constraint once the reasoning has ended), a thinking request reasons first: qwen3's output
   opens with `<think>`, deepseek_r1's may.
"""

from __future__ import annotations

import json

from jaxinfer.sampling_params import StructuredOutputsParams
from serving.errors import InvalidArgument

START, END = "<think>", "</think>"


class ReasoningParser:
    """Base: splits `<think>` reasoning off the answer (module docstring)."""

    name = ""
    starts_inside = False  # the output begins inside the reasoning (no `<think>` needed)

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> reasoning -> content

    def split(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.stream(text)
        r2, c2 = self.finish()
        return (reasoning + r2) or None, (content + c2) or None

    def stream(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        while True:
            if self._state == "start":
                body = self._buf.lstrip()
                if body.startswith(START):
                    self._buf, self._state = body[len(START) :], "reasoning"
                elif START.startswith(body):  # maybe a `<think>` being written (or nothing yet)
                    return reasoning, content
                else:
                    self._state = "reasoning" if self.starts_inside else "content"
            elif self._state == "reasoning":
                at = self._buf.find(END)
                if at >= 0:
                    reasoning += self._buf[:at]
                    self._buf, self._state = self._buf[at + len(END) :], "content"
                    continue
                keep = _partial_suffix(self._buf, END)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, content
            else:
                content += self._buf
                self._buf = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back once the stream has ended."""
        held, self._buf = self._buf, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "start" and self.starts_inside:
            return held, ""
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def answer_grammar(parser: str, answer: str) -> str:
    """A Lark grammar: the parser's reasoning (free text up to `</think>`), then `answer` (a Lark
    expression: `%json {...}`, a regex, alternatives). The reasoning comes first: after an
    explicit `<think>` (qwen3), or with it optional (deepseek_r1, whose template opens it)."""
    think = f'"{START}"? think_text' if parser == "deepseek_r1" else f'"{START}" think_text'
    return (
        "start: think answer\n"
        f"think: {think} /[ \\t\\r\\n]*/\n"
        f"think_text[stop={json.dumps(END)}]: /(?s:.*)/\n"
        f"answer: {answer}\n"
    )


def after_reasoning(
    so: StructuredOutputsParams, parser: str
) -> tuple[StructuredOutputsParams, str]:
    """`so` applied to the answer after the reasoning (`answer_grammar`), and the field it came
    from (InvalidArgument for a grammar: it would have to allow the reasoning itself)."""
    if so.json is not None:
        try:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        except ValueError as e:
            raise InvalidArgument(
                f"structured_outputs.json is not valid JSON: {e}", "structured_outputs.json"
            ) from None
        answer, field = f"%json {json.dumps(schema)}", "structured_outputs.json"
    elif so.json_object:
        answer, field = '%json {"type": "object"}', "structured_outputs.json_object"
    elif so.regex is not None:
        answer, field = "/" + so.regex.replace("/", "\\/") + "/", "structured_outputs.regex"
    elif so.choice is not None:
        answer = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        field = "structured_outputs.choice"
    else:
        raise InvalidArgument(
            "structured_outputs.grammar cannot be combined with --reasoning-parser (the grammar "
            "would have to allow the reasoning); use json, regex or choice",
            "structured_outputs.grammar",
        )
    return StructuredOutputsParams(grammar=answer_grammar(parser, answer)), field
