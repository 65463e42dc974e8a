"""The offline Python API: `LLM(model).generate(prompts, sampling)` and `LLM.chat(messages)`.

1. `LLM(...)` loads the model (default: the embedded SmolLM2-135M-Instruct) and builds an
   `LLMEngine` from the engine options.
2. `generate` queues every prompt, steps the engine until all are done, and folds the per-step
   deltas into one `RequestOutput` per prompt, in the order given.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

from jaxinfer import compile_cache
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig
from jaxinfer.engine.core_loop import spaced_young_collections
from jaxinfer.engine.engine import LLMEngine, Usage
from jaxinfer.engine.types import TokenLogprobs
from jaxinfer.loader import load_model
from jaxinfer.lora.request import LoRARequest
from jaxinfer.model_info import check_load_format
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.vision.inputs import ImageInput
from jaxinfer.vision.media import MediaConnector
from jaxinfer.vision.processor import (
    chat_parts,
    expand_prompt,
    resized,
    vision_spec,
    with_images,
)

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)} - {"dtype"}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None  # per token: top-k ids plus the chosen id


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result; the top-level fields are the first sample's (`outputs[0]`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    usage: Usage | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def _as_dict(lp: TokenLogprobs | None) -> dict[int, float] | None:
    if lp is None:
        return None
    return {**lp.top, lp.token_id: lp.logprob}


class LLM:
    """Offline generation over the continuous-batching engine.

    Args:
      model: a GGUF file, a Hugging Face model dir, or an orbax checkpoint dir written by
        `scripts/convert.py`; None is the embedded SmolLM2-135M-Instruct.
      dtype: "float32" or "bfloat16"; default float32 on CPU, bfloat16 on accelerators.
      load_format: "auto" loads the checkpoint's weights; "dummy" (vLLM's name) builds random
        weights of the right shapes, dtype and shardings on the devices from the model's config
        (a directory with `config.json` and the tokenizer files is enough): for benchmarks.
      skip_tokenizer_init: load no tokenizer (a checkpoint without one loads): prompts are token
        ids, outputs carry token ids with empty text, generation stops at the config's
        `eos_token_id` or `stop_token_ids`; text prompts, `stop` strings and `chat` raise.
      compilation_cache_dir: the persistent XLA compilation cache (`jaxinfer.compile_cache`):
        None uses `$JAX_COMPILATION_CACHE_DIR`, else `~/.cache/jaxinfer/xla`; "" turns it off.
      **engine_options: `EngineConfig` fields (page_size, num_pages, kv_cache_memory,
        max_model_len, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, mesh,
        long_prefill_token_threshold, max_num_encoder_input_tokens, num_scheduler_steps,
        quantization, enable_lora,
        max_loras, max_lora_rank, max_cpu_loras), `attention_backend` and `linear_backend`; for
        images `limit_mm_per_prompt`, `allowed_local_media_path` (`file://` URLs only under it)
        and `allowed_media_domains` (http(s) hosts; default any), as vLLM.
        `quantization="int8"` (or "fp8", "int4") stores the linear weights and the embedding
        quantized with group-wise (int8: 128 input channels) or per-output-channel (fp8) scales,
        applied at load; a GPTQ / AWQ checkpoint loads in its own packed format, and
        `quantization="gptq"` / `"awq"` (vLLM's names, also "*_marlin") asks for that and
        refuses any other checkpoint, a GGUF file loads in its own bits (vLLM's `"gguf"`,
        also the default for one) and `"none"` dequantizes it to floats (see
        `jaxinfer.loader.load_model`);
        `kv_cache_dtype="fp8"` stores the paged KV cache as float8_e4m3fn. `mesh="tensor=4"`
        (the same string as `serve.py --mesh`) loads the weights straight onto the mesh, sharded by
        the rules; see README "Serving on a mesh".
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | None = None,
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
        compilation_cache_dir: str | None = None,
        **engine_options: Any,
    ) -> None:
        compile_cache.enable(compilation_cache_dir)
        self.limit_mm_per_prompt = dict(engine_options.pop("limit_mm_per_prompt", None) or {})
        self.media = MediaConnector(
            engine_options.pop("allowed_local_media_path", None),
            engine_options.pop("allowed_media_domains", None),
        )
        backend = engine_options.pop("attention_backend", None)
        linear_backend = engine_options.pop("linear_backend", None)
        unknown = set(engine_options) - _ENGINE_OPTIONS
        if unknown:
            raise TypeError(
                f"unknown engine options {sorted(unknown)}; known: {sorted(_ENGINE_OPTIONS)}"
            )
        quantization = engine_options.pop("quantization", None)
        EngineConfig(
            quantization=quantization
        )  # a bad value fails before loading, naming the field
        check_load_format(load_format)
        mesh = shd.make_mesh(engine_options.get("mesh") or None)  # a bad mesh fails before loading
        self.model = load_model(
            model,
            dtype=dtype,
            mesh=mesh,
            quantization=quantization,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
        )
        config = EngineConfig(
            dtype=self.model.dtype, quantization=self.model.quantization, **engine_options
        )
        self.engine = LLMEngine(
            self.model, config, attention_backend=backend, linear_backend=linear_backend
        )
        # NOTE: this LLM's own model takes the runner's params (a CPU runner tiles int4 codes,
        # `quantization.tile_for_cpu`), so the process holds one copy of the weights.
        self.model.params = self.engine.core.runner.params
        self.tokenizer = self.model.tokenizer
        self.vision = vision_spec(self.model.path, self.model.hf_config or {})
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | dict | list[str | dict] | list[list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order; `lora_request` (one for all, or one per prompt; None:
        the base model) runs them with PEFT adapters (an `LLM(enable_lora=True)`). A prompt may
        be vLLM's dict `{"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {"image":
        PIL image | [images]}}` (a vision-language model; one placeholder per image in the text)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt, text or token ids
        if not isinstance(sampling, list):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts")
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} lora_request for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, sp, lora in zip(prompts, sampling, lora_request):
                rid = f"gen-{next(self._ids)}"
                if isinstance(prompt, str) and not prompt:
                    raise ValueError("prompt is empty")
                if isinstance(prompt, str) and self.tokenizer is None:
                    raise ValueError(
                        "LLM(skip_tokenizer_init=True) takes prompts as token ids, not text"
                    )
                ids, mm = self._prompt(prompt)
                self.engine.add_request(ids, sp, request_id=rid, lora_request=lora, mm_inputs=mm)
                order.append(rid)
                results[rid] = RequestOutput(rid, ids, [CompletionOutput(i) for i in range(sp.n)])
        except Exception:
            for rid in order:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        with spaced_young_collections():  # as in the engine-core process (no freeze here)
            for delta in self.engine.stream():
                res = results[delta.request_id]
                out = res.outputs[delta.index]
                out.token_ids.extend(delta.new_token_ids)
                out.text += delta.new_text
                if delta.logprobs:
                    out.logprobs = (out.logprobs or []) + [_as_dict(lp) for lp in delta.logprobs]
                if delta.prompt_logprobs is not None:
                    res.prompt_logprobs = [_as_dict(lp) for lp in delta.prompt_logprobs]
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    if delta.index == 0:
                        res.usage = delta.usage
        return [results[rid] for rid in order]

    def _prompt(self, prompt: str | dict | list[int]) -> tuple[list[int], list[ImageInput]]:
        """Prompt ids and images of one `generate` prompt."""
        if not isinstance(prompt, dict):
            return (self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)), []
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"unknown prompt keys {sorted(unknown)}")
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        data = dict(prompt.get("multi_modal_data") or {})
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(data)}")
        if "image" not in data:
            return self._prompt(text)
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        return with_images(
            text,
            data["image"],
            self.vision,
            encode,
            limit=self.limit_mm_per_prompt.get("image"),
            media=self.media,
        )

    def chat(
        self, messages: list[dict[str, Any]], sampling: SamplingParams | None = None
    ) -> RequestOutput:
        """Renders the checkpoint's chat template (with the generation prompt) and generates.
        A message's `content` may be a list of parts (vLLM's): `{"type": "text", "text"}`,
        `{"type": "image_url", "image_url": {"url": "data:..."}}`, `{"type": "image_pil",
        "image_pil": PIL image}`; each image part becomes the model's placeholder."""
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer; this LLM was built with skip_tokenizer_init=True"
            )
        flat, images = chat_parts(messages, self.vision, self.media)
        text = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True)
        if images:
            sized = [resized(im, self.vision) for im in images]
            text = expand_prompt(text, self.vision, len(images), "messages", sized)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
        return self.generate([prompt if images else ids], sampling)[0]
