"""Text <-> token ids for every checkpoint format we load, chat templates, streaming decode.

1. `Tokenizer.from_path` looks at what it is given: a `.gguf` file (its `tokenizer.*` metadata is
   read with `gguf.GGUFReader` and handed to step 2), or a directory (or the file itself) holding
   `tokenizer.json` (Hugging Face `tokenizers`; preferred) or `tokenizer.model` (`sentencepiece`).
   Side files in the same directory -- `tokenizer_config.json`, `special_tokens_map.json`,
   `generation_config.json`, `chat_template.jinja` / `chat_template.json` -- supply the special
   tokens, the BOS/EOS rule, the end-of-generation ids and the chat template.
2. `Tokenizer.from_gguf_metadata` rebuilds the tokenizer a GGUF describes. A "gpt2" vocabulary
   becomes a byte-level BPE `tokenizers.Tokenizer` (vocab + merges from the file, split regex
   chosen by `tokenizer.ggml.pre`); a "llama" vocabulary becomes a SentencePiece BPE `ModelProto`
   built from tokens, scores and token types. Control (3) and user-defined (4) tokens are matched
   whole in the text.
3. `encode` runs the backend (special tokens are recognised whole) and adds BOS/EOS by the
   checkpoint's rule: explicit `add_bos_token`/`add_eos_token` flags win; a `tokenizer.json`
   without them keeps its own post-processor.
4. `decode` maps ids back to bytes and then to UTF-8 text, optionally dropping special tokens.
5. `apply_chat_template` renders the checkpoint's own Jinja template in a sandbox, with
   `bos_token`/`eos_token`/`raise_exception`/`tojson` available as in Hugging Face.
6. `IncrementalDetokenizer` turns a stream of generated ids into text deltas. It decodes a short
   window of recent ids twice (with and without the newest ones) and releases the difference only
   when it does not end in U+FFFD, so a character split over several byte tokens is held back until
   complete. A few prompt ids seed the window, so SentencePiece's "▁" on the first generated token
   reads as the space it is rather than being stripped as the start of a text.
"""

from __future__ import annotations

import codecs
import contextlib
import datetime
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

# GGUF token types; they are also SentencePiece's `ModelProto.SentencePiece.Type` values.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# NOTE: `tokenizer.ggml.pre` -> (split regexes applied in order, NFC-normalise, ignore_merges).
# Each entry reproduces the pre-tokenizer of the model's original `tokenizer.json`: SmolLM and
# StarCoder isolate every digit before the GPT-2 split, Qwen2 normalises to NFC, Llama 3 looks a
# whole pre-token up in the vocabulary before merging.
_GGUF_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((_GPT2_SPLIT,), False, False),
    "gpt2": ((_GPT2_SPLIT,), False, False),
    "gpt-2": ((_GPT2_SPLIT,), False, False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False, False),
    "starcoder": ((r"\p{N}", _GPT2_SPLIT), False, False),
    "refact": ((r"\p{N}", _GPT2_SPLIT), False, False),
    "llama-bpe": ((_LLAMA3_SPLIT,), False, True),
    "llama3": ((_LLAMA3_SPLIT,), False, True),
    "llama-v3": ((_LLAMA3_SPLIT,), False, True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), False, True),
    "qwen2": ((_QWEN2_SPLIT,), True, False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), True, False),
}
_GGUF_PRE_ADDS_BOS = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}

# NOTE: like llama.cpp, a GGUF's well-known end-of-turn control tokens also end generation, since a
# GGUF carries no generation_config.json to list them.
_END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
)

_DETOKENIZER_PROMPT_CONTEXT = 6
_SPIECE_SPACE = "\u2581"


class TokenizerError(ValueError):
    """A tokenizer is missing, malformed, unsupported, or was asked to do something impossible."""


def _replace_each_byte(err: UnicodeError) -> tuple[str, int]:
    # SentencePiece and `tokenizers`' ByteFallback write one U+FFFD per undecodable byte.
    if not isinstance(err, UnicodeDecodeError):
        raise err
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error("jaxinfer.replace_each_byte", _replace_each_byte)


def _byte_level_alphabet() -> dict[int, str]:
    """The GPT-2 byte -> printable character map byte-level BPE vocabularies are spelled in."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


class _TokenizersBackend:
    """A Hugging Face `tokenizers.Tokenizer` (from tokenizer.json or built from a GGUF vocab)."""

    def __init__(self, tok: tokenizers.Tokenizer, source: str) -> None:
        self.tok = tok
        self.source = source
        added = tok.get_added_tokens_decoder()
        self.vocab_size = max(
            tok.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1
        )
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.has_post_processor = tok.post_processor is not None

    def encode(self, text: str, post_process: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=post_process).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class _SentencePieceBackend:
    """A `sentencepiece` model, with special tokens split out of the text before it sees it.

    Decoding is done here from a per-id byte table rather than by `sentencepiece`, so special tokens
    can be kept as text on request and ids added beyond the model (tokenizer_config's
    `added_tokens_decoder`) decode too. It follows `sentencepiece`'s rules: "▁" is a space, `<0xNN>`
    pieces are raw bytes, the first piece of a text loses its leading "▁" when the model adds a
    dummy prefix, and each undecodable byte becomes one U+FFFD.
    """

    def __init__(self, model_proto: bytes, added: dict[int, tuple[str, bool]], source: str) -> None:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2

        self.source = source
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
            proto = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
        except Exception as e:
            raise TokenizerError(f"{source}: sentencepiece cannot load the model: {e}") from e
        self.strip_first_space = proto.normalizer_spec.add_dummy_prefix
        n = self.sp.get_piece_size()
        self.vocab_size = max(n, max(added, default=-1) + 1)
        self.pieces: list[str | None] = [None] * self.vocab_size
        self.piece_bytes: list[bytes] = [b""] * self.vocab_size
        special: set[int] = set()
        literal: set[int] = set()
        for i in range(n):
            piece = self.sp.id_to_piece(i)
            self.pieces[i] = piece
            if self.sp.is_byte(i):
                self.piece_bytes[i] = bytes([int(piece[3:5], 16)])
            elif self.sp.is_control(i) or self.sp.is_unknown(i):
                self.piece_bytes[i] = piece.encode()
                special.add(i)
            else:
                self.piece_bytes[i] = piece.replace(_SPIECE_SPACE, " ").encode()
        for i, (content, is_special) in added.items():
            self.pieces[i] = content
            self.piece_bytes[i] = content.encode()
            literal.add(i)
            if is_special:
                special.add(i)
            else:
                special.discard(i)
        self.special_ids = frozenset(special)
        self.literal_ids = frozenset(special | literal)
        self.has_post_processor = False
        self.piece_to_id = {p: i for i, p in enumerate(self.pieces) if p is not None}
        matched = sorted((self.pieces[i] for i in self.literal_ids), key=len, reverse=True)
        self.special_re = re.compile("|".join(map(re.escape, matched))) if matched else None

    def encode(self, text: str, post_process: bool) -> list[int]:
        del post_process  # a sentencepiece model has no post-processor; BOS/EOS come from flags
        if self.special_re is None:
            return self.sp.encode(text)
        ids: list[int] = []
        start = 0
        for m in self.special_re.finditer(text):
            if m.start() > start:
                ids.extend(self.sp.encode(text[start : m.start()]))
            ids.append(self.piece_to_id[m.group()])
            start = m.end()
        if start < len(text):
            ids.extend(self.sp.encode(text[start:]))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out = bytearray()
        at_start = self.strip_first_space
        for i in ids:
            if i in self.literal_ids:
                if skip_special_tokens and i in self.special_ids:
                    continue
                out += self.piece_bytes[i]
            elif (
                at_start and self.pieces[i] is not None and self.pieces[i].startswith(_SPIECE_SPACE)
            ):
                out += self.piece_bytes[i][1:]
            else:
                out += self.piece_bytes[i]
            at_start = False
        return out.decode("utf-8", "jaxinfer.replace_each_byte")

    def id_to_piece(self, token_id: int) -> str | None:
        return self.pieces[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self.piece_to_id.get(token)


_Backend = _TokenizersBackend | _SentencePieceBackend


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


class Tokenizer:
    """One tokenizer API over `tokenizers`, `sentencepiece` and GGUF vocabularies.

    Build it with `from_path` or `from_gguf_metadata`; the constructor is internal.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None,
        unk_token_id: int | None,
        add_bos_token: bool | None,
        add_eos_token: bool | None,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.source: str = backend.source
        self.vocab_size: int = backend.vocab_size
        for name, value in (
            ("bos_token_id", bos_token_id),
            ("pad_token_id", pad_token_id),
            ("unk_token_id", unk_token_id),
            *(("eos_token_ids", e) for e in eos_token_ids),
        ):
            if value is not None and not 0 <= value < self.vocab_size:
                raise TokenizerError(
                    f"{self.source}: {name} {value} is outside the vocabulary (size {self.vocab_size})"
                )
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        if add_bos_token is None and add_eos_token is None and not backend.has_post_processor:
            add_bos_token = add_eos_token = False
        if add_bos_token is None and add_eos_token is None:
            self._explicit_specials = False
        else:
            self._explicit_specials = True
            add_bos_token, add_eos_token = bool(add_bos_token), bool(add_eos_token)
            if add_bos_token and bos_token_id is None:
                raise TokenizerError(
                    f"{self.source}: add_bos_token is set but there is no BOS token"
                )
            if add_eos_token and not self.eos_token_ids:
                raise TokenizerError(
                    f"{self.source}: add_eos_token is set but there is no EOS token"
                )
        # None: the tokenizer.json post-processor decides.
        self.add_bos_token: bool | None = add_bos_token
        self.add_eos_token: bool | None = add_eos_token
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids})"
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer from a checkpoint directory, a tokenizer file, or a `.gguf` file.

        Args:
            path: a directory with `tokenizer.json` or `tokenizer.model` (plus optional
                `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json`,
                `chat_template.jinja`), one of those two files directly, or a `.gguf` file.

        Returns:
            The tokenizer.
        """
        p = Path(path)
        if not p.exists():
            raise TokenizerError(f"tokenizer path {p} does not exist")
        if p.is_file():
            if p.suffix == ".gguf":
                return cls.from_gguf_metadata(_read_gguf_metadata(p), source=str(p))
            if p.name == "tokenizer.json":
                return _load_tokenizer_json(p, p.parent)
            if p.suffix == ".model":
                return _load_sentencepiece(p, p.parent)
            raise TokenizerError(
                f"{p} is not a tokenizer file (expected a .gguf, tokenizer.json or a "
                "sentencepiece .model file, or a directory holding one)"
            )
        if (p / "tokenizer.json").is_file():
            return _load_tokenizer_json(p / "tokenizer.json", p)
        if (p / "tokenizer.model").is_file():
            return _load_sentencepiece(p / "tokenizer.model", p)
        ggufs = sorted(q.name for q in p.glob("*.gguf"))
        hint = f" (to use a GGUF vocabulary, pass the file: {', '.join(ggufs)})" if ggufs else ""
        raise TokenizerError(f"directory {p} has no tokenizer.json or tokenizer.model{hint}")

    @classmethod
    def from_gguf_metadata(
        cls, metadata: dict[str, Any], *, source: str = "GGUF metadata"
    ) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes from its key -> value metadata.

        Args:
            metadata: GGUF metadata with arrays as Python lists; only the `tokenizer.*` keys are
                read: `tokenizer.ggml.model` ("gpt2" or "llama"), `.tokens`, `.scores`,
                `.token_type`, `.merges`, `.pre`, `.bos_token_id`/`.eos_token_id`/
                `.unknown_token_id`/`.padding_token_id`/`.eot_token_id`/`.eom_token_id`,
                `.add_bos_token`/`.add_eos_token`/`.add_space_prefix`, `tokenizer.chat_template`.
            source: how error messages name where the metadata came from.

        Returns:
            The tokenizer.
        """
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model is None:
            raise TokenizerError(f"{source}: no tokenizer.ggml.model")
        if not tokens:
            raise TokenizerError(f"{source}: no tokenizer.ggml.tokens")
        tokens = [str(t) for t in tokens]
        types = metadata.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise TokenizerError(
                    f"{source}: tokenizer.ggml.{key} = {value} is outside the vocabulary "
                    f"({len(tokens)} tokens)"
                )
            return int(value)

        bos, eos, unk = (
            token_id("bos_token_id"),
            token_id("eos_token_id"),
            token_id("unknown_token_id"),
        )
        pre = metadata.get("tokenizer.ggml.pre") or "default"
        if model == "gpt2":
            backend: _Backend = _gguf_byte_level_bpe(metadata, tokens, types, pre, source)
            default_add_bos = pre in _GGUF_PRE_ADDS_BOS
        elif model == "llama":
            backend = _gguf_sentencepiece(metadata, tokens, types, unk, source)
            default_add_bos = True
        else:
            raise TokenizerError(
                f"{source}: unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2', 'llama')"
            )
        eos_ids = [
            i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None
        ]
        eos_ids += [
            i
            for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == _CONTROL and t in _END_OF_TURN_TOKENS
        ]
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            pad_token_id=token_id("padding_token_id"),
            unk_token_id=unk,
            add_bos_token=bool(add_bos) if add_bos is not None else default_add_bos,
            add_eos_token=bool(add_eos) if add_eos is not None else False,
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def placeholder(
        cls,
        vocab_size: int,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        source: str = "placeholder vocabulary",
    ) -> Tokenizer:
        """A vocabulary of `vocab_size` pieces `<0>`, `<1>`, ... (whitespace-separated; unknown
        words encode to id 0): for models built from a config alone (`load_format="dummy"`
        without tokenizer files), which are fed token ids and whose text is only a rendering.
        """
        if vocab_size < 1:
            raise TokenizerError(f"{source}: vocab_size must be >= 1, got {vocab_size}")
        tok = tokenizers.Tokenizer(
            tokenizers.models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>")
        )
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return cls(
            _TokenizersBackend(tok, source),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            pad_token_id=None,
            unk_token_id=0,
            add_bos_token=False,
            add_eos_token=False,
            chat_template=None,
        )

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids `decode(..., skip_special_tokens=True)` drops."""
        return self._backend.special_ids

    @property
    def bos_token(self) -> str | None:
        return self.token_text(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text become their single id.

        Args:
            text: the text.
            add_special_tokens: add BOS/EOS by the checkpoint's rule.

        Returns:
            The ids.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        if not self._explicit_specials:
            return self._backend.encode(text, add_special_tokens)
        ids = self._backend.encode(text, False)
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text for `ids`.

        Args:
            ids: token ids, each in `[0, vocab_size)`.
            skip_special_tokens: drop special tokens (BOS, EOS, chat markers) from the text.

        Returns:
            The text; undecodable bytes become U+FFFD.
        """
        ids = self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for `token_id`, spelled as the vocabulary spells it ("Ġ", "▁")."""
        piece = self._backend.id_to_piece(self._check_ids([token_id])[0])
        if piece is None:
            raise TokenizerError(f"{self.source}: token id {token_id} has no vocabulary entry")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry or special token, or None when there is none."""
        return self._backend.token_to_id(piece)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, special tokens included ("<|im_end|>", " the")."""
        return self.decode([token_id], skip_special_tokens=False)

    def warm(self) -> None:
        """Does once what a server's first request would pay for: compiles the chat template
        (its error, if any, is left for the chat requests to report) and runs encode, decode and
        one streaming detokenizer."""
        ids = self.encode("Hello, world.")
        self.decode(ids)
        detokenizer = self.detokenizer(ids[:1])
        for token_id in ids[1:]:
            detokenizer.add(token_id)
        detokenizer.flush()
        if self.chat_template is not None:
            with contextlib.suppress(TokenizerError):
                self.encode_chat([{"role": "user", "content": "Hello."}])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation with the checkpoint's own chat template.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]`.
            add_generation_prompt: end with the header that opens the assistant's turn.
            **kwargs: extra template variables (`tools`, `documents`, `enable_thinking`, ...).

        Returns:
            The prompt text; encode it with `add_special_tokens=False` (or use `encode_chat`).
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizerError(
                "messages must be a list of dicts like {'role': ..., 'content': ...}"
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"{self.source}: chat template does not compile: {e}") from e
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name, token_id in (
            ("bos_token", self.bos_token_id),
            ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None),
            ("pad_token", self.pad_token_id),
            ("unk_token", self.unk_token_id),
        ):
            if token_id is not None:
                variables[name] = self.token_text(token_id)
        variables.update(kwargs)
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.source}: chat template failed to render: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """`apply_chat_template` then `encode` without adding BOS/EOS (the template writes them)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer | StreamDetokenizer:
        """A streaming decoder for the ids generated after `prompt_ids` (`add` / `flush`).

        `tokenizers` vocabularies (tokenizer.json, GGUF BPE) stream through the library's
        `DecodeStream` (one incremental decode per token); SentencePiece ones re-decode a
        sliding window of ids.
        """
        if isinstance(self._backend, _TokenizersBackend):
            return StreamDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            out = [int(i) for i in ids]
        except (TypeError, ValueError) as e:
            raise TokenizerError(f"token ids must be integers: {e}") from e
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            bad = next(i for i in out if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"{self.source}: token id {bad} is outside [0, {self.vocab_size})")
        return out


class IncrementalDetokenizer:
    """Streams the text of generated ids, never releasing half a UTF-8 character.

    NOTE: the concatenation of everything `add` and `flush` return equals
    `decode(prompt_ids[-k:] + generated)` minus `decode(prompt_ids[-k:])` for a few prompt ids k,
    which is `decode(generated)` when there is no prompt; with a prompt it keeps the space a
    SentencePiece "▁" puts before the first generated word.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids)[-_DETOKENIZER_PROMPT_CONTEXT:] if len(prompt_ids) else []
        # The decode window: ids[:read] are already released (they give context), the rest wait.
        self._ids: list[int] = tokenizer._check_ids(context)
        self._read = len(self._ids)
        self._released_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never half a character)."""
        self._ids.extend(self._tokenizer._check_ids([token_id]))
        return self._release(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes come out as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._decode(self._ids)
        if len(text) <= len(self._released_text) or (not final and text.endswith("\ufffd")):
            return ""
        delta = text[len(self._released_text) :]
        # Slide the window: the ids just released become the context for the next ones.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._released_text = self._decode(self._ids)
        return delta


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s contract over `tokenizers.decoders.DecodeStream`.

    The stream starts from the last few prompt ids (so a first word keeps its leading space);
    ids that do not complete a character yet are remembered, so `flush` can release them as
    U+FFFD when the request ends.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._tok = tokenizer._backend.tok
        self._skip = skip_special_tokens
        context = tokenizer._check_ids(list(prompt_ids)[-_DETOKENIZER_PROMPT_CONTEXT:])
        self._stream = decoders.DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids fed since the last text came out

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never half a character)."""
        (tid,) = self._tokenizer._check_ids([token_id])
        text = self._stream.step(self._tok, tid)
        if text is None:
            self._held.append(tid)
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes come out as U+FFFD)."""
        held, self._held = self._held, []
        return self._tok.decode(held, skip_special_tokens=self._skip) if held else ""


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
    return Tokenizer(
        backend,
        bos_token_id=ids["bos"],
        eos_token_ids=eos_ids,
        pad_token_id=ids["pad"],
        unk_token_id=ids["unk"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_read_chat_template(directory, config),
    )


def _load_tokenizer_json(path: Path, directory: Path) -> Tokenizer:
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot load {path}: {e}") from e
    backend = _TokenizersBackend(tok, str(path))
    return _build_from_directory(
        backend, directory, {"bos": None, "eos": None, "pad": None, "unk": None}, None
    )


def _load_sentencepiece(path: Path, directory: Path) -> Tokenizer:
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
    return _build_from_directory(backend, directory, defaults, True)


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file, arrays as lists."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot read GGUF file {path}: {e}") from e
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }


def _gguf_byte_level_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], pre: str, source: str
) -> _TokenizersBackend:
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise TokenizerError(
            f"{source}: unsupported tokenizer.ggml.pre {pre!r} "
            f"(supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))})"
        )
    splits, nfc, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerError(f"{source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges")

    alphabet = _byte_level_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # NOTE: special tokens keep their literal text (that is how they are matched in the text);
        # a normal token outside the byte alphabet is respelled in it so BPE can reach it.
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        if token in vocab:
            raise TokenizerError(
                f"{source}: token {token!r} appears twice (ids {vocab[token]} and {i})"
            )
        vocab[token] = i
    pairs = []
    for merge in merges:
        parts = str(merge).split(" ")
        if len(parts) != 2:
            raise TokenizerError(
                f"{source}: merge {merge!r} is not two tokens separated by a space"
            )
        pairs.append((parts[0], parts[1]))
    try:
        model = tokenizers.models.BPE(vocab, pairs, ignore_merges=ignore_merges)
    except Exception as e:
        raise TokenizerError(f"{source}: cannot build a BPE model from the vocabulary: {e}") from e
    tok = tokenizers.Tokenizer(model)
    tok.normalizer = normalizers.NFC() if nfc else None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            tokenizers.AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED
        ]
    )
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerError(
            f"{source}: rebuilt vocabulary has {tok.get_vocab_size(with_added_tokens=True)} "
            f"entries, the file lists {len(tokens)}"
        )
    return _TokenizersBackend(tok, source)


def _gguf_sentencepiece(
    metadata: dict[str, Any], tokens: list[str], types: list[int], unk: int | None, source: str
) -> _SentencePieceBackend:
    from sentencepiece import sentencepiece_model_pb2

    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError(
            f"{source}: a 'llama' tokenizer needs one tokenizer.ggml.scores entry per token"
        )
    types = list(types)
    if _UNKNOWN not in types:
        # sentencepiece needs exactly one unknown piece; take the file's unknown id (llama: 0).
        types[unk if unk is not None else 0] = _UNKNOWN
    proto = sentencepiece_model_pb2.ModelProto()
    proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = _BYTE in types
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(
        metadata.get("tokenizer.ggml.add_space_prefix", True)
    )
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        proto.normalizer_spec.precompiled_charsmap = bytes(int(b) & 0xFF for b in charsmap)
    for token, score, kind in zip(tokens, scores, types):
        if kind not in (_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE):
            raise TokenizerError(f"{source}: token {token!r} has unknown token type {kind}")
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = token, float(score), kind
    return _SentencePieceBackend(proto.SerializeToString(), {}, source)
