"""Client helpers over the generated stubs (used by scripts/client.py, scripts/bench_serving.py).

    from serving.client import GenerateClient
    client = GenerateClient("localhost:50051")
    client.wait_ready(timeout=60)
    for msg in client.generate("The sea is", max_tokens=32, temperature=0):
        print(msg.text, end="", flush=True)

`build_request` turns a prompt (text, token ids or chat messages) and `SamplingParams` keyword
arguments into a `GenerateRequest`; `wait_ready` polls the standard health service.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

SERVICE_NAME = "jaxinfer.v1.GenerateService"
_REPEATED = {"stop", "stop_token_ids", "allowed_token_ids", "bad_words"}
_MAPS = {"logit_bias"}


def build_request(
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    *,
    request_id: str = "",
    priority: int | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; `prompt` is text, token ids, or chat messages ({"role", "content"}).

    `sampling` takes the `SamplingParams` proto fields (`max_tokens=`, `temperature=`, ...); None
    values are left unset (the server's defaults apply).
    """
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt
        )  # type: ignore[index]
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    for key, value in sampling.items():
        if value is None:
            continue
        if key in _REPEATED:
            getattr(req.sampling, key).extend(value)
        elif key in _MAPS:
            getattr(req.sampling, key).update(value)
        else:
            setattr(req.sampling, key, value)
    if priority is not None:
        req.priority = priority
    return req


class GenerateClient:
    """A synchronous client of one server."""

    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        self.address = address
        self.channel = channel or grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerateServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health_status(self, service: str = SERVICE_NAME) -> int | None:
        """The health service's status (health_pb2.HealthCheckResponse.*), None if unreachable."""
        try:
            return self.health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            ).status
        except grpc.RpcError:
            return None

    def wait_ready(self, timeout: float = 300.0, poll: float = 0.2) -> None:
        """Waits for health SERVING; raises TimeoutError naming the last status seen."""
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            status = self.health_status()
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(poll)
        name = (
            "unreachable"
            if status is None
            else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        )
        raise TimeoutError(f"server at {self.address} not SERVING after {timeout:.0f}s ({name})")

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Streams the responses (`kwargs`: see `build_request`)."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout)

    def generate_once(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> pb.GenerateResponse:
        return self.stub.GenerateOnce(build_request(prompt, **kwargs), timeout=timeout)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(req).token_ids)
