"""Guards on the compiled step's HLO: the donated KV cache is updated in place, never copied.

A whole-cache copy per step is invisible in the outputs but costs O(cache size) per token (it
happened once: scattering through a flattened cache view let XLA:CPU duplicate the update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import abstract
from jaxinfer.step import StepInputs, build_step_arrays
from tests.model_utils import hf_config_dict

NUM_PAGES, PAGE_SIZE = 1024, 16


def _cache_copies(num_tokens: int, num_seqs: int, pages_per_seq: int = 16) -> int:
    hf = {**hf_config_dict("llama"), "num_hidden_layers": 4}
    cfg = ModelConfig.from_hf(hf)
    shape = (NUM_PAGES, PAGE_SIZE, 2 * cfg.num_kv_heads, cfg.head_dim)
    caches = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(cfg.num_layers))
    arrays = build_step_arrays(
        [(list(range(num_tokens)), 3, list(range(1, 9)))],
        PAGE_SIZE,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
    )
    step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays.items()})
    hlo = (
        llama.forward_jit.lower(abstract(llama.param_specs(cfg)), cfg, step, caches)
        .compile()
        .as_text()
    )
    entry = hlo[hlo.find("ENTRY") :]
    dims = ",".join(map(str, shape))
    return sum(1 for line in entry.splitlines() if " copy(" in line and f"[{dims}]" in line)


# (1, 1, 8) and (1, 1, 12): a decode whose KV block would span the whole page table (XLA:CPU
# hoisted that loop-invariant gather and copied the cache).
@pytest.mark.parametrize(
    "num_tokens,num_seqs,pages_per_seq",
    [(1, 1, 16), (1, 2, 16), (8, 8, 16), (32, 4, 16), (1, 1, 8), (1, 1, 12)],
)
def test_step_updates_cache_in_place(num_tokens, num_seqs, pages_per_seq):
    assert _cache_copies(num_tokens, num_seqs, pages_per_seq) == 0


@pytest.mark.parametrize(
    "t_bucket,all_logits,page_bucket",
    [(1, False, None), (8, False, None), (8, True, None), (1, False, 2), (8, False, 4)],
)
def test_runner_step_updates_donated_state_in_place(t_bucket, all_logits, page_bucket):
    """The whole runner program (forward + penalty bookkeeping + sampler) copies no big buffer,
    also with page tables narrower than max_model_len (page buckets)."""
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.params import init_random

    cfg = ModelConfig.from_hf({**hf_config_dict("llama"), "num_hidden_layers": 2})
    params = init_random(llama.param_specs(cfg), jax.random.PRNGKey(0))
    runner = ModelRunner(
        cfg,
        params,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=8,
    )
    hlo = runner.lower(t_bucket, all_logits, page_bucket).compile().as_text()
    entry = hlo[hlo.find("ENTRY") :]
    big = [f"[{NUM_PAGES},{PAGE_SIZE},", f"[9,{cfg.vocab_size}]"]  # KV cache, penalty rows
    copies = [
        line for line in entry.splitlines() if " copy(" in line and any(b in line for b in big)
    ]
    assert not copies, copies[:2]


def test_packed_step_inputs_round_trip():
    """The runner's one-buffer-per-dtype transfer gives the program exactly the host arrays."""
    import numpy as np

    from jaxinfer.engine.runner import programs

    rng = np.random.default_rng(0)
    inputs = {
        "step": {
            "ids": rng.integers(0, 100, 7).astype(np.int32),
            "table": rng.integers(0, 9, (3, 4)).astype(np.int32),
        },
        "meta": (
            rng.standard_normal(5).astype(np.float32),
            np.array([True, False, True]),
            np.zeros((2, 0), np.float32),
            np.float32(0.5),
        ),
    }
    buffers, layout = programs.pack(inputs)
    assert len(buffers) == 3  # int32, float32, bool
    hash(layout)  # a static jit argument
    out = jax.jit(programs.unpack_buffers, static_argnums=1)(
        tuple(map(jnp.asarray, buffers)), layout
    )
    want, got = jax.tree.leaves(inputs), jax.tree.leaves(out)
    assert jax.tree.structure(out) == jax.tree.structure(inputs)
    for w, g in zip(want, got, strict=True):
        assert g.shape == np.shape(w) and g.dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)
