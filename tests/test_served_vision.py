"""Images through the real server (`scripts/serve.py`, a tiny dummy Gemma 3 VLM): a chat with a
`data:` URL image part streams an answer; the prefix cache keys include the image; bad image
parts and too many images are a 400 naming the field; `--max-num-encoder-input-tokens` reaches the
engine core."""

from __future__ import annotations

import pytest
from served_utils import ServedProcess
from vision_utils import TOKENS_PER_IMAGE, data_url, png_bytes, tiny_vlm_dir

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = tiny_vlm_dir(tmp_path_factory.mktemp("served") / "vlm")
    srv = ServedProcess(
        ["--model", model, "--load-format", "dummy", "--no-warmup", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--num-pages", "32",
         "--limit-mm-per-prompt", '{"image": 2}', "--max-num-encoder-input-tokens",
         str(TOKENS_PER_IMAGE)]
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


def test_two_images_take_one_encoder_budget_each(served, client):
    """`--max-num-encoder-input-tokens` of one image reaches the engine core, and a chat with two
    images (adjacent, inside one token budget) still answers: its images go in two steps (the
    rule itself: tests/test_scheduler.py, tests/test_vision.py)."""
    assert "images: max_num_encoder_input_tokens 4 a step" in "".join(served.log)
    out = client.chat.completions.create(
        model="vlm", messages=_messages(_image(data_url(7)), _image(data_url(8))), max_tokens=1,
        temperature=0.0,
    )  # fmt: skip
    assert out.usage.completion_tokens == 1 and out.usage.prompt_tokens > 2 * TOKENS_PER_IMAGE


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


def test_grpc_images_field(served):
    """gRPC `GenerateRequest.images`: encoded bytes beside a prompt holding the placeholder; an
    undecodable one is INVALID_ARGUMENT naming images[i]."""
    import grpc

    from serving.protos.jaxinfer.v1 import generate_pb2 as pb
    from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

    def request(*images: bytes) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=2, temperature=0.0)
        return pb.GenerateRequest(
            prompt="<start_of_image>What is it?", images=images, sampling=sampling
        )

    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        out = stub.GenerateOnce(request(png_bytes(3)), timeout=120)
        assert len(out.token_ids) == 2 and out.usage.prompt_tokens > TOKENS_PER_IMAGE
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateOnce(request(png_bytes(3), b"not an image"), timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[1]" in e.value.details()
