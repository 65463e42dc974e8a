"""Loading a tokenizer from a checkpoint directory: the backend file plus its side files.

1. `_load_tokenizer_json` / `_load_sentencepiece` build the backend from `tokenizer.json` or
   `tokenizer.model` (the latter with `tokenizer_config.json`'s `added_tokens_decoder`).
2. `_build_from_directory` resolves the special tokens (`tokenizer_config.json`, then
   `special_tokens_map.json`, then `generation_config.json`), the BOS/EOS rule, the
   end-of-generation ids and the chat template (`chat_template.jinja`, `chat_template.json`, or
   `tokenizer_config.json`'s `chat_template`), and builds the `Tokenizer` (`cls`) from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from jaxinfer.tokenizer.backends import _Backend, _SentencePieceBackend, _TokenizersBackend
from jaxinfer.tokenizer.errors import TokenizerError

if TYPE_CHECKING:
    from jaxinfer.tokenizer.core import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return value


def _token_content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: cannot read a token from {value!r}")


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(
                f"{directory}: chat templates {sorted(map(str, named))} include no 'default'"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(
            f"{directory}: chat_template is a {type(template).__name__}, not a str"
        )
    return template


def _build_from_directory(
    cls: type[Tokenizer],
    backend: _Backend,
    directory: Path,
    defaults: dict[str, int | None],
    default_add_bos: bool | None,
) -> Tokenizer:
    """Resolve special tokens, BOS/EOS rule and chat template from the side files of a checkpoint."""
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")

    ids: dict[str, int | None] = dict(defaults)
    for name in ("bos", "eos", "pad", "unk"):
        key = f"{name}_token"
        where = "tokenizer_config.json" if key in config else "special_tokens_map.json"
        content = _token_content(
            config.get(key, special_map.get(key)), f"{directory / where} {key}"
        )
        if content is None:
            if key in config:  # an explicit null overrides the backend's default
                ids[name] = None
            continue
        token_id = backend.token_to_id(content)
        if token_id is None:
            raise TokenizerError(f"{directory / where}: {key} {content!r} is not in the vocabulary")
        ids[name] = token_id
    if ids["bos"] is None and isinstance(generation.get("bos_token_id"), int):
        ids["bos"] = generation["bos_token_id"]
    if ids["pad"] is None and isinstance(generation.get("pad_token_id"), int):
        ids["pad"] = generation["pad_token_id"]
    gen_eos = generation.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    eos_ids = ([ids["eos"]] if ids["eos"] is not None else []) + [int(i) for i in gen_eos]

    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    if add_bos is None and add_eos is None and default_add_bos is not None:
        add_bos, add_eos = default_add_bos, False
    return cls(
        backend,
        bos_token_id=ids["bos"],
        eos_token_ids=eos_ids,
        pad_token_id=ids["pad"],
        unk_token_id=ids["unk"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_read_chat_template(directory, config),
    )


def _load_tokenizer_json(cls: type[Tokenizer], path: Path, directory: Path) -> Tokenizer:
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot load {path}: {e}") from e
    backend = _TokenizersBackend(tok, str(path))
    return _build_from_directory(
        cls, backend, directory, {"bos": None, "eos": None, "pad": None, "unk": None}, None
    )


def _load_sentencepiece(cls: type[Tokenizer], path: Path, directory: Path) -> Tokenizer:
    config = _read_json(directory / "tokenizer_config.json")
    added: dict[int, tuple[str, bool]] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(
            entry, f"{directory / 'tokenizer_config.json'} added_tokens_decoder"
        )
        if not str(key).isdigit() or content is None:
            raise TokenizerError(
                f"{directory / 'tokenizer_config.json'}: bad added_tokens_decoder entry {key!r}"
            )
        added[int(key)] = (content, bool(entry.get("special", True)))
    backend = _SentencePieceBackend(path.read_bytes(), added, str(path))
    sp = backend.sp
    defaults = {
        name: (value if value >= 0 else None)
        for name, value in (
            ("bos", sp.bos_id()),
            ("eos", sp.eos_id()),
            ("pad", sp.pad_id()),
            ("unk", sp.unk_id()),
        )
    }
    return _build_from_directory(cls, backend, directory, defaults, True)
