"""The native CPU kernels build wherever a C++ compiler is present.

The kernel tests skip where the kernels are unavailable (no compiler), so a source that stopped
compiling would otherwise turn them all into skips instead of failures."""

from __future__ import annotations

import pytest

from batchrun.kernels import cpu_native


def test_the_native_kernels_build_wherever_a_compiler_is_present():
    if cpu_native._compiler() is None:
        pytest.skip("no C++ compiler here: the kernels are off by design")
    assert cpu_native.available(), "the native CPU kernels failed to build: see the compiler error logged above"


def test_the_triton_cache_is_held_to_the_private_cache_rule_before_a_triton_kernel_runs(tmp_path, monkeypatch):
    """Triton loads compiled kernels from its cache: like batchrun's own caches it must be this
    user's alone (created 0700, refused when others can write it), checked when a GPU target's
    kernel set is found, before any Triton kernel is bound."""
    pytest.importorskip("triton")
    import stat

    from batchrun.kernels import backend
    from batchrun.kernels.target import SM90, find_target
    from batchrun.utils.private_dir import UnsafeCacheError

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    try:
        backend.triton_installed.cache_clear()
        assert backend.triton_cache_dir() == str(tmp_path / "home" / ".triton" / "cache")  # Triton's default
        assert find_target("cpu", simulate=SM90).runs_triton
        assert stat.S_IMODE((tmp_path / "home" / ".triton" / "cache").stat().st_mode) == 0o700

        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
        backend.triton_installed.cache_clear()
        assert not find_target("cpu").runs_triton  # the CPU's target never reaches Triton, nor its cache
        for _ in range(2):  # refused at every ask, not only the first
            with pytest.raises(UnsafeCacheError, match=r"Triton kernel cache .*shared.*TRITON_CACHE_DIR"):
                find_target("cpu", simulate=SM90)
    finally:
        backend.triton_installed.cache_clear()
