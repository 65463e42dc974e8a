"""`scripts/bench_host.py` times the engine's host work alone: its runner's step program is a
fake of the real one's shapes, which never compiles or runs (when the runner began calling its
programs through a `ProgramTable` the fake was bypassed and the bench timed the tiny model's
device step too: 268 ms a step at 256 sequences instead of ~1.3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine_utils import compile_events

from jaxinfer.sampling_params import SamplingParams
from tests.script_utils import script


def test_every_step_is_the_fakes_and_no_step_program_compiles():
    bench = script("bench_host")
    from jaxinfer.model_info import load_model_info

    try:
        model = load_model_info(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    args = SimpleNamespace(page_size=16, max_num_batched_tokens=32)
    engine = bench.make_engine(args, model, 2, 64)
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    with compile_events() as compiles:
        engine.add_request(list(range(1000, 1020)), sp, request_id="a")
        engine.add_request(list(range(2000, 2009)), sp, request_id="b")
        while engine.has_unfinished():
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
    assert tokens == {"a": [bench.FILL_TOKEN] * 6, "b": [bench.FILL_TOKEN] * 6}
    assert not [name for name in compiles if "step_program" in name], compiles
