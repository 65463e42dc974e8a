"""The Jinja environment chat templates render in: Hugging Face's sandbox and helpers.

Templates run in an immutable sandbox with `trim_blocks`/`lstrip_blocks`, loop controls, a no-op
`{% generation %}` tag, a `tojson` filter that keeps non-ASCII text, and the `raise_exception` /
`strftime_now` globals Hugging Face templates call.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from jaxinfer.tokenizer.errors import TokenizerError


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks) renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _template_tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_raise(message: str) -> None:
    raise TokenizerError(f"chat template refused the conversation: {message}")


def _template_strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _template_tojson
    env.globals["raise_exception"] = _template_raise
    env.globals["strftime_now"] = _template_strftime_now
    return env
