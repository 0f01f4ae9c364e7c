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
    user's alone (created 0700, refused when others can write it), checked at the first dispatch."""
    pytest.importorskip("triton")
    import stat

    import torch

    from batchrun.kernels import backend
    from batchrun.utils.private_dir import UnsafeCacheError

    h200 = backend.GpuTarget((9, 0), 132, backend.MAX_SHARED_PER_BLOCK[(9, 0)])
    x = torch.zeros(1)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    try:
        backend.triton_installed.cache_clear()
        assert backend.triton_cache_dir() == str(tmp_path / "home" / ".triton" / "cache")  # Triton's default
        with backend.simulated_gpu(h200):
            assert backend.triton_usable(x)
        assert stat.S_IMODE((tmp_path / "home" / ".triton" / "cache").stat().st_mode) == 0o700

        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
        backend.triton_installed.cache_clear()
        assert not backend.triton_usable(x)  # a CPU tensor never reaches Triton, nor its cache
        with backend.simulated_gpu(h200):
            for _ in range(2):  # refused at every dispatch, not only the first
                with pytest.raises(UnsafeCacheError, match=r"Triton kernel cache .*shared.*TRITON_CACHE_DIR"):
                    backend.triton_usable(x)
    finally:
        backend.triton_installed.cache_clear()
