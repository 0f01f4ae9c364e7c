"""The native bf16 linear kernel (csrc/linear.cpp, kernels/cpu_linear.py: NativeLinear) and its
tied embedding, against float32 references and F.linear.

One bf16 rounding of a float32 sum: each output is within half a bf16 step of the exact product
of the bf16 inputs, and within one step of F.linear (whose float32 sums run in another order).
Row counts cover the micro kernel's every tail (1-12 rows), several row blocks, and the split of
rows across threads (more than 96 rows); thread counts 1-3 split the weight tiles unevenly.
"""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_linear
from batchrun.kernels.cpu_linear import NATIVE_MAX_IN_FEATURES, pack_native_weight, unpack_native_weight
from batchrun.model.linear import NativeEmbedding, NativeLinear, NativeSiluMulLinear, pack_linear, pack_silu_mul
from batchrun.model.prepare import prepare_linears
from tests.support.engines import make_tiny_engine
from tests.support.models import tied_decoder

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    not cpu_linear.native_supported(32, 64), reason="native kernels not built here, or built without AVX512-BF16"
)


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(BF16)
    with torch.no_grad():  # biases on the scale of the products, so their float32 add matters
        if bias:
            linear.bias.normal_(0.0, 0.5)
    return linear


def _assert_one_rounding_of_exact(got: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear) -> None:
    exact = torch.nn.functional.linear(
        x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double()
    )
    err = (got.double() - exact).abs()
    # Half a bf16 step (2^-8 of the value at most), plus float32 summation error over K terms.
    bound = exact.abs() * 2.0**-8 + 1e-6 * (x.double().abs() @ linear.weight.double().abs().t())
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def _assert_within_one_step_of(got: torch.Tensor, want: torch.Tensor, slack: float | torch.Tensor = 1e-30) -> None:
    """`got` within one bf16 step of torch's own `want`; `slack`: what torch's float32 sums may lose
    where products cancel (a value near zero is then off by more than a step of itself)."""
    g, w = got.float(), want.float()
    assert bool(((g - w).abs() <= w.abs() * 2.0**-7 + slack).all())
    assert (g != w).float().mean().item() < 0.01


@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 32, 97, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_is_one_rounding_of_the_exact_product(rows, bias):
    linear = _linear(96, 224, bias, seed=rows)
    native = pack_linear(linear)
    assert isinstance(native, NativeLinear)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(BF16)
    with torch.inference_mode():
        got = native(x)
        assert got.dtype == BF16 and got.shape == (rows, 224)
        _assert_one_rounding_of_exact(got, x, linear)
        cancellation = 2e-6 * (x.float().abs() @ linear.weight.float().abs().t())
        _assert_within_one_step_of(got, linear(x), cancellation)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features", [320, 32])  # ten weight tiles; one (more threads than tiles)
def test_native_linear_the_same_on_any_thread_count(threads, out_features):
    # Each output element is one tile's sum in k order, whichever thread computes it.
    _assert_the_same_on(threads, pack_linear(_linear(128, out_features, True)), torch.randn(150, 128).to(BF16))


def _assert_the_same_on(threads: int, module, x: torch.Tensor) -> None:
    """module(x) on `threads` threads is bitwise module(x) on one."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            want = module(x)
        torch.set_num_threads(threads)
        with torch.inference_mode():
            assert torch.equal(module(x), want)
    finally:
        torch.set_num_threads(before)


def test_native_linear_input_layouts():
    linear = _linear(64, 96, True)
    native = pack_linear(linear)
    wide = torch.randn(7, 80).to(BF16)
    x = wide[:, 8:72]  # rows 80 apart: the row stride is passed through
    assert not x.is_contiguous()
    with torch.inference_mode():
        want = native(x.contiguous())
        assert torch.equal(native(x), want)
        assert torch.equal(native(x.contiguous().view(1, 7, 64)), want.view(1, 7, 96))  # leading dims kept
        assert native(torch.empty(0, 64, dtype=BF16)).shape == (0, 96)
        # A float32 input goes to F.linear over the unpacked weight, which refuses it as nn.Linear does.
        xf = torch.randn(3, 64)
        with pytest.raises(RuntimeError, match="same dtype"):
            linear(xf)
        with pytest.raises(RuntimeError, match="same dtype"):
            native(xf)


def test_with_the_kernels_switched_off_the_linears_pack_for_onednn(monkeypatch):
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target
    from batchrun.model.linear import PackedLinear

    linear = _linear(64, 96, True)
    assert isinstance(pack_linear(linear), NativeLinear)
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")  # read when a kernel set is bound
    assert bind_kernels(find_target("cpu"), BF16).linear_float.packing == "onednn"
    packed = pack_linear(linear, native=False)
    x = torch.randn(5, 64).to(BF16)
    assert isinstance(packed, PackedLinear)
    with torch.inference_mode():
        assert torch.equal(packed(x), linear(x))  # oneDNN's F.linear: bitwise


def test_the_packed_layout_round_trips_and_replaces_the_plain_weight():
    w = torch.randn(96, 40).to(BF16)
    packed = pack_native_weight(w)
    assert packed.shape == w.shape and not torch.equal(packed, w)  # tiles, not rows
    assert torch.equal(unpack_native_weight(packed), w)
    native = pack_linear(_linear(40, 96, False))
    assert [name for name, _ in native.named_buffers()] == ["packed_weight"]  # no plain copy kept


def test_pack_linear_chooses_by_shape():
    assert isinstance(pack_linear(_linear(96, 224, False)), NativeLinear)
    assert not isinstance(pack_linear(_linear(96, 200, False)), NativeLinear)  # 200 columns: not whole tiles
    assert not isinstance(pack_linear(_linear(95, 224, False)), NativeLinear)  # odd K: no (k, k + 1) pairs
    assert not isinstance(pack_linear(_linear(NATIVE_MAX_IN_FEATURES + 2, 32, False)), NativeLinear)
    assert pack_linear(torch.nn.Linear(96, 224)) is None  # float32 stays on F.linear


def test_a_tied_lm_head_is_packed_once_and_the_embedding_reads_it():
    from batchrun.model.prepare import module_weight_bytes

    model = tied_decoder()
    table = model.embed_tokens.weight.detach().clone()
    bytes_before = module_weight_bytes(model)
    assert prepare_linears(model, "none", "cpu", BF16).num_packed == 4 * 2 + 1
    assert isinstance(model.lm_head, NativeLinear) and isinstance(model.embed_tokens, NativeEmbedding)
    assert model.embed_tokens.packed_weight is model.lm_head.packed_weight
    assert module_weight_bytes(model) <= bytes_before + 4 * 2 * 1024  # at most the float32 bias copies
    ids = torch.tensor([[0, 1, 31, 32, 33], [319, 288, 7, 7, 100]])
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), table[ids])
        h = torch.randn(4, 64).to(BF16)
        _assert_within_one_step_of(model.compute_logits(h).to(BF16), torch.nn.functional.linear(h, table))


def _mlps(model):
    from batchrun.model.decoder import MLP

    return [m for m in model.modules() if isinstance(m, MLP)]


def _unpack_to_plain_linears(model) -> None:
    """Every NativeLinear back to an nn.Linear of the same weights; fused MLPs unfused."""
    for mlp in _mlps(model):
        mlp.fused_act = False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NativeLinear):
                bias = child.plain_bias()
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=bias is not None).to(BF16)
                with torch.no_grad():
                    plain.weight.copy_(child.weight())
                    if bias is not None:
                        plain.bias.copy_(bias)
                setattr(parent, name, plain)


def test_engine_runs_its_bf16_linears_natively_and_the_tokens_match_plain_linears(tiny_llama_dir):
    from batchrun.engine import SamplingParams

    engine = make_tiny_engine(
        tiny_llama_dir,
        dtype="bfloat16",
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        block_size=16,
        tune_kernels=False,  # the native kernels wherever they serve, whatever this CPU measures
    )
    num_layers = engine.model.spec.num_layers
    assert engine.settings.native_linears == engine.settings.packed_linears == 4 * num_layers + 1
    prompts = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    # The same weights through F.linear: outputs differ at most in a last bf16 bit here and there,
    # which does not move this model's greedy tokens.
    assert all(mlp.fused_act for mlp in _mlps(engine.model))  # silu(gate) * up in the gate/up kernel
    _unpack_to_plain_linears(engine.model)
    engine.reset_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, params)] == tokens
    fp32 = make_tiny_engine(tiny_llama_dir, kv_cache_memory=16 << 20, max_num_batched_tokens=64, block_size=16)
    assert fp32.settings.native_linears == 0


# ---------------------------------------------------------------------------------------------
# silu(gate) * up fused into the gate/up projection (NativeSiluMulLinear)


def _gate_up(in_features: int, n: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    linear = _linear(in_features, 2 * n, bias, seed)
    with torch.no_grad():  # gates spread over silu's whole range, far below zero included
        linear.weight.mul_(4.0)
    return linear


def _two_passes(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The unfused native path: NativeLinear, then the native silu-mul pass."""
    from batchrun.kernels.elementwise import act_mul_native as act_mul

    return act_mul(pack_linear(linear)(x), "silu")


@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 32, 97, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_mul_is_bitwise_the_two_passes(rows, bias):
    linear = _gate_up(96, 160, bias, seed=rows)
    fused = pack_silu_mul(linear)
    assert isinstance(fused, NativeSiluMulLinear) and fused.act_features == 160
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(BF16)
    with torch.inference_mode():
        got = fused(x)
        assert got.shape == (rows, 160)
        assert torch.equal(got, _two_passes(linear, x))
        assert torch.equal(fused(x.view(1, rows, 96)), got.view(1, rows, 160))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_silu_mul_the_same_on_any_thread_count(threads):
    # Three tile pairs: three threads get one each.
    _assert_the_same_on(threads, pack_silu_mul(_gate_up(64, 96, True)), torch.randn(130, 64).to(BF16))


def test_fused_silu_mul_keeps_the_weight_and_falls_back_where_its_buffers_are_not_the_kernels():
    from batchrun.kernels.elementwise import act_mul_native

    linear = _gate_up(64, 64, True)
    fused = pack_silu_mul(linear)
    assert torch.equal(fused.weight(), linear.weight) and torch.equal(fused.plain_bias(), linear.bias)
    assert [name for name, _ in fused.named_buffers()] == ["packed_weight", "bias"]  # no plain copy kept
    x = torch.randn(5, 64).to(BF16)
    fused._kernel_ok = False  # as after a .to() the kernel cannot read
    with torch.inference_mode():
        assert torch.equal(fused(x), act_mul_native(linear(x), "silu"))


def test_fused_silu_mul_only_where_it_serves():
    assert pack_silu_mul(_gate_up(64, 48, False)) is None  # 48 outputs: not whole tiles
    assert pack_silu_mul(_gate_up(63, 64, False)) is None  # odd K
    assert pack_silu_mul(torch.nn.Linear(64, 128)) is None  # float32
    from transformers import LlamaConfig

    from batchrun.model.decoder import DecoderLM

    for hidden_act, intermediate, fused in (
        ("silu", 128, True),
        ("gelu_pytorch_tanh", 128, False),
        ("silu", 80, False),
    ):
        config = LlamaConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=intermediate,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_act=hidden_act,
        )
        torch.manual_seed(0)
        model = DecoderLM(config).to(BF16)
        x = torch.randn(3, 64).to(BF16)
        with torch.inference_mode():
            want = model.layers[0].mlp(x)
            prepare_linears(model, "none", "cpu", BF16)
            mlp = model.layers[0].mlp
            assert mlp.fused_act == fused and isinstance(mlp.gate_up_proj, NativeSiluMulLinear) == fused
            _assert_within_one_step_of(mlp(x), want)


# ---------------------------------------------------------------------------------------------
# W8A8 through the native kernel (kernels/quant/w8a8.py: w8a8_matmul_native, model/quant/layers.py: W8A8Linear)

needs_native_w8a8 = pytest.mark.skipif(
    not __import__("batchrun.kernels.quant", fromlist=["x"]).w8a8_native_supported(32, 64, 8),
    reason="native kernels not built here, or built without AVX512-VNNI",
)


def _w8a8_layer(n: int, k: int, num_float: int, bias: bool, native: bool, seed: int = 0):
    from batchrun.model import quant as mq

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(BF16)
    b = (torch.randn(n, generator=g) * 0.5).to(BF16) if bias else None
    outliers = None
    if num_float:
        w, outliers = mq.split_outlier_channels(w, torch.rand(k, generator=g), num_float)
    qw = mq.quantize_weight(w, "int8")
    return mq.W8A8Linear(qw, b, outliers, BF16 if native else None), qw, outliers, b


def _activations(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * torch.linspace(0.2, 4.0, k)).to(BF16)  # uneven channels


@needs_native_w8a8
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 32, 130])
def test_native_w8a8_without_float_channels_is_bitwise_the_torch_path(rows):
    from batchrun.kernels import quant as qk

    layer, qw, _, _ = _w8a8_layer(96, 128, 0, False, native=True, seed=rows)
    assert layer.is_native and not hasattr(layer, "qweight")  # only the kernel's tiles are held
    x = _activations(rows, 128, seed=rows)
    with torch.inference_mode():
        # Same int32 sums, same (acc * w_scale) * x_scale: bitwise, without a bias (the torch path
        # adds a bias after its rounding, the kernel before: compared below against the exact value).
        assert torch.equal(layer(x), qk.w8a8_matmul(x, qw.qweight, qw.scales))


@needs_native_w8a8
@pytest.mark.parametrize("rows", [1, 5, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_native_w8a8_is_one_rounding_of_its_exact_value(rows, bias):
    from batchrun.kernels import quant as qk

    layer, qw, outliers, b = _w8a8_layer(64, 96, 8, bias, native=True, seed=rows)
    assert layer.is_native and layer.format_key == "w8a8/float8"
    x = _activations(rows, 96, seed=rows)
    xq, sx, xo = qk.quantize_with_outliers(x, outliers)
    exact = (
        xq.double() @ qw.qweight.double().t()
    ) * qw.scales.double().t() * sx.double() + xo.double() @ outliers.weight_t.double()
    if b is not None:
        exact = exact + b.double()
    with torch.inference_mode():
        got = layer(x)
    bound = exact.abs() * 2.0**-8 + 1e-5 * exact.abs().amax()  # half a bf16 step, plus float32 sums
    assert bool(((got.double() - exact).abs() <= bound).all())
    # The torch path rounds before adding the float channels (and the bias): never closer.
    ref = qk.w8a8_matmul(x, qw.qweight, qw.scales, b, outliers)
    assert (got.double() - exact).abs().mean() <= (ref.double() - exact).abs().mean()


@needs_native_w8a8
def test_native_w8a8_quantizes_its_input_as_the_standalone_pass_does():
    # The kernel quantizes bf16 rows itself (reading them ldx apart, gathering the float channels);
    # with an index it cannot read as it is, the standalone pass quantizes first. Bitwise the same.
    from batchrun.kernels import quant as qk

    layer, qw, outliers, _ = _w8a8_layer(64, 96, 8, True, native=True)
    x = _activations(30, 160)[:, :96]  # rows 160 apart
    odd_index = outliers.index.repeat_interleave(2)[::2]
    assert not odd_index.is_contiguous()

    def no_separate_pass(*_args, **_kwargs):
        raise AssertionError("the kernel was to quantize its input itself")

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        for name in ("quantize_per_token_int8", "quantize_with_outliers"):
            mp.setattr(qk, name, no_separate_pass)
        self_quantized = layer(x)
        assert torch.equal(self_quantized, layer(x.contiguous()))
    with torch.inference_mode():
        pre_quantized = qk.w8a8_matmul_native(
            x,
            layer.packed_qweight,
            layer._scales_f32,
            layer._bias_f32,
            qk.OutlierChannels(odd_index, outliers.skip, layer.outliers.weight_t),
            layer.packed_outlier_weight,
        )
    assert torch.equal(self_quantized, pre_quantized)


@needs_native_w8a8
def test_native_w8a8_falls_back_to_the_torch_path_where_its_buffers_are_not_the_kernels():
    from batchrun.kernels import quant as qk

    layer, qw, outliers, _ = _w8a8_layer(64, 96, 8, False, native=True)
    reference_layer, *_ = _w8a8_layer(64, 96, 8, False, native=False)
    assert not reference_layer.is_native
    x = _activations(9, 96)
    layer._kernel_ok = False  # as after a .to() the kernel cannot read
    with torch.inference_mode():
        assert torch.equal(layer(x), reference_layer(x))  # the unpacked weights through w8a8_matmul
        assert torch.equal(qk.unpack_w8a8_weight(layer.packed_qweight), qw.qweight)


@needs_native_w8a8
def test_native_w8a8_shapes_it_does_not_serve_stay_on_the_torch_path():
    from batchrun.kernels import quant as qk

    assert not qk.w8a8_native_supported(100, 64)  # columns not whole tiles of 32
    assert not qk.w8a8_native_supported(64, 66)  # K not a multiple of 4
    assert not qk.w8a8_native_supported(64, 64, 3)  # an odd number of float channels
    layer, *_ = _w8a8_layer(64, 96, 0, False, native=False)  # float32 models: not native
    assert not layer.is_native and hasattr(layer, "qweight")


@needs_native_w8a8
def test_a_bf16_w8a8_engine_runs_natively(tiny_llama_dir):
    from batchrun.engine import SamplingParams
    from batchrun.model.quant import W8A8Linear

    engine = make_tiny_engine(
        tiny_llama_dir,
        dtype="bfloat16",
        quantization="w8a8",
        w8a8_outlier_channels=8,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        block_size=16,
    )
    layers = [m for m in engine.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 4 * engine.model.spec.num_layers and all(m.is_native for m in layers)
    prompts = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tokens = [o.token_ids for o in engine.generate(prompts, params)]
    # The same layers on the torch path (_int_mm, then the float channels after a first rounding):
    # the outputs differ in last bits only, which does not move this model's greedy tokens.
    for m in layers:
        m._kernel_ok = False
    engine.reset_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, params)] == tokens


def test_a_native_linear_moved_to_another_dtype_stops_using_the_kernel():
    # The kernel reads bf16 pairs and a float32 bias: after .float() its buffers are float32, and
    # reading them as bf16 would be garbage, so the module takes F.linear over the unpacked weight.
    linear = _linear(64, 96, True)
    native = pack_linear(linear).float()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, linear.weight.float(), linear.bias.float())
        assert torch.equal(native(x), want)
        with pytest.raises(RuntimeError, match="same dtype"):  # as a float32 nn.Linear refuses bf16 input
            native(x.to(BF16))


@needs_native_w8a8
def test_a_native_w8a8_layer_follows_to_dtype():
    # .to(bf16) casts the float32 scales (and bias): the kernel's float32 copies are rebuilt from
    # them, not read as the wrong type. .float() casts the float channels' bf16 weight, which the
    # kernel cannot read: the layer takes the reference path, like a layer that was never native.
    layer, *_ = _w8a8_layer(64, 96, 8, True, native=True)
    x = _activations(9, 96)
    with torch.inference_mode():
        before = layer(x)
        layer = layer.to(BF16)
        assert layer._kernel_ok
        after = layer(x)
        assert bool(torch.isfinite(after).all())
        assert (after.float() - before.float()).abs().max() <= 0.02 * before.float().abs().max()
        reference_layer, *_ = _w8a8_layer(64, 96, 8, True, native=False)
        layer, reference_layer = layer.float(), reference_layer.to(BF16).float()
        assert not layer._kernel_ok
        assert torch.equal(layer(x.float()), reference_layer(x.float()))


@needs_native_w8a8
def test_native_w8a8_refuses_an_input_of_the_wrong_width():
    layer, *_ = _w8a8_layer(64, 96, 0, False, native=True)
    with pytest.raises(ValueError, match="features"):
        layer(_activations(3, 128))


def test_a_native_linear_refuses_an_input_of_the_wrong_width_as_nn_linear_does():
    native = pack_linear(_linear(64, 96, False))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        native(torch.randn(3, 32).to(BF16))


def test_load_state_dict_refreshes_what_the_kernels_read():
    a, b = pack_linear(_linear(64, 96, True, seed=1)), pack_linear(_linear(64, 96, True, seed=2))
    a.load_state_dict(b.state_dict())
    x = torch.randn(4, 64).to(BF16)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))  # the float32 bias copy follows the loaded bias


@needs_native_w8a8
def test_load_state_dict_refreshes_the_native_w8a8_scales():
    a, *_ = _w8a8_layer(64, 96, 8, True, native=True, seed=1)
    b, *_ = _w8a8_layer(64, 96, 8, True, native=True, seed=2)
    a.load_state_dict(b.state_dict())
    x = _activations(4, 96)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))


def test_the_tied_embedding_refuses_negative_ids_and_packing_twice_is_harmless():
    model = tied_decoder(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    assert prepare_linears(model, "none", "cpu", BF16).num_packed == 4 + 1
    assert prepare_linears(model, "none", "cpu", BF16).num_packed == 0  # nothing left to pack
    with pytest.raises(IndexError):
        model.embed_tokens(torch.tensor([3, -1]))
    with pytest.raises(IndexError):
        model.embed_tokens(torch.tensor([64]))
    model = model.float()  # one tensor still: the embedding reads the head's, converted once
    assert model.embed_tokens.packed_weight is model.lm_head.packed_weight
    assert model.embed_tokens.packed_weight.dtype == torch.float32
