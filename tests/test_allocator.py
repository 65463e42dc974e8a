"""`jaxinfer.engine.allocator.core_env`: what the engine-core process gets added to its
environment (jemalloc preloaded where found; opt-out; an explicit library; refusals named)."""

from __future__ import annotations

import pytest

from jaxinfer.engine import allocator


def test_jemalloc_first_where_found_unless_told_or_already_preloaded(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "jemalloc", lambda: "libjemalloc.so.2")
    assert allocator.core_env({}) == {"LD_PRELOAD": "libjemalloc.so.2"}
    assert allocator.core_env({"LD_PRELOAD": "libfoo.so"}) == {
        "LD_PRELOAD": "libjemalloc.so.2 libfoo.so"
    }
    assert allocator.core_env({"JAXINFER_MALLOC": "system"}) == {}
    assert allocator.core_env({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so.4"}) == {}
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert allocator.core_env({"JAXINFER_MALLOC": str(lib)}) == {"LD_PRELOAD": str(lib)}
    with pytest.raises(ValueError, match="JAXINFER_MALLOC='/no/such.so'"):
        allocator.core_env({"JAXINFER_MALLOC": "/no/such.so"})
    monkeypatch.setattr(allocator, "jemalloc", lambda: None)
    assert allocator.core_env({}) == {}


def test_the_core_client_sets_the_environment_only_while_the_process_starts(monkeypatch):
    import os

    from jaxinfer.engine import core_client

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    seen = []
    with core_client._environ({"LD_PRELOAD": "libjemalloc.so.2"}):
        seen.append(os.environ.get("LD_PRELOAD"))
    assert seen == ["libjemalloc.so.2"] and "LD_PRELOAD" not in os.environ
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so")
    with core_client._environ({"LD_PRELOAD": "libjemalloc.so.2 libfoo.so"}):
        pass
    assert os.environ["LD_PRELOAD"] == "libfoo.so"
