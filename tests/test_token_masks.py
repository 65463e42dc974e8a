"""`TokenMasks` (pure numpy): allowed_token_ids and bad_words as rows of the sampler's bitmask,
and the front end's checks of priority under `--scheduling-policy fcfs` and of `cache_salt`."""

from __future__ import annotations

import pytest

from jaxinfer.engine.limits import EngineLimits
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import allowed_ids
from jaxinfer.token_masks import TokenMasks
from serving.errors import InvalidArgument
from serving.validation import HTTP, check_request

V = 100


def test_allowed_ids_and_bad_words_shape_each_row() -> None:
    masks = TokenMasks(V)
    assert not masks.add("a", SamplingParams(allowed_token_ids=[3, 64, 99]))
    assert not masks.add("b", SamplingParams(bad_words_token_ids=[[7], [1, 2, 9]]))
    assert not masks.add("plain", SamplingParams())
    assert masks.active and masks.has("a") and masks.has("b") and not masks.has("plain")
    rows = masks.fill(["a", "b", "plain"])
    assert allowed_ids(rows[0], V).tolist() == [3, 64, 99]
    assert set(range(V)) - set(allowed_ids(rows[1], V).tolist()) == {7}  # one-token word: always
    assert len(allowed_ids(rows[2], V)) == V
    masks.advance("b", [5, 1])
    assert 9 in allowed_ids(masks.fill(["b"])[0], V)  # the output does not end in "1 2"
    masks.advance("b", [2])
    assert 9 not in allowed_ids(masks.fill(["b"])[0], V)  # "1 2": 9 would complete the word
    masks.advance("b", [4])
    assert 9 in allowed_ids(masks.fill(["b"])[0], V)  # the tail no longer ends in "1 2"
    masks.advance("b", [1, 2])
    assert 9 not in allowed_ids(masks.fill(["b"])[0], V)
    masks.remove("a")
    masks.remove("b")
    assert not masks.active


def test_structured_outputs_need_a_tokenizer() -> None:
    from jaxinfer.sampling_params import StructuredOutputsParams

    masks = TokenMasks(V)
    with pytest.raises(ValueError, match="tokenizer"):
        masks.add("g", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not masks.has("g")


def test_priority_needs_the_priority_policy_and_salts_are_bounded() -> None:
    limits = EngineLimits(vocab_size=V, max_model_len=64, page_size=4, num_pages=32)
    kw = dict(has_tokenizer=True, max_in_flight=8)
    check_request([1, 2], SamplingParams(), 3, limits, HTTP, **kw)
    check_request([1, 2], SamplingParams(), 0, limits, HTTP, priority_scheduling=False, **kw)
    with pytest.raises(InvalidArgument, match="scheduling-policy") as info:
        check_request([1, 2], SamplingParams(), 3, limits, HTTP, priority_scheduling=False, **kw)
    assert info.value.field == "priority"
    with pytest.raises(InvalidArgument) as info:
        check_request([1, 2], SamplingParams(), 0, limits, HTTP, cache_salt="", **kw)
    assert info.value.field == "cache_salt"
