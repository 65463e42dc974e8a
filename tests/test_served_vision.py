"""Images through the real server (`scripts/serve.py`, a tiny dummy Gemma 3 VLM): a chat with a
`data:` URL image part streams an answer; the prefix cache keys include the image; bad image
parts and too many images are a 400 naming the field; `--max-num-encoder-input-tokens` reaches the
engine core; `file://` URLs under `--allowed-local-media-path` and `http://` URLs from
`--allowed-media-domains` (a server on 127.0.0.1, a thread of this test) give the same image, and
every refused or failed one is a 400 naming the part, a slow host timing out without holding other
clients."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading
import urllib.request

import pytest
from served_utils import ServedProcess
from vision_utils import TOKENS_PER_IMAGE, data_url, png_bytes, tiny_vlm_dir

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")


class _Images(http.server.BaseHTTPRequestHandler):
    """/cat.png (png_bytes(7)), /big.png (over --max-image-bytes), /text, /redirect (to
    localhost: not an allowed domain), /slow (held until the test releases it), /hang (held
    past the fetch timeout); else 404."""

    arrived, release, hang = threading.Event(), threading.Event(), threading.Event()

    def do_GET(self) -> None:  # noqa: N802
        port = self.server.server_address[1]
        if self.path == "/slow":
            self.arrived.set()
            self.release.wait(60)
        if self.path == "/hang":
            self.hang.wait(60)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cat.png")
            self.end_headers()
            return
        body = {"/cat.png": png_bytes(7), "/slow": png_bytes(7), "/hang": b"", "/text": b"not an image",
                "/big.png": png_bytes(8, size=200)}.get(self.path)  # fmt: skip
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # /hang answering a fetch that gave up
            super().handle()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(http base URL, local media dir, a closed port): the image host and files."""
    root = tmp_path_factory.mktemp("media")
    (root / "media").mkdir()
    (root / "media" / "cat.png").write_bytes(png_bytes(7))
    (root / "secret.png").write_bytes(png_bytes(9))
    os.symlink(root / "secret.png", root / "media" / "link.png")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    yield f"http://127.0.0.1:{httpd.server_address[1]}", str(root / "media"), closed
    _Images.release.set()
    _Images.hang.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, media):
    model = tiny_vlm_dir(tmp_path_factory.mktemp("served") / "vlm")
    srv = ServedProcess(
        ["--model", model, "--load-format", "dummy", "--no-warmup", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--num-pages", "32",
         "--token-buckets", "2,32",
         "--limit-mm-per-prompt", '{"image": 2}', "--max-num-encoder-input-tokens",
         str(TOKENS_PER_IMAGE), "--allowed-local-media-path", media[1],
         "--allowed-media-domains", "127.0.0.1", "--max-image-bytes", "64KiB"],
        env={"VLLM_IMAGE_FETCH_TIMEOUT": "3"},
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


def test_grpc_images_field(served, media):
    """gRPC `GenerateRequest.images`: encoded bytes beside a prompt holding the placeholder; an
    undecodable one is INVALID_ARGUMENT naming images[i]; `image_urls` under the HTTP rules (a
    refused host: INVALID_ARGUMENT naming image_urls[i])."""
    import grpc

    from serving.protos.jaxinfer.v1 import generate_pb2 as pb
    from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

    def request(*images: bytes, urls: tuple[str, ...] = ()) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=2, temperature=0.0)
        return pb.GenerateRequest(
            prompt="<start_of_image>What is it?", images=images, image_urls=urls,
            sampling=sampling,
        )  # fmt: skip

    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        out = stub.GenerateOnce(request(png_bytes(3)), timeout=120)
        assert len(out.token_ids) == 2 and out.usage.prompt_tokens > TOKENS_PER_IMAGE
        by_url = stub.GenerateOnce(request(urls=(f"{media[0]}/cat.png",)), timeout=120)
        by_bytes = stub.GenerateOnce(request(png_bytes(7)), timeout=120)  # cat.png's bytes
        assert list(by_url.token_ids) == list(by_bytes.token_ids)
        assert by_url.usage.prompt_tokens == out.usage.prompt_tokens
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateOnce(request(png_bytes(3), b"not an image"), timeout=120)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GenerateOnce(request(urls=("http://localhost/cat.png",)), timeout=120)
    assert e.value.code() == refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[1]" in e.value.details()
    assert "image_urls[0]" in refused.value.details()


def test_image_urls_from_files_and_hosts_are_the_same_image(client, media):
    """`file://` under --allowed-local-media-path and `http://` from an allowed domain: the image
    of png_bytes(7), so the data URL's prefix-cache pages hit (the key is the pixels' hash)."""
    base, local, _ = media
    assert _cached(client, data_url(7)) == 0
    assert _cached(client, f"{base}/cat.png") > 0
    assert _cached(client, f"file://{local}/cat.png") > 0


@pytest.mark.parametrize(
    "url, why",
    [
        ("file://{local}/../secret.png", "outside --allowed-local-media-path"),
        ("file://{local}/link.png", "outside --allowed-local-media-path"),  # a symlink out
        ("file://{local}/none.png", "cannot read the file"),
        ("http://127.0.0.1:{closed}/cat.png", "fetching the image failed"),
        ("{base}/missing.png", "HTTP 404"),
        ("{base}/text", "not a decodable image"),
        ("{base}/big.png", "--max-image-bytes"),
        ("{base}/redirect", "not in --allowed-media-domains"),
        ("ftp://127.0.0.1/cat.png", "unsupported image URL"),
    ],
)
def test_refused_and_failed_image_urls_are_a_400_naming_the_part(client, media, url, why):
    base, local, closed = media
    part = _image(url.format(base=base, local=local, closed=closed))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vlm", messages=_messages(part), max_tokens=1)
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"
    assert why in e.value.body["message"]


def test_a_slow_image_host_holds_no_other_client_then_times_out(client, served, media):
    """While a fetch waits on a host that has not answered, the server answers others (then
    the host answers: the image arrives within VLLM_IMAGE_FETCH_TIMEOUT, 3 s here; a fetch on
    the event loop would have held /v1/models until it timed out); a host that never answers
    ends at the timeout with a 400 naming the part."""
    got = {}

    def chat(path: str) -> None:
        try:
            got[path] = client.chat.completions.create(
                model="vlm", messages=_messages(_image(media[0] + path)), max_tokens=1
            ).usage.prompt_tokens
        except openai.BadRequestError as e:
            got[path] = e.body

    thread = threading.Thread(target=chat, args=("/slow",))
    thread.start()
    try:
        assert _Images.arrived.wait(60)
        with urllib.request.urlopen(f"{served.http_url}/models", timeout=60) as r:
            assert r.status == 200
    finally:
        _Images.release.set()
    thread.join(60)
    assert got["/slow"] > TOKENS_PER_IMAGE, got  # not a timeout: the loop was free
    chat("/hang")
    assert got["/hang"]["param"] == "messages[0].content[0].image_url.url"
    assert "timed out" in got["/hang"]["message"], got
