"""tests/conftest.py item 9: a worker's memory mappings come back down when it releases programs."""

import sys

import jax
import jax.numpy as jnp
import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
def test_releasing_unreferenced_programs_unmaps_their_code(monkeypatch) -> None:
    import conftest

    # NOTE: distinct programs, compiled here (not read from JAX's persistent cache), none kept
    for i in range(24):
        jax.jit(lambda x, i=i: jnp.sin(x * (i + 1)) + i).lower(jnp.ones(7 + i)).compile()
        jax.jit(lambda x, i=i: jnp.cos(x) * (i + 2))(jnp.ones(5 + i)).block_until_ready()
    before = conftest._memory_maps()
    monkeypatch.setattr(conftest, "_MAPS_THRESHOLD", 0)
    after = conftest._release_programs_if_many_maps()
    assert after == conftest._memory_maps()
    # each program XLA:CPU loaded maps its code and data (a few mappings); releasing the 24 jitted
    # calls' programs unmaps at least one region each
    assert before - after >= 24, (before, after)
