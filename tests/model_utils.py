"""Test helpers: tiny HF configs per family, HF -> jaxinfer params, and a minimal paged stepper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.models import family_of
from jaxinfer.step import StepInputs, build_step_arrays

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# family name -> HF config kwargs (beyond BASE)
FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "llama3_rope": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama_linear_rope": dict(
        model_type="llama", rope_scaling=dict(rope_type="linear", factor=4.0)
    ),
    "llama_yarn_rope": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ),
    "smollm2": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=1),
    "mistral": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "gemma": dict(
        model_type="gemma",
        tie_word_embeddings=True,
        num_key_value_heads=1,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma2": dict(
        model_type="gemma2",
        num_hidden_layers=4,
        tie_word_embeddings=True,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    # 2 sliding : 1 global (sliding_window_pattern=3); local and global RoPE bases differ, the
    # global one linearly scaled; QK-norm, sandwich norms, query_pre_attn_scalar.
    "gemma3": dict(
        model_type="gemma3_text",
        num_hidden_layers=4,
        tie_word_embeddings=True,
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=24,
        rope_theta=1e6,
        rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=4.0),
        hidden_activation="gelu_pytorch_tanh",
    ),
}


# MoE families (tests/test_moe.py); kept apart so test_model_parity's dense sweep stays as it is.
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=None,
        rope_theta=1e6,
    ),
    # layer 1 dense (mlp_only_layers), top-3 without renormalisation
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse; renormalised top-2
    "qwen3_moe_step2": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
}


# DeepSeek (MLA + MoE with shared experts; tests/test_deepseek.py): layer 0 dense
# (first_k_dense_replace), layers 1-2 sparse. V3: q_lora, sigmoid + correction bias, noaux_tc groups,
# YaRN with mscale (softmax scale included), routed scaling. V2: no q_lora (V2-Lite), softmax,
# group-limited greedy, two shared experts.
_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
)
DEEPSEEK_FAMILIES: dict[str, dict] = {
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        **_MLA,
        q_lora_rank=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        **_MLA,
        q_lora_rank=None,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
    ),
}


def hf_config_dict(family: str) -> dict:
    return {
        **BASE,
        **(FAMILIES.get(family) or MOE_FAMILIES.get(family) or DEEPSEEK_FAMILIES[family]),
    }


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random HF model in f32 with weights scaled so the logits are far from flat."""
    import torch
    import transformers

    cfg_dict = {**hf_config_dict(family), **overrides}
    model_type = cfg_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                base = 0.0 if gemma else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: HF inits it to zeros
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model, config


def params_from_torch(model, cfg: ModelConfig, dtype=jnp.float32):
    sd = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return family_of(cfg).params_from_hf(cfg, sd.keys(), sd.__getitem__, dtype)


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


class PagedStepper:
    """Runs ragged steps over a NaN-poisoned paged cache; pages handed out in shuffled order."""

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        *,
        page_size: int = 4,
        num_pages: int = 64,
        seed: int = 0,
        dtype=jnp.float32,
        attention_backend: str | None = None,
        mesh=None,
        min_tokens: int = 16,
    ):
        """`mesh`: run the sharded forward (params already placed on it; caches split here).
        `min_tokens`: the smallest token bucket (below 16 a decode step runs as few rows, e.g. the
        CPU linear kernel's <= 8-row path)."""
        self.params, self.cfg, self.page_size = params, cfg, page_size
        self.min_tokens = min_tokens
        self.attention_backend = attention_backend
        self.family = family_of(cfg)
        self.mesh = mesh
        par = shd.Parallel.from_mesh(mesh)
        backend = attention_backend or "reference"
        shape = self.family.kv_cache_shape(cfg, backend, num_pages, page_size, par)
        self.caches = tuple(jnp.full(shape, jnp.nan, dtype) for _ in range(cfg.num_layers))
        if mesh is not None:
            spec = self.family.kv_cache_spec(cfg, par, backend)
            self.caches = jax.device_put(self.caches, NamedSharding(mesh, spec))
        self.free = list(np.random.default_rng(seed).permutation(num_pages))
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.pages_per_seq = -(-64 // page_size)

    def step(
        self,
        chunks: list[tuple[int, list[int]]],
        pad_tokens: int = 0,
        pad_seqs: int = 0,
        lora_slots: dict[int, int] | None = None,
    ) -> list[np.ndarray]:
        """chunks: (seq_id, new tokens). Returns the logits of every new token, per chunk.
        `lora_slots`: seq_id -> LoRA slot (params with stacks attached; others get slot 0)."""
        seqs = []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * self.page_size < start + len(toks):
                pages.append(int(self.free.pop()))
            seqs.append((list(toks), start, list(pages)))
            self.lens[sid] = start + len(toks)
        n = sum(len(t) for t, _, _ in seqs)
        # Pad to a few fixed buckets so a test compiles a handful of programs, not one per step;
        # 16 tokens at least (`min_tokens`), so a short prefill and the decode steps after it share
        # one program.
        t_bucket = max(self.min_tokens, 1 << (n + pad_tokens - 1).bit_length())
        arrays = build_step_arrays(
            seqs,
            self.page_size,
            num_tokens=t_bucket,
            num_seqs=max(4, len(seqs) + pad_seqs),
            pages_per_seq=max(self.pages_per_seq, max(len(p) for _, _, p in seqs)),
            logits_rows=list(range(n)),
            num_logits=t_bucket,
        )
        if lora_slots is not None:
            slots = np.zeros(t_bucket, np.int32)
            t = 0
            for (sid, _), (toks, _, _) in zip(chunks, seqs):
                slots[t : t + len(toks)] = lora_slots.get(sid, 0)
                t += len(toks)
            arrays["lora_slots"] = slots
        step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays.items()})
        # NOTE: the backend goes as a keyword only when asked for: tests/test_kernels.py swaps
        # forward_jit for a 4-argument function that fixes its own.
        kw = {} if self.attention_backend is None else {"attention_backend": self.attention_backend}
        if self.mesh is not None:
            kw["mesh"] = self.mesh
        logits, self.caches = self.family.forward_jit(
            self.params, self.cfg, step, self.caches, **kw
        )
        logits = np.asarray(logits)
        out, t = [], 0
        for toks, _, _ in seqs:
            out.append(logits[t : t + len(toks)])
            t += len(toks)
        return out


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Max abs error relative to the logit scale (max |ref|)."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def jax_devices_count() -> int:
    return len(jax.devices())


def check_dummy_load(family: str, root, mesh: str = "", generate: str | None = None) -> None:
    """`load_format="dummy"` from a directory holding only the config.json of a tiny HF `family`
    checkpoint: the real load's tree, shapes, dtypes and shardings on `mesh`, finite random
    values. `generate="placeholder"`: `LLM` over it (one device) generates in-vocabulary ids with
    finite logprobs, rendered as `<id>`; `generate="ids"`: the same with `skip_tokenizer_init`,
    empty text."""
    import shutil

    from jaxinfer import sharding as shd
    from jaxinfer.llm import LLM
    from jaxinfer.loader import load_model
    from jaxinfer.sampling_params import SamplingParams

    model, _ = make_hf_model(family)
    real_dir, bare = root / "real", root / "config_only"
    model.save_pretrained(real_dir, safe_serialization=True)
    bare.mkdir()
    shutil.copy(real_dir / "config.json", bare / "config.json")
    mesh_obj = shd.make_mesh(mesh or None)
    real = load_model(real_dir, dtype="float32", mesh=mesh_obj, skip_tokenizer_init=True)
    dummy = load_model(
        bare, dtype="float32", mesh=mesh_obj, load_format="dummy", skip_tokenizer_init=True
    )
    assert dummy.cfg == real.cfg and dummy.tokenizer is None and dummy.source == "dummy"
    got = jax.tree_util.tree_flatten_with_path(dummy.params)[0]
    want = jax.tree_util.tree_flatten_with_path(real.params)[0]
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, x), (_, y) in zip(got, want):
        name = jax.tree_util.keystr(path)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), name
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), name
        v = np.asarray(x)
        assert np.isfinite(v).all(), name
        if v.ndim > 1:
            assert v.std() > 0, name
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    engine = dict(  # NOTE: one 8-token bucket: the 5-token prefill and the decodes, one program
        page_size=4,
        num_pages=16,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        token_buckets=(8,),
    )
    vocab = real.cfg.vocab_size
    if generate is None:
        return
    llm = LLM(str(bare), load_format="dummy", skip_tokenizer_init=generate == "ids", **engine)
    for o in llm.generate([[5, 6, 7], [9, 10]], sp):
        assert len(o.token_ids) == 4 and all(0 <= t < vocab for t in o.token_ids)
        assert all(np.isfinite(v) for lp in o.logprobs for v in lp.values())
        if generate == "ids":
            assert o.text == ""
        else:
            assert o.text.split() == [f"<{t}>" for t in o.token_ids]
