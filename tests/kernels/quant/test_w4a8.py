"""W4A8: int4 weights and int8 activations, both in groups of 32 along K (kernels/quant/w4a8.py:
quantize_groups_int8, w4a8_matmul, w4a8_matmul_native; model/quant.py: W4A8Linear).

The integer dot product of each group is exact, so every output is the float sum
sum_g (dot_g * x_scale) * w_scale + w_min * x_sum, here computed in float64 as the "exact" value:
the native kernel sums it in float32 and rounds to bf16 once (within half a bf16 step plus the
float32 sums' error), the reference in a float32 matmul. Row counts cover the kernel's 6-row micro
tails (1-6), whole and partial 12-row blocks, and rows split across threads (more than 96).
"""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_native
from batchrun.kernels import quant as qk
from batchrun.kernels.quant import w4a8 as w4
from batchrun.model import quant as mq
from batchrun.model.prepare import quantize_model
from tests.support.engines import make_tiny_engine

BF16 = torch.bfloat16

needs_native_w4a8 = pytest.mark.skipif(
    not w4.w4a8_native_supported(32, 64), reason="native kernels not built here, or built without AVX512-VNNI"
)


def _weight(n: int, k: int, seed: int = 0) -> mq.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5 + 0.02 * torch.randn(n, 1, generator=g)  # offset rows: mins matter
    return mq.quantize_weight(w, "int4", 32)


def _activations(rows: int, k: int, seed: int = 1, dtype: torch.dtype = BF16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.2, 4.0, k)  # uneven channels
    if rows > 2:
        x[1] = 0.0  # an all-zero row: scales clamp, sums are 0
        x[2, :32] *= 50.0  # one loud group: per-group scales keep the other groups' steps fine
    return x.to(dtype)


def _exact(x: torch.Tensor, qw: mq.QuantizedWeight, bias=None) -> torch.Tensor:
    """The W4A8 value in float64: the grouped int8 activations times the int4 weight."""
    xq, xs, _ = w4.quantize_groups_int8(x)
    m, k = xq.shape
    xd = (xq.double().reshape(m, k // 32, 32) * xs.double()[..., None]).reshape(m, k)
    y = xd @ qw.dequantize(torch.float64).t()
    return y if bias is None else y + bias.double()


def _assert_one_rounding_of(got: torch.Tensor, exact: torch.Tensor) -> None:
    bound = exact.abs() * 2.0**-8 + 1e-5 * exact.abs().amax()  # half a bf16 step, plus float32 sums
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())


# ---- activation quantization in groups ------------------------------------------------------


needs_native = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built here")


def _bitwise(x: torch.Tensor, group: int, monkeypatch) -> None:
    native = w4.quantize_groups_int8(x, group, native=True)  # as a CPU kernel set with the kernels on binds it
    torch_code = w4.quantize_groups_int8(x, group)
    assert all(torch.equal(a, b) for a, b in zip(native, torch_code))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 7, 40, 600])  # 600 x 128: the rows split across threads
@pytest.mark.parametrize("group", [32, 64])  # 32: the AVX-512 path, 64: the generic one
def test_group_quantization_native_is_bitwise_the_torch_code(rows, dtype, group, monkeypatch):
    x = _activations(rows, 128, seed=rows, dtype=dtype)
    if rows > 3:  # exact ties after the division (2.5 -> 2, -0.5 -> 0, 3.5 -> 4: half to even) and tiny values
        x[3, :4] = torch.tensor([127.0, 2.5, -0.5, 3.5])
        x[3, 32:40] = 1e-12
    _bitwise(x, group, monkeypatch)
    strided = _activations(rows, 256, dtype=dtype)[:, :128]  # rows 256 apart
    assert qk.native_rows(strided)
    _bitwise(strided, group, monkeypatch)


@needs_native
@pytest.mark.parametrize("group", [32, 64])
def test_group_quantization_of_a_nan_or_inf_group_is_what_torch_gives(group, monkeypatch):
    # A NaN (inf) scale, a NaN sum and zeros, so the product is NaN, not finite garbage (max() alone
    # drops the NaN, and NaN cast to int32 is INT_MIN).
    x = torch.ones(3, 128)
    x[0, 7] = float("nan")
    x[2, 70] = float("inf")
    q, scales, sums = w4.quantize_groups_int8(x, group, native=True)
    assert bool(scales[0, 0].isnan()) and bool(sums[0, 0].isnan()) and not bool(q[0, :group].any())
    g = 70 // group
    assert bool(scales[2, g].isinf()) and bool(sums[2, g].isnan()) and not bool(q[2, g * group : (g + 1) * group].any())
    assert bool(torch.isfinite(scales[1]).all()) and bool(torch.isfinite(scales[0, 1:]).all())
    torch_code = w4.quantize_groups_int8(x, group)
    assert all(torch.equal(a, b) for a, b in zip((q, scales, sums), torch_code) if a.dtype == torch.int8)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip((scales, sums), torch_code[1:]))


def test_group_quantization_is_within_half_a_step_per_group():
    x = _activations(9, 128, dtype=torch.float32)
    xq, xs, xsum = w4.quantize_groups_int8(x)
    assert xq.dtype == torch.int8 and xs.shape == xsum.shape == (9, 4)
    step = xs.repeat_interleave(32, dim=1)
    assert bool(((xq.float() * step - x).abs() <= step / 2 * (1 + 1e-6)).all())
    assert int(xq.abs().max()) == 127  # each non-zero group uses the whole range
    assert torch.equal(xsum, xq.float().reshape(9, 4, 32).sum(-1) * xs)
    # a loud group does not coarsen the others: a per-token scale would be xs[2, 0] for all of them
    assert xs[2, 0] > 5 * xs[2, 1:].max()


def test_group_quantization_refuses_a_partial_group():
    with pytest.raises(ValueError, match="groups of 32"):
        w4.quantize_groups_int8(torch.randn(2, 48))


# ---- packing --------------------------------------------------------------------------------


def test_the_nibble_tiles_round_trip_exactly():
    qw = _weight(96, 160)
    packed, scales, mins = w4.pack_w4a8_weight(qw.qweight, qw.scales, qw.mins)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 80)  # two weights a byte
    back = w4.unpack_w4a8_weight(packed, scales, mins)
    assert torch.equal(back[0], qw.qweight) and torch.equal(back[1], qw.scales) and torch.equal(back[2], qw.mins)
    # byte b of a tile's k-quad step: column b // 4 (low nibble), column 16 + b // 4 (high), k = b % 4
    q = qk.unpack_int4(qw.qweight)
    assert int(packed[0, 9]) == int(q[2, 1]) | (int(q[18, 1]) << 4)
    # columns 16-31 are read as 16 q: their stored scales are / 16
    assert torch.equal(scales.reshape(-1)[16:32], qw.scales[16:32, 0].float() / 16)  # tile 0, group 0


# ---- the reference and the native kernel -----------------------------------------------------


@pytest.mark.parametrize("rows", [1, 13])
def test_the_reference_is_the_exact_value_in_float32(rows):
    qw = _weight(64, 96)
    x = _activations(rows, 96, dtype=torch.float32)
    got = w4.w4a8_matmul(x, qw.qweight, qw.scales, qw.mins)
    exact = _exact(x, qw)
    assert got.dtype == torch.float32
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())


@needs_native_w4a8
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 32, 100, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_native_w4a8_is_one_rounding_of_its_exact_value(rows, bias):
    qw = _weight(96, 160, seed=rows)
    b = (torch.randn(96, generator=torch.Generator().manual_seed(rows)) * 0.5).to(BF16) if bias else None
    layer = mq.W4A8Linear(qw, b, BF16)
    assert layer.is_native and not hasattr(layer, "qweight")  # only the kernel's tiles are held
    x = _activations(rows, 160, seed=rows)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == BF16 and got.shape == (rows, 96)
    _assert_one_rounding_of(got, _exact(x, qw, b))


@needs_native_w4a8
@pytest.mark.parametrize("k", [1536, 4096])  # SmolLM2's down_proj: 48 groups; a wide one: 128
def test_native_w4a8_over_many_groups(k):
    qw = _weight(64, k, seed=k)
    x = _activations(13, k, seed=k)
    with torch.inference_mode():
        _assert_one_rounding_of(mq.W4A8Linear(qw, None, BF16)(x), _exact(x, qw))


@needs_native_w4a8
def test_the_native_kernels_read_rows_with_a_stride():
    # The kernels quantize bf16 rows themselves, reading them `ldx` apart (here 160 for 96 features).
    plain, fused = mq.W4A8Linear(_weight(64, 96), None, BF16), mq.W4A8SiluMulLinear(_weight(128, 96), None)
    x = _activations(20, 160)[:, :96]
    assert x.stride() == (160, 1)
    with torch.inference_mode():
        assert torch.equal(plain(x), plain(x.contiguous()))
        assert all(torch.equal(a, b) for a, b in zip(fused(x)[:3], fused(x.contiguous())[:3]))


@needs_native_w4a8
def test_the_native_kernels_hold_the_copy_a_reshape_makes():
    # 3-D rows that reshape(-1, k) must copy: the kernel reads that copy, which must outlive the call
    # setting it up (it was freed before the kernel ran: wrong outputs, a use-after-free).
    plain, fused = mq.W4A8Linear(_weight(64, 96), None, BF16), mq.W4A8SiluMulLinear(_weight(128, 96), None)
    x = _activations(16, 96).reshape(2, 8, 96)[:, :5, :]
    assert x.stride(-1) == 1 and not x.is_contiguous()
    with torch.inference_mode():
        for _ in range(3):  # a freed block is reused by the allocations that follow
            assert torch.equal(plain(x), plain(x.contiguous()))
            assert all(torch.equal(a, b) for a, b in zip(fused(x)[:3], fused(x.contiguous())[:3]))


def test_the_native_entry_quantizes_inputs_it_cannot_read_as_they_are():
    if not w4.w4a8_native_supported(64, 96):
        pytest.skip("native kernels not built here, or built without AVX512-VNNI and AVX512-BF16")
    qw = _weight(64, 96)
    packed = w4.pack_w4a8_weight(qw.qweight, qw.scales, qw.mins)
    x = _activations(7, 96)
    with torch.inference_mode():
        want = w4.w4a8_matmul_native(x, *packed, None)
        assert torch.equal(w4.w4a8_matmul_native(x.t().contiguous().t(), *packed, None), want)  # column stride 7
        float32 = w4.w4a8_matmul_native(x.float(), *packed, None)  # quantized first, bf16 output
    assert torch.equal(float32, want)


@needs_native_w4a8
def test_native_w4a8_gives_nan_for_a_row_with_a_nan():
    layer = mq.W4A8Linear(_weight(64, 96), None, BF16)
    x = _activations(3, 96)
    x[1, 40] = float("nan")
    with torch.inference_mode():
        y = layer(x)
    assert bool(y[1].isnan().all()) and bool(torch.isfinite(y[[0, 2]]).all())


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_w4a8_of_no_rows_is_an_empty_output(kernels, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", kernels)  # read when the layer's kernel set is bound
    layer = mq.W4A8Linear(_weight(64, 96), None, BF16)
    with torch.inference_mode():
        assert layer(torch.empty(0, 96, dtype=BF16)).shape == (0, 64)
        assert layer(torch.empty(3, 0, 96, dtype=BF16)).shape == (3, 0, 64)


@needs_native_w4a8
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_w4a8_the_same_on_any_thread_count(threads):
    layer = mq.W4A8Linear(_weight(160, 64), None, BF16)
    x = _activations(150, 64)
    before = torch.get_num_threads()
    with torch.inference_mode():
        want = layer(x)
        try:
            torch.set_num_threads(threads)
            got = layer(x)
        finally:
            torch.set_num_threads(before)
    assert torch.equal(got, want)


@needs_native_w4a8
def test_native_w4a8_falls_back_to_the_reference_off_its_kernel():
    qw = _weight(64, 96)
    layer = mq.W4A8Linear(qw, None, BF16)
    x = _activations(9, 96)
    with torch.inference_mode():
        native = layer(x)
        layer._kernel_ok = False  # as after a .to() the kernel cannot read
        reference = layer(x)
    assert torch.equal(reference, w4.w4a8_matmul(x, qw.qweight, qw.scales, qw.mins))
    assert float((native.float() - reference.float()).abs().max()) <= 0.01 * float(reference.float().abs().max())


@needs_native_w4a8
def test_native_w4a8_refuses_an_input_of_the_wrong_width():
    layer = mq.W4A8Linear(_weight(64, 96), None, BF16)
    with pytest.raises(ValueError, match="features"):
        layer(_activations(3, 128))


@needs_native_w4a8
def test_a_native_w4a8_layer_follows_to_dtype_and_load_state_dict():
    a = mq.W4A8Linear(_weight(64, 96, seed=1), torch.ones(64, dtype=BF16), BF16)
    b = mq.W4A8Linear(_weight(64, 96, seed=2), torch.full((64,), 2.0, dtype=BF16), BF16)
    x = _activations(5, 96)
    with torch.inference_mode():
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), b(x))  # the float32 bias copy follows the loaded bias
        a = a.to(BF16)  # casts the float32 scales and mins: the kernel cannot read them any more
        assert not a._kernel_ok
        _assert_one_rounding_of(a(x), _exact(x, qk_weight(a), torch.full((64,), 2.0, dtype=BF16)))


def qk_weight(layer: mq.W4A8Linear) -> mq.QuantizedWeight:
    qweight, scales, mins = layer.int4_weight()
    return mq.QuantizedWeight("int4", qweight, scales, mins, layer.in_features)


# ---- in the model and the engine -------------------------------------------------------------


def _tiny_decoder(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    from batchrun.model.decoder import DecoderLM
    from batchrun.model.loader import load_model

    loaded = load_model(model_dir)
    model = DecoderLM(loaded.config).to(dtype)
    model.load_hf_state_dict(loaded.state_dict)
    return model.eval()


def test_quantize_model_w4a8_swaps_every_projection(tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir, BF16)
    summary = quantize_model(model, "w4a8")
    layers = [m for m in model.modules() if isinstance(m, mq.W4A8Linear)]
    assert summary.num_quantized == len(layers) == 4 * model.spec.num_layers
    assert summary.formats == {"linear:w4a8/g32": len(layers)}
    assert all(m.is_native == w4.w4a8_native_supported(m.out_features, m.in_features) for m in layers)


def test_a_projection_w4a8_cannot_group_by_32_stays_int4_weight_only():
    weight = mq.quantize_weight(torch.randn(32, 48), "int4", 32)  # 48 inputs: groups of 16
    assert weight.group_size == 16
    assert isinstance(mq.make_linear(weight, "w4a8", None, BF16), mq.Int4Linear)


def test_w4a8_takes_gguf_q4_blocks_as_they_are(tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir, torch.float32)
    name = "layers.0.mlp.down_proj"
    w = model.get_submodule(name).weight.data
    gguf_block = mq.quantize_weight(w + 0.01, "int4", 32)  # blocks that differ from requantizing w
    summary = quantize_model(model, "w4a8", prequantized={name: gguf_block})
    assert summary.num_from_gguf == 1
    layer = model.get_submodule(name)
    assert all(
        torch.equal(a, b) for a, b in zip(layer.int4_weight(), (gguf_block.qweight, gguf_block.scales, gguf_block.mins))
    )


@needs_native_w4a8
def test_a_bf16_w4a8_engine_runs_natively(tiny_llama_dir, monkeypatch):
    from batchrun.engine import SamplingParams

    calls = []
    for name in ("w4a8_matmul_native", "w4a8_silu_quant_native"):  # counted as the kernel set binds them
        real = getattr(w4, name)
        monkeypatch.setattr(w4, name, lambda *a, fn=real, name=name: calls.append(name) or fn(*a))
    engine = make_tiny_engine(
        tiny_llama_dir,
        dtype="bfloat16",
        quantization="w4a8",
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        block_size=16,
    )
    layers = [m for m in engine.model.modules() if isinstance(m, mq.W4A8Linear)]
    assert len(layers) == 4 * engine.model.spec.num_layers and all(m.is_native for m in layers)
    assert sum(isinstance(m, mq.W4A8SiluMulLinear) for m in layers) == engine.model.spec.num_layers
    calls.clear()  # start-up's profile
    prompts = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    steps = len(calls) // (4 * engine.model.spec.num_layers)
    assert steps >= 8 and calls.count("w4a8_silu_quant_native") == steps * engine.model.spec.num_layers
    # The reference (float32 matmul over the dequantized weight, then one rounding): the same sums
    # in another order, which does not move this model's greedy tokens.
    for m in layers:
        m._kernel_ok = False
    engine.reset_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, params)] == tokens


# ---- the fused silu MLP input (W4A8SiluMulLinear) ---------------------------------------------


@needs_native_w4a8
@pytest.mark.parametrize(
    "rows,k,threads", [(1, 64, 1), (6, 32, 2), (7, 64, 3), (13, 1536, 2), (130, 64, 1), (130, 64, 2), (130, 96, 3)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_quant_is_bitwise_the_three_passes(rows, k, threads, bias):
    from batchrun.kernels import elementwise as ew

    qw = _weight(192, k, seed=rows)  # gate and up: 96 outputs each, three groups of 32
    b = (torch.randn(192, generator=torch.Generator().manual_seed(rows)) * 0.5).to(BF16) if bias else None
    plain, fused = mq.W4A8Linear(qw, b, BF16), mq.W4A8SiluMulLinear(qw, b)
    x = _activations(rows, k, seed=rows)
    before = torch.get_num_threads()
    with torch.inference_mode():
        want = w4.quantize_groups_int8(ew.act_mul_native(plain(x), "silu"))
        try:
            torch.set_num_threads(threads)
            got = fused(x)
        finally:
            torch.set_num_threads(before)
    assert isinstance(got, w4.GroupQuantized) and got.lead_shape == (rows,) and got.dtype == BF16
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want))
    # it holds its rows in silu pair order, and gives the plain ones back
    assert all(torch.equal(a, b) for a, b in zip(fused.int4_weight(), (qw.qweight, qw.scales, qw.mins)))


@needs_native_w4a8
def test_fused_silu_quant_off_its_kernel_returns_the_activation():
    from batchrun.kernels import elementwise as ew

    qw = _weight(128, 64)
    plain, fused = mq.W4A8Linear(qw, None, BF16), mq.W4A8SiluMulLinear(qw, None)
    down = mq.W4A8Linear(_weight(32, 64, seed=3), None, BF16)
    x = _activations(9, 64)
    with torch.inference_mode():
        on = down(fused(x))
        for layer in (plain, fused, down):
            layer._kernel_ok = False  # as after a .to() the kernel cannot read
        h = fused(x)
        assert torch.equal(h, ew.act_mul_native(plain(x), "silu"))  # plain's reference path, then the activation
        off = down(h)
    assert float((on.float() - off.float()).abs().max()) <= 0.02 * float(off.float().abs().max())


@needs_native_w4a8
def test_the_down_projection_takes_quantized_groups_on_either_path():
    qw = _weight(64, 96)
    down = mq.W4A8Linear(qw, torch.ones(64, dtype=BF16), BF16)
    x = _activations(5, 96)
    groups = w4.GroupQuantized(*w4.quantize_groups_int8(x), (5,), BF16)
    with torch.inference_mode():
        assert torch.equal(down(groups), down(x))  # the kernel, on the same quantized input
        down._kernel_ok = False
        assert torch.equal(down(groups), down(x))  # the reference, likewise
    with pytest.raises(ValueError, match="features"):
        mq.W4A8Linear(_weight(64, 128), None, BF16)(groups)


@needs_native_w4a8
def test_quantize_model_fuses_the_silu_mlps_of_a_bf16_w4a8_model(tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir, BF16)
    quantize_model(model, "w4a8")
    mlps = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert mlps and all(m.fused_act and isinstance(m.gate_up_proj, mq.W4A8SiluMulLinear) for m in mlps)
    float32_model = _tiny_decoder(tiny_llama_dir, torch.float32)  # no native kernel in float32: not fused
    quantize_model(float32_model, "w4a8")
    assert not any(getattr(m, "fused_act", False) for m in float32_model.modules())
