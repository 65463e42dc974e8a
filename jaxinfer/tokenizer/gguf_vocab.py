"""Rebuilding the tokenizer a GGUF file describes from its `tokenizer.*` metadata.

1. `read_gguf_metadata` reads the `tokenizer.*` keys of a `.gguf` file with `gguf.GGUFReader`.
2. `_tokenizer_from_gguf_metadata` picks the backend by `tokenizer.ggml.model`: a "gpt2"
   vocabulary becomes a byte-level BPE `tokenizers.Tokenizer` (vocab + merges from the file, split
   regex chosen by `tokenizer.ggml.pre`; `_gguf_byte_level_bpe`); a "llama" vocabulary becomes a
   SentencePiece BPE `ModelProto` built from tokens, scores and token types
   (`_gguf_sentencepiece`). Control (3) and user-defined (4) tokens are matched whole in the text.
3. The end-of-generation ids are the file's EOS/EOT/EOM ids plus its well-known end-of-turn
   control tokens; BOS is added by the file's flag, else by the vocabulary's convention.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

from jaxinfer.tokenizer.backends import _Backend, _SentencePieceBackend, _TokenizersBackend
from jaxinfer.tokenizer.errors import TokenizerError

if TYPE_CHECKING:
    from jaxinfer.tokenizer.core import Tokenizer

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


def byte_level_alphabet() -> dict[int, str]:
    """The GPT-2 byte -> printable character map byte-level BPE vocabularies are spelled in."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


def _tokenizer_from_gguf_metadata(
    cls: type[Tokenizer], metadata: dict[str, Any], source: str
) -> Tokenizer:
    """`Tokenizer.from_gguf_metadata`: backend, special ids and BOS/EOS rule of a GGUF vocabulary."""
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


def read_gguf_metadata(path: Path) -> dict[str, Any]:
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

    alphabet = byte_level_alphabet()
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
