"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against Hugging Face transformers.

1. The reference is an f32 `LlamaForCausalLM` built from our own GGUF reader: `LlamaConfig` from
   `hf_config()`, weights from `tensors()` (test_gguf proves those bit-identical to transformers'
   GGUF loader, which spends ~10 s rebuilding name tables for this model).
2. Three chat-templated prompts of 515-571 tokens (accented Latin, Cyrillic, CJK, emoji) go through
   one `LLM.generate` call: batched, with chunked prefill (256-token steps). Their 32 greedy tokens
   must equal HF's exactly. HF's side is a KV-cached argmax loop, not `generate(min_new_tokens=)`,
   which would mask EOS where `ignore_eos` does not. A mismatch reports the step, HF's top-2 and
   their gap (below 1e-4 it is a near-tie, still reported, never tolerated).
3. One prompt's `prompt_logprobs` (the prompt token and our top 5 at every position, across three
   prefill chunks) must match HF's `log_softmax` within 1e-4 of the position's logit scale (the
   same bar as the logit parity tests), and our top 5 must be HF's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxinfer  # noqa: E402
from checkpoints.gguf import read_gguf  # noqa: E402
from jaxinfer.default_model import default_model_path  # noqa: E402

try:
    from transformers.initialization import no_init_weights  # transformers >= 5
except ImportError:
    no_init_weights = contextlib.nullcontext  # random init first: ~3 s slower, same model

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
LOGPROB_TOL = 1e-4  # of the position's logit scale (max |logit|), the parity bar; f32
NEAR_TIE = 1e-4  # a greedy mismatch whose HF top-2 gap is below this is a tie, not a bug

TRAVEL = [
    {
        "role": "system",
        "content": "You are a patient travel planner who answers in short, practical paragraphs.",
    },
    {
        "role": "user",
        "content": (
            "Bonjour! I'm planning a slow rail trip through Europe next spring 🚆 and I'd love some "
            "help. I start in Montréal, fly to Lisboa, and want to end in Kraków before flying home "
            "from Warszawa. My budget is about 2 400 € for three weeks, not counting flights. I don't "
            "mind hostels, but I'd like a private room now and then. What's a sensible route?"
        ),
    },
    {
        "role": "assistant",
        "content": (
            "A sensible route keeps the long hops overnight and the short ones scenic. From Lisboa, "
            "take the train to Porto for two nights, then cross into Spain via Vigo and continue to "
            "Madrid. After Madrid, the high-speed line to Barcelona is quick and cheap if you book "
            "early. From Barcelona, the TGV reaches Paris in about six and a half hours. Then go east: "
            "Strasbourg, München, Wien, and finally Kraków by the overnight train. That is eight stops "
            "in three weeks, which leaves room for a rest day or two."
        ),
    },
    {
        "role": "user",
        "content": (
            'Ça me plaît beaucoup. A few worries though: (1) my Spanish is rusty — I know "¿dónde '
            'está la estación?" and "una caña, por favor" and that\'s about it; (2) I\'m vegetarian, '
            "which I hear can be tricky in Bavaria; (3) in Wien I'd like to see the Schönbrunn palace "
            "and eat a proper Sachertorte ☕🍰 without queueing for an hour. Is the Kraków night "
            "train comfortable?"
        ),
    },
    {
        "role": "assistant",
        "content": (
            "Your Spanish will be fine: station staff in Madrid and Barcelona are used to travellers, "
            'and menus often have pictures. In Bavaria, look for the word "vegetarisch" on the menu; '
            "Käsespätzle and Semmelknödel with mushroom sauce are hearty and meat-free. In Wien, buy a "
            "timed ticket for Schönbrunn online and visit the café right after it opens. The night "
            "train to Kraków is comfortable in a couchette."
        ),
    },
    {
        "role": "user",
        "content": (
            "Perfect, merci! Last question. I keep a little travel journal in three languages — "
            'English, français and a bit of Polish ("dzień dobry", "dziękuję", "żółć" is my '
            "favourite word because of the letters). Could you give me one prompt per city, starting "
            "with Lisboa and ending with Kraków. Keep it warm and brief 😊"
        ),
    },
]

RUSSIAN = [
    {
        "role": "user",
        "content": (
            "Please read this short story I wrote in Russian and then summarise it in English in three "
            "sentences, noting the mood of each part.\n\n"
            "Зима пришла в наш маленький город неожиданно, в середине октября. Утром я открыл окно и "
            "увидел, что весь двор покрыт тонким слоем снега, а старый клён у забора стоит белый, как "
            "на открытке.\n\n"
            "Бабушка сказала, что ранний снег — к хорошему урожаю, и поставила на плиту большой "
            "чайник. Дед чинил лыжи в сенях и ворчал, что крепления опять расшатались.\n\n"
            "Я до сих пор помню тот день: запах мокрой шерсти, скрип снега под ногами и звёзды, "
            "которые казались ближе, чем обычно. Иногда мне кажется, что именно тогда я понял, как мало "
            "нужно для счастья — тёплый дом, горячий чай и люди, которые тебя ждут."
        ),
    },
]

CJK = [
    {
        "role": "system",
        "content": "You are a careful translator between Chinese, Japanese, Korean and English.",
    },
    {
        "role": "user",
        "content": (
            "I collected a few short notes from a trip to East Asia. Translate each one into English, "
            "keep the emoji, and tell me which language each note is written in.\n\n"
            "1. 今天早上我们在西湖边散步，湖面上有薄薄的雾，远处的山像一幅水墨画。🌫️\n"
            "2. 中午在一家小面馆吃了牛肉面，老板说他们的汤要熬十二个小时。🍜\n"
            "3. 京都の古いお寺で、静かな庭を眺めながら抹茶を飲みました。とても落ち着きました。🍵\n"
            "4. 夕方、鴨川のほとりを歩いていると、子どもたちが石を投げて遊んでいました。\n"
            "5. 서울의 시장에서 떡볶이를 먹었는데 생각보다 훨씬 매웠어요. 🌶️\n"
            "6. 밤에는 한강 공원에서 친구들과 함께 치킨을 먹으며 이야기를 나눴습니다.\n\n"
            "After the translations, add one sentence comparing the three cities."
        ),
    },
]

CONVERSATIONS = {"travel": TRAVEL, "russian": RUSSIAN, "cjk": CJK}


@pytest.fixture(scope="module")
def model_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def llm(model_path):
    del model_path  # only to skip when the model is not installed; None loads the default
    # NOTE: steps pad to 4 or 256 tokens (decodes of the 3 prompts, every prefill chunk): the last
    # prompt-logprobs chunk (59 tokens) reuses the 256-token logits program instead of compiling
    # a 64-token one; fewer programs of the 135M model than one per power of 2.
    return jaxinfer.LLM(
        None,
        dtype="float32",
        quantization="none",  # the file's blocks as floats: what HF transformers computes with
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        token_buckets=(4, 256),
    )


@pytest.fixture(scope="module")
def prompts(llm) -> dict[str, list[int]]:
    prompts = {name: llm.tokenizer.encode_chat(msgs) for name, msgs in CONVERSATIONS.items()}
    for name, ids in prompts.items():
        assert 450 <= len(ids) <= 600, f"{name}: {len(ids)} tokens"  # longer than one 256 chunk
    return prompts


@contextlib.contextmanager
def _one_torch_thread():
    """torch's intra-op threads spin-wait: on a shared 2-core machine 2 threads ran ~10x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_model(model_path):
    ckpt = read_gguf(model_path)
    config = transformers.LlamaConfig(**ckpt.hf_config())
    config._attn_implementation = "eager"
    with no_init_weights():
        model = transformers.LlamaForCausalLM(config)
    state = {name: torch.from_numpy(w) for name, w in ckpt.tensors()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    model.tie_weights()  # no_init_weights leaves the tie undone
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.to(torch.float32).eval()


@pytest.fixture(scope="module")
def hf_prefill(hf_model):
    """HF's forward over a whole prompt, once per prompt in this module: the greedy loop's first
    step and the prompt-logprobs reference are the same forward. NOTE: the greedy loop extends
    the returned KV cache in place; only its logits are read again."""
    done = {}

    def prefill(ids: list[int]):
        if tuple(ids) not in done:
            with _one_torch_thread():
                done[tuple(ids)] = hf_model(torch.tensor([ids]), use_cache=True)
        return done[tuple(ids)]

    return prefill


def _hf_greedy(
    model, prefill, ids: list[int], n: int
) -> tuple[list[int], list[tuple[int, int, float]]]:
    """n greedy ids from an f32 KV-cached argmax loop, and HF's (top1, top2, gap) at each step."""
    tokens, top2 = [], []
    out = prefill(ids)
    with _one_torch_thread():
        for _ in range(n):
            values, indices = torch.topk(out.logits[0, -1], 2)
            tokens.append(int(indices[0]))
            top2.append((int(indices[0]), int(indices[1]), float(values[0] - values[1])))
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens, top2


def test_greedy_batched_chunked_matches_hf(llm, hf_model, hf_prefill, prompts):
    names = list(prompts)
    sampling = jaxinfer.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([prompts[n] for n in names], sampling)
    failures = []
    for name, out in zip(names, outputs):
        assert out.prompt_token_ids == prompts[name]
        assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, name
        ref, top2 = _hf_greedy(hf_model, hf_prefill, prompts[name], NEW_TOKENS)
        print(
            f"{name} ({len(prompts[name])} prompt tokens): smallest HF top-2 gap "
            f"{min(g for _, _, g in top2):.2e}; {llm.tokenizer.decode(out.token_ids)!r}"
        )
        if out.token_ids != ref:
            step = next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)
            hf_top1, hf_top2, gap = top2[step]
            kind = "near-tie" if gap < NEAR_TIE else "MISMATCH"
            failures.append(
                f"{name}: {kind} at step {step}: ours {out.token_ids[step]}, HF top-2 "
                f"{hf_top1} / {hf_top2} (logit gap {gap:.3e})\n  ours {out.token_ids}\n  "
                f"HF   {ref}"
            )
    assert not failures, "\n".join(failures)


def test_prompt_logprobs_match_hf(llm, hf_prefill, prompts):
    ids = prompts["travel"]  # 571 tokens: prefilled in chunks of 256, 256 and 59
    sampling = jaxinfer.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    (out,) = llm.generate([ids], sampling)
    logits = hf_prefill(ids).logits[0]
    with _one_torch_thread():
        ref = torch.log_softmax(logits, dim=-1).numpy()
        scale = logits.abs().max(dim=-1).values.numpy()  # f32[len(ids)]
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    missing = [pos for pos in range(1, len(ids)) if lps[pos] is None]
    worst, where, top5_differs = 0.0, None, []
    for pos in range(1, len(ids)):
        entry, hf = lps[pos], ref[pos - 1]  # row pos - 1 predicts token pos
        if entry is None:
            continue
        assert ids[pos] in entry and len(entry) in (5, 6), (pos, entry)
        for tok, lp in entry.items():  # the prompt token and our top 5, each against HF
            err = abs(lp - float(hf[tok])) / float(scale[pos - 1])
            if err > worst:
                worst, where = err, (pos, tok)
        order = np.argsort(-hf)
        ours_top5 = sorted(entry, key=entry.get, reverse=True)[:5]
        if set(ours_top5) != set(order[:5].tolist()) and hf[order[4]] - hf[order[5]] >= NEAR_TIE:
            top5_differs.append(pos)
    checked = len(ids) - 1 - len(missing)
    print(
        f"prompt logprobs at {checked} of {len(ids) - 1} positions: worst |error| / logit scale {worst:.2e} "
        f"at (position, token) {where}"
    )
    assert worst <= LOGPROB_TOL, (
        f"worst |error| / logit scale {worst:.3e} at (position, token) {where}"
    )
    assert not top5_differs, f"top-5 ids differ from HF at positions {top5_differs}"
    assert not missing, (
        f"prompt_logprobs is None at {len(missing)} of {len(ids) - 1} positions "
        f"({missing[0]}..{missing[-1]})"
    )
