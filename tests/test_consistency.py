"""Consistency of the ragged paged forward with itself (no reference library needed).

full prefill == prefill + paged decode == chunked prefill (chunks 1, 3, 7) == batched with other
sequences, for page sizes 1, 8 and 16, over a NaN-poisoned cache (every unused page is NaN, so a
read of anything outside a sequence's own pages would show).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import init_random
from tests.model_utils import PagedStepper, hf_config_dict

TOL = 1e-5  # relative to the logit scale: same math, different blocking


@pytest.fixture(scope="module", params=["llama", "gemma2", "gemma3"])
def model(request):
    cfg = ModelConfig.from_hf(hf_config_dict(request.param))
    params = init_random(llama.param_specs(cfg), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda x: x * 6.0, params)  # peaky logits
    return cfg, params


def _toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _close(a, b):
    scale = np.max(np.abs(b))
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=TOL * scale, rtol=0)


@pytest.mark.parametrize("page_size", [1, 8, 16])
def test_chunked_and_decode_equal_full(model, page_size):
    cfg, params = model
    toks = _toks(23, 0)
    (full,) = PagedStepper(params, cfg, page_size=page_size).step([(0, toks)])
    for chunk in (1, 3, 7):
        stepper = PagedStepper(params, cfg, page_size=page_size, seed=chunk)
        got = []
        for i in range(0, len(toks), chunk):
            got.extend(stepper.step([(0, toks[i : i + chunk])]))
        _close(np.concatenate(got), full)


def test_batched_with_others_equals_alone(model):
    cfg, params = model
    a, b, c = _toks(17, 1), _toks(5, 2), _toks(30, 3)
    alone = [PagedStepper(params, cfg, page_size=8).step([(0, t)])[0] for t in (a, b, c)]
    stepper = PagedStepper(params, cfg, page_size=8, seed=5)
    # step 1: b whole, a's first 9 tokens, c's first 4; step 2: decodes of b interleaved with chunks
    out1 = stepper.step([(1, b), (0, a[:9]), (2, c[:4])], pad_tokens=5, pad_seqs=2)
    out2 = stepper.step([(0, a[9:]), (2, c[4:])])
    _close(np.concatenate([out1[1], out2[0]]), alone[0])
    _close(out1[0], alone[1])
    _close(np.concatenate([out1[2], out2[1]]), alone[2])


def test_decode_batch_mixed_with_prefill(model):
    cfg, params = model
    a, b = _toks(12, 7), _toks(9, 8)
    ref_a = PagedStepper(params, cfg, page_size=4).step([(0, a)])[0]
    ref_b = PagedStepper(params, cfg, page_size=4).step([(1, b)])[0]
    stepper = PagedStepper(params, cfg, page_size=4, seed=9)
    got_a = stepper.step([(0, a[:8])])
    got_b = []
    for i in range(4):  # a decodes one token per step while b prefills in chunks beside it
        out = stepper.step(
            [(0, [a[8 + i]]), (1, b[i * 3 : i * 3 + 3])] if i < 3 else [(0, [a[8 + i]])]
        )
        got_a.append(out[0])
        if i < 3:
            got_b.append(out[1])
    _close(np.concatenate(got_a), ref_a)
    _close(np.concatenate(got_b), ref_b)
