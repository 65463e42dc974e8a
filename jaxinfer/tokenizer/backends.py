"""The two tokenizer backends `Tokenizer` wraps, behind one duck-typed interface.

1. `_TokenizersBackend` holds a Hugging Face `tokenizers.Tokenizer` (from tokenizer.json, a GGUF
   byte-level BPE vocabulary, or a placeholder vocabulary) and defers to it.
2. `_SentencePieceBackend` holds a `sentencepiece` model (tokenizer.model or a GGUF "llama"
   vocabulary); it splits special tokens out of the text itself and decodes from a per-id byte
   table.
Both expose `source`, `vocab_size`, `special_ids`, `has_post_processor`, `encode`, `decode`,
`id_to_piece` and `token_to_id`.
"""

from __future__ import annotations

import codecs
import re

import tokenizers

from jaxinfer.tokenizer.errors import TokenizerError

_SPIECE_SPACE = "\u2581"


def _replace_each_byte(err: UnicodeError) -> tuple[str, int]:
    # SentencePiece and `tokenizers`' ByteFallback write one U+FFFD per undecodable byte.
    if not isinstance(err, UnicodeDecodeError):
        raise err
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error("jaxinfer.replace_each_byte", _replace_each_byte)


NOGIL_ENCODE_CHARS = 4096  # texts this long are encoded without holding the GIL


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
        if len(text) >= NOGIL_ENCODE_CHARS:
            # NOTE: `Tokenizer.encode` holds the GIL for the whole encode (a 1 MB text froze every
            # other thread for 0.84 s); the batch API releases it, and `_fast` skips the offsets.
            return self.tok.encode_batch_fast([text], add_special_tokens=post_process)[0].ids
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
