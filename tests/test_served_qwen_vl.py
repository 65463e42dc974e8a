"""Qwen2.5-VL through the real server (`scripts/serve.py`, a tiny dummy Qwen2.5-VL): a chat with
a `data:` URL image part streams an answer (the image's smart-resized grid sets its token count);
the same image again hits the prefix cache, another image does not."""

from __future__ import annotations

import pytest
from qwen_vl_utils import tiny_qwen_vl_dir
from served_utils import ServedProcess
from vision_utils import data_url

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")

TEXT = "What is in this picture? Tell me about it in detail, please."


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = tiny_qwen_vl_dir(tmp_path_factory.mktemp("served") / "qwen-vl")
    srv = ServedProcess(
        ["--model", model, "--load-format", "dummy", "--no-warmup", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--num-pages", "32",
         "--token-buckets", "2,32"]
    )  # fmt: skip
    yield openai.OpenAI(base_url=srv.http_url, api_key="x", max_retries=0)
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _chat(client, seed: int, **kw):
    image = {"type": "image_url", "image_url": {"url": data_url(seed)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": TEXT}]}]
    return client.chat.completions.create(model="qwen-vl", messages=messages, temperature=0.0, **kw)


def _cached(client, seed: int) -> int:
    details = _chat(client, seed, max_tokens=1).usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_chat_with_an_image_streams_and_caches_by_image(client):
    chunks = list(
        _chat(client, 0, max_tokens=3, stream=True, stream_options={"include_usage": True})
    )
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
    usage = chunks[-1].usage
    assert usage.completion_tokens == 3
    # data_url's 29x24 image smart-resizes to 84x56 (min_pixels 56*56, the aspect kept):
    # 6x4 patches, 6 merged tokens
    text_only = client.chat.completions.create(
        model="qwen-vl", messages=[{"role": "user", "content": TEXT}], max_tokens=1
    )
    assert usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + 6  # start, 6 pads, end
    assert _cached(client, 1) == 0  # another image, the same text: nothing shared
    assert _cached(client, 0) > 0  # the same image and text again: its pages hit
