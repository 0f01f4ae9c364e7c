"""The native W8A8 helpers (csrc/quant.cpp): per-token int8 quantization and the int32 -> float
epilogue must be bitwise equal to the plain-torch code they replace (kernels/quant.py). `native=True`
is how a CPU kernel set with the kernels on binds them; the default is the torch code."""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_native
from batchrun.kernels import quant as qk
from batchrun.kernels.quant import w8a8

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: the native kernels are not built")


def _torch_path(monkeypatch, fn, *args):
    """fn without its native passes (its default), checked to call none of them."""
    calls = []
    for name in ("_quantize_per_token_int8_native",):
        real = getattr(w8a8, name)
        monkeypatch.setattr(w8a8, name, lambda *a, _real=real: calls.append(1) or _real(*a))
    try:
        return fn(*args)
    finally:
        monkeypatch.undo()
        assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 576), (7, 100), (33, 1536), (64, 2048)])
def test_per_token_quantization_is_bitwise_equal_to_torch(monkeypatch, dtype, m, k):
    gen = torch.Generator().manual_seed(m * k)
    wide = (torch.randn(m, k + 9, generator=gen) * torch.logspace(-3, 2, m)[:, None]).to(dtype)
    x = wide[:, 3 : 3 + k]  # rows further apart than their length
    x[0, :5] = 0
    if m > 2:
        x[2] = 0  # an all-zero row: the minimum scale
    got_q, got_s = qk.quantize_per_token_int8(x, native=True)
    want_q, want_s = _torch_path(monkeypatch, qk.quantize_per_token_int8, x)
    assert torch.equal(got_s, want_s) and got_s.shape == (m, 1)
    assert torch.equal(got_q, want_q) and got_q.dtype == torch.int8


def test_round_half_to_even_like_torch(monkeypatch):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5]])  # scale 1: exact halves
    got_q, _ = qk.quantize_per_token_int8(x, native=True)
    assert got_q.tolist() == [[127, 0, 2, 2, 0, -2, 126, -126]]
    assert torch.equal(got_q, _torch_path(monkeypatch, qk.quantize_per_token_int8, x)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_w8a8_matmul_is_bitwise_equal_to_torch(monkeypatch, dtype, with_bias, m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(96, 80, generator=gen)
    qweight, scales = _per_channel(w)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(m, 80, generator=gen).to(dtype)
    got = qk.w8a8_matmul(x, qweight, scales, bias, native=True)
    want = _torch_path(monkeypatch, qk.w8a8_matmul, x, qweight, scales, bias)
    assert got.dtype == dtype and torch.equal(got, want)
    # and it is the int8 product it claims to be
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()


def _per_channel(w):
    scales = (w.abs().amax(dim=1, keepdim=True) / qk.INT8_MAX).clamp(min=1e-10)
    return torch.round(w / scales).clamp(-127, 127).to(torch.int8), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_that_skips_outlier_columns_is_bitwise_equal_to_torch(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, 200, generator=gen).to(dtype)
    skip = torch.zeros(200, dtype=torch.bool)
    skip[[0, 17, 199]] = True
    x[:, skip] *= 100  # the skipped columns must not set the scale
    got_q, got_s = qk.quantize_per_token_int8(x, skip, native=True)
    want_q, want_s = _torch_path(monkeypatch, qk.quantize_per_token_int8, x, skip)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    assert torch.all(got_q[:, skip] == 0)
    torch.testing.assert_close(got_s, x.float().masked_fill(skip, 0).abs().amax(-1, keepdim=True) / 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matmul_with_float_channels_is_bitwise_equal_to_torch(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(96, 80, generator=gen)
    index = torch.tensor([2, 40, 79])
    skip = torch.zeros(80, dtype=torch.bool)
    skip[index] = True
    qweight, scales = _per_channel(w.masked_fill(skip, 0))
    outliers = qk.OutlierChannels(index, skip, w[:, index].t().contiguous().to(dtype))
    x = torch.randn(12, 80, generator=gen).to(dtype)
    got = qk.w8a8_matmul(x, qweight, scales, None, outliers, native=True)
    want = _torch_path(monkeypatch, qk.w8a8_matmul, x, qweight, scales, None, outliers)
    assert got.dtype == dtype and torch.equal(got, want)
    ref = x.float() @ w.t()
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,num_float", [(1, 576, 64), (9, 100, 7), (40, 1536, 64)])
def test_quantization_with_float_channels_gathers_them_in_the_same_pass(monkeypatch, dtype, m, k, num_float):
    gen = torch.Generator().manual_seed(k + num_float)
    wide = (torch.randn(m, k + 5, generator=gen) * 3).to(dtype)
    x = wide[:, 2 : 2 + k]  # rows further apart than their length
    index = torch.randperm(k, generator=gen)[:num_float].sort().values
    skip = torch.zeros(k, dtype=torch.bool)
    skip[index] = True
    outliers = qk.OutlierChannels(index, skip, torch.randn(num_float, 8, generator=gen).to(dtype))
    calls = []
    real = w8a8._quantize_per_token_int8_native
    monkeypatch.setattr(w8a8, "_quantize_per_token_int8_native", lambda *a: calls.append(len(a)) or real(*a))
    got = qk.quantize_with_outliers(x, outliers, native=True)
    assert calls == [3]  # the native pass, with the gather
    want = _torch_path(monkeypatch, qk.quantize_with_outliers, x, outliers)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(got[2], x[:, index])
