"""Logit parity with Hugging Face transformers on tiny random models of every supported family."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxinfer.config import ModelConfig  # noqa: E402
from tests.model_utils import (  # noqa: E402
    FAMILIES,
    PagedStepper,
    hf_config_dict,
    hf_logits,
    make_hf_model,
    params_from_torch,
    rel_err,
)

TOL = 1e-4  # of the logit scale, f32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    model, _ = make_hf_model(request.param)
    cfg = ModelConfig.from_hf(hf_config_dict(request.param))
    return request.param, model, cfg, params_from_torch(model, cfg)


def _tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_prefill(family):
    name, model, cfg, params = family
    toks = _tokens(16, 1)  # longer than the 8-token sliding windows; the decodes' 16-token bucket
    (ours,) = PagedStepper(params, cfg).step([(0, toks)])
    err = rel_err(ours, hf_logits(model, toks))
    print(f"{name}: prefill parity error {err:.2e}")
    assert err <= TOL


def test_prefill_then_paged_decode(family):
    _, model, cfg, params = family
    toks = _tokens(22, 2)
    ref = hf_logits(model, toks)
    stepper = PagedStepper(params, cfg, page_size=4)
    (first,) = stepper.step([(0, toks[:14])])
    got = [first]
    for i in range(14, 22):  # 8 decode steps
        got.extend(stepper.step([(0, [toks[i]])]))
    assert rel_err(np.concatenate(got), ref) <= TOL


def test_two_sequences_one_ragged_step(family):
    _, model, cfg, params = family
    a, b = _tokens(10, 3), _tokens(5, 4)  # 10 + 5 + 1 padding: the 16-token bucket
    out_a, out_b = PagedStepper(params, cfg).step([(0, a), (1, b)], pad_tokens=1, pad_seqs=1)
    assert rel_err(out_a, hf_logits(model, a)) <= TOL
    assert rel_err(out_b, hf_logits(model, b)) <= TOL
