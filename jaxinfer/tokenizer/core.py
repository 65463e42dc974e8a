"""`Tokenizer`: one API over the backends, the checkpoint loaders, chat templates and streaming.

1. `from_path` dispatches on what it is given: a `.gguf` file (`gguf_vocab`), a `tokenizer.json`
   or sentencepiece `.model` file, or a directory holding one (`files`); `from_gguf_metadata` and
   `placeholder` build one from metadata or a vocabulary size.
2. `encode` runs the backend (special tokens are recognised whole) and adds BOS/EOS by the
   checkpoint's rule: explicit `add_bos_token`/`add_eos_token` flags win; a `tokenizer.json`
   without them keeps its own post-processor.
3. `decode` maps ids back to bytes and then to UTF-8 text, optionally dropping special tokens.
4. `apply_chat_template` renders the checkpoint's own Jinja template in the sandbox of
   `chat_template`.
5. `detokenizer` hands out the streaming decoder that fits the backend (`detokenizer`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import pre_tokenizers

from jaxinfer.tokenizer.backends import _Backend, _TokenizersBackend
from jaxinfer.tokenizer.chat_template import _chat_environment
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from jaxinfer.tokenizer.errors import TokenizerError
from jaxinfer.tokenizer.files import _load_sentencepiece, _load_tokenizer_json
from jaxinfer.tokenizer.gguf_vocab import _tokenizer_from_gguf_metadata, read_gguf_metadata


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
                return cls.from_gguf_metadata(read_gguf_metadata(p), source=str(p))
            if p.name == "tokenizer.json":
                return _load_tokenizer_json(cls, p, p.parent)
            if p.suffix == ".model":
                return _load_sentencepiece(cls, p, p.parent)
            raise TokenizerError(
                f"{p} is not a tokenizer file (expected a .gguf, tokenizer.json or a "
                "sentencepiece .model file, or a directory holding one)"
            )
        if (p / "tokenizer.json").is_file():
            return _load_tokenizer_json(cls, p / "tokenizer.json", p)
        if (p / "tokenizer.model").is_file():
            return _load_sentencepiece(cls, p / "tokenizer.model", p)
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
        return _tokenizer_from_gguf_metadata(cls, metadata, source)

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
        except Exception as e:  # noqa: BLE001 - a template over user input may raise anything
            # (a TypeError iterating a `tools` that is not a list, ...): the input is at fault.
            raise TokenizerError(
                f"{self.source}: chat template failed to render: {type(e).__name__}: {e}"
            ) from e

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
