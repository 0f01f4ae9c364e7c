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
