"""The model registry: every supported HF model_type maps to its family; an unknown one raises
naming it and listing the supported ones; one `LlamaLike` declaration is all a new llama-like
family needs to load (config -> registry -> loader -> weights) and run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxinfer.config import ModelConfig, UnsupportedConfigError
from jaxinfer.models import deepseek, family_of, llama, registry
from jaxinfer.models.llama_config import LlamaLike, declaration, register_llama_like
from tests.model_utils import (
    DEEPSEEK_FAMILIES,
    FAMILIES,
    MOE_FAMILIES,
    PagedStepper,
    hf_config_dict,
    hf_logits,
    make_hf_model,
    rel_err,
)

LLAMA_LIKE = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "qwen2_5_vl_text",
    "qwen2_5_vl",
    "mixtral",
    "qwen3_moe",
)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def test_the_registered_model_types_and_architectures():
    assert set(registry.supported_model_types()) == {*LLAMA_LIKE, "deepseek_v2", "deepseek_v3"}
    for arch, model_type in ARCHITECTURES.items():
        assert registry.family(None, [arch]).model_type == model_type
    for model_type in LLAMA_LIKE:
        assert registry.family(model_type).module == "jaxinfer.models.llama"


@pytest.mark.parametrize("name", [*FAMILIES, *MOE_FAMILIES, *DEEPSEEK_FAMILIES])
def test_every_tested_config_maps_to_its_family(name):
    hf = hf_config_dict(name)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.model_type == hf["model_type"]
    assert family_of(cfg) is (deepseek if cfg.model_type.startswith("deepseek") else llama)
    # Without `model_type`, a registered `architectures` name finds the same family.
    arch = next(a for a, t in ARCHITECTURES.items() if t == hf["model_type"])
    bare = {k: v for k, v in hf.items() if k != "model_type"}
    assert ModelConfig.from_hf({**bare, "architectures": [arch]}) == cfg


def test_unknown_model_type_raises_naming_it_and_listing_the_supported_ones():
    hf = {**hf_config_dict("llama"), "model_type": "gpt_neox", "architectures": ["GPTNeoX"]}
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt_neox'") as err:
        ModelConfig.from_hf(hf)
    message = str(err.value)
    assert "GPTNeoX" in message
    for model_type in registry.supported_model_types():
        assert model_type in message
    for arch in ARCHITECTURES:
        assert arch in message
    llama_cfg = ModelConfig.from_hf(hf_config_dict("llama"))
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt_neox'"):
        family_of(dataclasses.replace(llama_cfg, model_type="gpt_neox"))
    with pytest.raises(ValueError, match="already registered"):
        register_llama_like(LlamaLike("llama"))
    with pytest.raises(UnsupportedConfigError, match="not a llama-like family"):
        declaration("deepseek_v3")


@pytest.fixture
def toy_family():
    """A llama-like family declared here only: Llama's layout under a model_type of its own."""
    decl = register_llama_like(LlamaLike("toy_llama", ("ToyLlamaForCausalLM",), rope_theta=5e5))
    try:
        yield decl
    finally:
        registry.unregister("toy_llama")
    assert "toy_llama" not in registry.supported_model_types()


def _toy_config(tmp_path, **extra):
    hf = {**hf_config_dict("llama"), **extra, "model_type": "toy_llama"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return hf


def test_a_declared_family_parses_loads_dummy_weights_and_runs(toy_family, tmp_path):
    from jaxinfer.loader import load_model

    hf = _toy_config(tmp_path)
    hf.pop("rope_theta")
    assert ModelConfig.from_hf(hf).rope.theta == 5e5  # the declaration's default
    loaded = load_model(tmp_path, dtype="float32", load_format="dummy", skip_tokenizer_init=True)
    cfg = loaded.cfg
    assert cfg.model_type == "toy_llama" and family_of(cfg) is llama
    assert cfg == ModelConfig.from_hf({**hf_config_dict("llama"), "model_type": "toy_llama"})
    (logits,) = PagedStepper(loaded.params, cfg).step([(0, [1, 2, 3, 4, 5])])
    assert logits.shape == (5, cfg.vocab_size) and np.isfinite(logits).all()


def test_a_declared_family_loads_a_checkpoint_and_matches_transformers(toy_family, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxinfer.loader import load_model

    model, _ = make_hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "toy_llama"}))
    loaded = load_model(tmp_path, dtype="float32", skip_tokenizer_init=True)
    assert loaded.cfg.model_type == "toy_llama"
    tokens = [3, 17, 42, 9, 100, 7]
    (ours,) = PagedStepper(loaded.params, loaded.cfg).step([(0, tokens)])
    assert rel_err(ours, hf_logits(model, tokens)) < 1e-4
