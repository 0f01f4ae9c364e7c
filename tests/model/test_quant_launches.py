"""Kernels per quantized linear on the GPU dispatch path, and the Triton kernels that make them few.

An interpreted child (TRITON_INTERPRET=1) builds each mode's projection as the engine does over the
kernel set of a simulated sm_90 GPU and counts what one call launches (benchmarks.gpu_launches: launches_per_linear):
fp8 = the per-token quantization kernel + torch._scaled_mm, W8A8 = quantization + torch._int_mm + the
epilogue (float channels folded into it), weight-only int8/int4 = the one dequantize-GEMM.

The same child checks those kernels against the torch references on CPU tensors
(kernels/quant/triton_act.py): the quantization bitwise (codes and scales, int8 and e4m3, float32,
bf16 and fp16 rows, outlier columns, all-zero and tiny rows, cuBLAS's zero padding rows), the W8A8
epilogue bitwise without float channels, and the fp8 linear bitwise without a bias.
"""

from __future__ import annotations

import json

import pytest

from tests.support.interpreted import interpreted_rows, report_cases, run_interpreted

pytest.importorskip("triton")

LIMITS = {"none": 1, "int8": 1, "int4": 1, "fp8": 2, "w8a8": 3, "w8a8/float": 3}


def test_kernels_per_linear_interpreted():
    counts = interpreted_rows(__file__, "counts", timeout=300)[-1]
    assert set(counts) == set(LIMITS) | {"split_k", "dense"}
    for mode in LIMITS:
        by_bias = counts[mode]
        for row in by_bias:
            assert row["total"] <= LIMITS[mode], (mode, row)
            assert row["copies"] == 0 and row["syncs"] == 0, (mode, row)
    assert counts["fp8"][0]["kernels"] == {"triton:_quantize_rows_kernel": 1, "aten:_scaled_mm": 1}
    assert counts["w8a8/float"][1]["kernels"] == {
        "triton:_quantize_rows_kernel": 1,
        "aten:_int_mm": 1,
        "triton:_w8a8_epilogue_kernel": 1,
    }
    assert counts["int4"][1]["kernels"] == {"triton:_w4a16_kernel": 1}  # the bias in the GEMM's epilogue
    assert counts["split_k"] > 1  # the weight-only counts include split-K's reduction, in the same launch
    # a kernel set bound with dense_min_rows: from that many rows cuBLAS over the copy dequantized at
    # load, below it the fused GEMM
    assert counts["dense"] == {
        "int8 16 rows": {"aten:linear": 1},
        "int8 4 rows": {"triton:_w8a16_kernel": 1},
        "int4 16 rows": {"aten:linear": 1},
        "int4 4 rows": {"triton:_w4a16_kernel": 1},
    }


def test_activation_kernels_match_reference_interpreted():
    proc = run_interpreted(__file__, "cases", timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stdout + proc.stderr
    failed = [f"{r['id']}: {r['msg']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(rows) == len(_cases()), rows


PER_LAYER_GEMMS = {"fp8": {"aten:_scaled_mm": 4}, "w8a8/float": {"aten:_int_mm": 4, "triton:_w8a8_epilogue_kernel": 4}}


@pytest.mark.parametrize("mode", sorted(PER_LAYER_GEMMS))
def test_the_norm_before_qkv_and_gate_up_quantizes_for_them_interpreted(mode):
    """fp8 and W8A8 (with float channels) decoders on the GPU dispatch path: the RMSNorms before
    qkv and gate/up write the quantized rows, so per layer only o_proj and down launch the
    quantization kernel (fp8: qkv and gate/up are torch._scaled_mm alone, W8A8: _int_mm and the
    epilogue), no launch is added for it, and the decode step's logits are bitwise those of the
    unfused path (each linear quantizing its own input)."""
    result = interpreted_rows(__file__, "layers", mode, timeout=300)[-1]
    num_layers = 2
    fused, unfused = result["fused"], result["unfused"]
    assert result["same_logits"]
    assert fused["triton:_quantize_rows_kernel"] == 2 * num_layers, fused  # o_proj and down
    assert unfused["triton:_quantize_rows_kernel"] == 4 * num_layers, unfused
    for name, per_layer in PER_LAYER_GEMMS[mode].items():
        assert fused[name] == unfused[name] == per_layer * num_layers, (name, fused)
    # the fused step is the unfused one less the qkv and gate/up quantization kernels: the norms
    # launch as often as before
    less = {k: unfused.get(k, 0) - fused.get(k, 0) for k in set(fused) | set(unfused)}
    assert {k: v for k, v in less.items() if v} == {"triton:_quantize_rows_kernel": 2 * num_layers}, less
    assert fused["triton:_rms_norm_kernel"] == 2 * num_layers + 1  # and the final norm


def _layers(mode: str) -> dict:
    import torch

    from batchrun.model.quant import layers
    from benchmarks.gpu_launches import decode_step_launches, tiny_decoder

    model = tiny_decoder("llama", 2, torch.bfloat16, quantization=mode)
    fused = decode_step_launches(model, num_seqs=2, context=5)
    cls = layers.Fp8Linear if mode == "fp8" else layers.W8A8Linear
    input_quant = cls.input_quant
    cls.input_quant = lambda self, x: None  # type: ignore[method-assign]  # each linear quantizes
    try:
        unfused = decode_step_launches(model, num_seqs=2, context=5)
    finally:
        cls.input_quant = input_quant  # type: ignore[method-assign]
    return {
        "fused": dict(fused.kernels),
        "unfused": dict(unfused.kernels),
        "same_logits": torch.equal(fused.logits, unfused.logits),
    }


def _cases() -> dict:
    import torch

    cases = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[-1]
        for residual in (False, True):
            cases[f"norm + quantize int8 {name} residual={residual}"] = ("norm", torch.int8, dtype, residual)
            cases[f"norm + quantize fp8 {name} residual={residual}"] = ("norm", torch.float8_e4m3fn, dtype, residual)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[-1]
        cases[f"quantize int8 {name}"] = ("q", torch.int8, dtype, False)
        cases[f"quantize int8 {name} skip"] = ("q", torch.int8, dtype, True)
        cases[f"quantize fp8 {name}"] = ("q", torch.float8_e4m3fn, dtype, False)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        for bias in (False, True):
            cases[f"w8a8 {name} bias={bias}"] = ("w8a8", None, dtype, bias)
            cases[f"w8a8 {name} float channels bias={bias}"] = ("w8a8f", None, dtype, bias)
    for bias in (False, True):
        cases[f"fp8 linear bf16 bias={bias}"] = ("fp8", None, torch.bfloat16, bias)
    return cases


def _rows(dtype, m=7, k=80, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[1] = 0.0  # scale clamped at MIN_SCALE
    x[2] *= 1e-12
    x[3, ::3] *= 1e-6  # tiny entries, some negative ones rounding to (-)0
    x[4, 5] = 300.0  # one large entry sets the step
    return x.to(dtype)


def _run_case(spec) -> None:
    import torch

    from batchrun.kernels import quant as qk
    from batchrun.kernels.quant import triton_act as ta
    from batchrun.kernels.quant.formats import MIN_SCALE

    kind, qdtype, dtype, flag = spec
    if kind == "norm":
        _check_norm_quant(qdtype, dtype, flag)
        return
    if kind == "q":
        x = _rows(dtype)
        skip = None
        if flag:
            skip = torch.zeros(x.shape[1], dtype=torch.bool)
            skip[[0, 5, 17, 79]] = True
        got_q, got_s = ta.quantize_rows(x, qdtype, skip, min_rows=ta.INT_MM_MIN_ROWS)
        if qdtype == torch.int8:
            want_q, want_s = qk.quantize_per_token_int8(x, skip)
        else:
            want_q, want_s = qk.quantize_per_token_fp8(x)
        m = x.shape[0]
        assert got_q.shape == (ta.INT_MM_MIN_ROWS, x.shape[1]) and got_s.shape == (m, 1)
        assert torch.equal(got_s, want_s), (got_s - want_s).abs().max()
        assert torch.equal(got_q[:m].view(torch.uint8), want_q.view(torch.uint8)), "codes differ"
        assert not got_q[m:].view(torch.uint8).any(), "padding rows not zero"
        assert float(got_s[1]) == float(torch.tensor(MIN_SCALE, dtype=torch.float32))
        return
    gen = torch.Generator().manual_seed(1)
    m, k, n = 5, 96, 80
    x = _rows(dtype, m, k, seed=2)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = (torch.randn(n, generator=gen)).to(dtype) if flag else None
    if kind in ("w8a8", "w8a8f"):
        outliers = None
        if kind == "w8a8f":
            from batchrun.model.quant.smoothquant import split_outlier_channels

            w, outliers = split_outlier_channels(w, torch.rand(k, generator=gen), 8)
            outliers.weight_t = outliers.weight_t.to(dtype)
        q, s = qk.quantize_int8(w)
        want = qk.w8a8_matmul(x, q, s, bias, outliers)
        got = ta.w8a8_linear(
            x,
            q,
            s.reshape(-1),
            bias,
            *((outliers.index, outliers.skip, outliers.weight_t) if outliers else (None, None, None)),
        )
        assert got.dtype == want.dtype and got.shape == want.shape
        if outliers is None:  # the same float32 operations in the same order
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        else:  # float channels added before the one rounding, not after
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        return
    q8, s8 = qk.quantize_fp8(w)
    want = qk.fp8_scaled_matmul(x, q8, s8, bias)
    got = ta.fp8_linear(x, q8, s8.t(), bias)
    assert got.dtype == want.dtype and got.shape == want.shape
    if bias is None:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:  # the bias added inside _scaled_mm, before its rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _check_norm_quant(qdtype, dtype, has_residual: bool) -> None:
    """rms_norm_quant against the unfused kernels (add_rms_norm / rms_norm, then quantize_rows of
    the normed rows): normed rows, residual, codes and scales bitwise; int8 with float channels
    skipped and int_mm's zero padding rows, as W8A8 asks, fp8 without."""
    import torch

    from batchrun.kernels import triton_elementwise as tew
    from batchrun.kernels.quant import triton_act as ta
    from batchrun.kernels.quant.act import ActQuant

    h = _rows(dtype, m=7, k=80, seed=3)  # zero, tiny and outlier rows: a zero row normalizes to 0
    residual = (_rows(dtype, m=7, k=80, seed=4) * 0.5) if has_residual else None
    if residual is not None:
        residual[1] = -h[1]  # residual + h == 0: MIN_SCALE
    weight = (torch.rand(80, generator=torch.Generator().manual_seed(5)) + 0.5).to(dtype)
    skip = None
    if qdtype == torch.int8:
        skip = torch.zeros(80, dtype=torch.bool)
        skip[[0, 5, 17, 79]] = True
    quant = ActQuant(qdtype, skip, ta.INT_MM_MIN_ROWS if qdtype == torch.int8 else 0)
    if residual is not None:
        want_out, want_res = tew.add_rms_norm(h.clone(), residual.clone(), weight, 1e-6)
        got, got_res = tew.rms_norm_quant(h.clone(), residual.clone(), weight, 1e-6, quant)
        assert torch.equal(got_res, want_res), "residual differs"
    else:
        want_out = tew.rms_norm(h, weight, 1e-6)
        got, got_res = tew.rms_norm_quant(h, None, weight, 1e-6, quant)
        assert got_res is h
    want_q, want_s = ta.quantize_rows(want_out, qdtype, skip, quant.min_rows)
    assert torch.equal(got.x, want_out), "normed rows differ"
    assert got.q.shape == want_q.shape and got.scale.shape == want_s.shape == (7, 1)
    assert torch.equal(got.scale, want_s), (got.scale - want_s).abs().max()
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)), "codes differ"
    assert got.q.shape[0] == max(7, quant.min_rows) and not got.q[7:].view(torch.uint8).any()


def _counts() -> dict:
    from batchrun.kernels.quant.triton_gemm import default_config
    from benchmarks.gpu_launches import LINEAR_MODES, SM90, launches_per_linear

    out: dict = {"split_k": default_config(4, 64, 512, 32, SM90.num_sms).split_k}
    for mode in LINEAR_MODES:
        out[mode] = []
        for bias in (False, True):
            launches = launches_per_linear(mode, bias=bias)
            out[mode].append(
                {
                    "total": launches.total,
                    "kernels": dict(launches.kernels),
                    "copies": launches.copies,
                    "syncs": launches.syncs,
                }
            )
    out["dense"] = {  # a kernel set bound with cuBLAS over a dequantized copy from 8 rows
        f"{mode} {rows} rows": dict(launches_per_linear(mode, num_tokens=rows, dense_min_rows=8).kernels)
        for mode in ("int8", "int4")
        for rows in (16, 4)
    }
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "counts":
        print(json.dumps(_counts()), flush=True)
    elif sys.argv[1] == "layers":
        print(json.dumps(_layers(sys.argv[2])), flush=True)
    else:
        report_cases(_cases(), _run_case)
