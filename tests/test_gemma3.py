"""Gemma 3 config parsing (HF parity of the model itself is in tests/test_model_parity.py).

1. The hub's config.json form (`sliding_window_pattern`, `rope_theta` + `rope_scaling`,
   `rope_local_base_freq`) and transformers 5's form (`layer_types`, per-layer-type
   `rope_parameters`) give the same `ModelConfig`.
2. The multimodal `gemma3` wrapper is read through its `text_config`.
3. Bad fields are refused by name.
"""

from __future__ import annotations

import pytest

from jaxinfer.config import ModelConfig, UnsupportedConfigError
from tests.model_utils import hf_config_dict


def _hub_config(**overrides) -> dict:
    return {**hf_config_dict("gemma3"), "num_hidden_layers": 7, **overrides}


def test_default_pattern_is_five_local_one_global():
    hf = _hub_config()
    del hf["sliding_window_pattern"]
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None, 8)
    assert cfg.local_rope.theta == 100.0 and cfg.local_rope.rope_type == "default"
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "linear"
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.embed_scale and cfg.norm_offset == 1.0
    assert cfg.sm_scale == 24.0**-0.5


def test_transformers5_form_matches_hub_form():
    transformers = pytest.importorskip("transformers")
    hub = _hub_config()
    fields = {k: v for k, v in hub.items() if k != "model_type"}
    written = transformers.Gemma3TextConfig(**fields).to_dict()
    assert "layer_types" in written and "full_attention" in written["rope_parameters"]
    assert ModelConfig.from_hf(written) == ModelConfig.from_hf(hub)


def test_layer_types_override_the_pattern():
    kinds = ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    cfg = ModelConfig.from_hf(_hub_config(layer_types=kinds))
    assert cfg.layer_windows == (None, 8, None, 8, None, 8, None)


def test_defaults_when_fields_are_absent():
    hf = _hub_config()
    for key in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "rope_scaling"):
        del hf[key]
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 10000.0)  # HF Gemma3TextConfig's
    assert cfg.sm_scale == 256**-0.5


def test_multimodal_wrapper_reads_text_config():
    text = {k: v for k, v in _hub_config().items() if k != "model_type"}
    wrapper = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": {**text, "model_type": "gemma3_text"},
               "vision_config": {"model_type": "siglip_vision_model"}}
    assert ModelConfig.from_hf(wrapper) == ModelConfig.from_hf(_hub_config())


@pytest.mark.parametrize("overrides,match", [
    (dict(sliding_window_pattern=0), "sliding_window_pattern"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_bad_fields_are_refused_by_name(overrides, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ModelConfig.from_hf(_hub_config(**overrides))


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration dir (no tokenizer): the text model's logits match HF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from jaxinfer.loader import load_model
    from tests.model_utils import PagedStepper, rel_err

    text = {k: v for k, v in hf_config_dict("gemma3").items() if k != "model_type"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:
                p.copy_((0.1 if p.ndim == 1 else 0.15) * torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, skip_tokenizer_init=True)
    assert loaded.cfg == ModelConfig.from_hf(hf_config_dict("gemma3"))
    toks = [int(t) for t in np.random.default_rng(0).integers(0, 256, 12)]
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float().numpy()
    (ours,) = PagedStepper(loaded.params, loaded.cfg).step([(0, toks)])
    assert rel_err(ours, ref) <= 1e-4
