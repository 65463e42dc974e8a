"""`pallas_kernels.cpu_build`: a kernel that cannot build is tried once per machine and key.

A source that fails to compile (here an `#error`, as the linear kernel does without AVX2 + FMA)
leaves a `.failed` file beside where the library would be; the next build of the same key raises
the same message without running the compiler (every server and test process would otherwise
spend seconds on it), and a changed source is a new key that compiles again.
"""

from __future__ import annotations

import subprocess

import pytest

from pallas_kernels import cpu_build


def test_a_failed_build_is_remembered_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.cc"
    source.write_text('#error "this kernel needs an instruction set this machine lacks"\n')
    kernel = cpu_build.CppKernel(source, "Handler", "jaxinfer_test_broken")
    cxx = cpu_build._compiler()  # noqa: SLF001
    with pytest.raises(RuntimeError, match="needs an instruction set") as first:
        kernel._build(cxx)  # noqa: SLF001
    assert len(list((tmp_path / "cache").glob("broken_*.failed"))) == 1

    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler ran again for a key that already failed")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    with pytest.raises(RuntimeError) as again:
        kernel._build(cxx)  # noqa: SLF001
    assert str(again.value) == str(first.value)
    source.write_text('#error "a new source is a new key"\n')
    with pytest.raises(AssertionError, match="compiler ran again"):
        kernel._build(cxx)  # noqa: SLF001
