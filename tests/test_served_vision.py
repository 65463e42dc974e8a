"""Images through the real server (`scripts/serve.py`, a tiny dummy Gemma 3 VLM): a chat with a
`data:` URL image part streams an answer; the prefix cache keys include the image; bad image
parts and too many images are a 400 naming the field."""

from __future__ import annotations

import pytest
from served_utils import ServedProcess
from vision_utils import data_url, tiny_vlm_dir

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = tiny_vlm_dir(tmp_path_factory.mktemp("served") / "vlm")
    srv = ServedProcess(
        ["--model", model, "--load-format", "dummy", "--no-warmup", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--num-pages", "32",
         "--limit-mm-per-prompt", '{"image": 2}']
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key="x", max_retries=0)


def _messages(*parts: dict) -> list[dict]:
    text = {"type": "text", "text": "What is in this picture? Tell me about it in detail."}
    return [{"role": "user", "content": [*parts, text]}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_an_image_streams(client):
    stream = client.chat.completions.create(
        model="vlm", messages=_messages(_image(data_url(0))), max_tokens=3, stream=True,
        stream_options={"include_usage": True}, temperature=0.0,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens > 4  # the image's soft tokens are in the prompt


def _cached(client, url: str) -> int:
    out = client.chat.completions.create(
        model="vlm", messages=_messages(_image(url)), max_tokens=1, temperature=0.0
    )
    details = out.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_prefix_cache_keys_include_the_image(client):
    assert _cached(client, data_url(5)) == 0
    assert _cached(client, data_url(6)) == 0  # same text, another image: nothing shared
    assert _cached(client, data_url(5)) > 0  # the same image again: its pages hit


@pytest.mark.parametrize(
    "part, field",
    [
        (_image("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[0].image_url.url"),
        (_image("https://example.com/cat.png"), "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": "x"}, "messages[0].content[0].image_url"),
    ],
)
def test_bad_images_are_a_400_naming_the_field(client, part, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vlm", messages=_messages(part), max_tokens=1)
    assert e.value.body["param"] == field


def test_limit_mm_per_prompt(client):
    parts = [_image(data_url(i)) for i in range(3)]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vlm", messages=_messages(*parts), max_tokens=1)
    assert e.value.body["param"] == "messages[0].content[2].image_url.url"
    assert "limit-mm-per-prompt" in e.value.body["message"]
