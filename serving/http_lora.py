"""vLLM's runtime LoRA endpoints, registered only with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (otherwise they are 404s, as in vLLM).

1. `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` registers an adapter
   (`serving.lora_adapters.LoRAAdapters.add`): served from the next request naming it as `model`.
2. `POST /v1/unload_lora_adapter {"lora_name"}` removes it (`FrontEnd.unload_lora`): new
   requests naming it get 404; requests already running finish under it, then the engine core
   frees its device slot and host copy (a `RemoveLoRA` message, vLLM's `remove_lora`).
Refusals are 400s naming the field (`lora_name`, `lora_path`, `max_lora_rank`, ...).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxinfer.lora.adapter import LoRAError
from serving import http_errors
from serving.http_errors import HTTPError
from serving.lora_adapters import runtime_updates_allowed


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def install(app: FastAPI, server: Any) -> None:
    """Adds the endpoints to `app` of an `OpenAIServer` (see the module docstring)."""
    if server.frontend.loras is None or not runtime_updates_allowed():
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = await http_errors.parse_body(request, LoadLoRAAdapterRequest)
        if req.lora_name in (server.model_name, server.frontend.model.name):
            raise HTTPError(400, f"{req.lora_name!r} is the base model's name", "lora_name")
        try:
            server.frontend.loras.add(req.lora_name, req.lora_path)
        except LoRAError as e:
            raise HTTPError(400, str(e), e.field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await http_errors.parse_body(request, UnloadLoRAAdapterRequest)
        try:
            server.frontend.unload_lora(req.lora_name)
        except LoRAError as e:
            raise HTTPError(404, str(e), e.field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
