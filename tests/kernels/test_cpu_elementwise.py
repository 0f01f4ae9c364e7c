"""The native bf16 elementwise kernels (kernels/elementwise.py, csrc/elementwise.cpp) against their
plain-torch references.

Rotary embedding and the residual add must be bitwise equal to torch (same roundings in the same
order); RMSNorm and silu(gate) * up may differ from torch only by one bf16 rounding step in a few
elements (a float32 sum order or exp's last bit can tip a rounding), nowhere more. Shapes cover the
AVX-512 bodies and their scalar tails, strided views (q and k heads inside the fused qkv output),
the special values silu meets, both thread counts, and the engine: greedy tokens of a bf16 model
are the same with the kernels on and off, and float32 never takes the native path.
"""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels import cpu_native
from batchrun.kernels import elementwise as ew
from tests.support.engines import make_tiny_engine
from tests.support.models import tied_decoder

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: the native kernels are not built")

BF16 = torch.bfloat16


def _assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor, max_fraction: float = 0.005) -> None:
    """Equal, except a few elements one bf16 rounding step apart (relative 2^-8 of the value)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    differ = g != w
    assert differ.float().mean().item() <= max_fraction, f"{differ.sum().item()} of {got.numel()} differ"
    step = w.abs() * 2.0**-7 + 1e-30  # one bf16 ulp is 2^-7 of the value at most
    assert bool(((g - w).abs() <= step)[differ].all()), "a difference larger than one bf16 rounding"


@pytest.fixture
def native_calls(monkeypatch):
    """Names of the native entry points called during the test: a comparison with the reference
    proves nothing if the dispatcher quietly took the reference path."""
    calls: list[str] = []
    for name in ("_rms_norm_native", "_silu_mul_native"):
        real = getattr(ew, name)
        monkeypatch.setattr(ew, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows,k", [(1, 576), (7, 64), (33, 100), (300, 576), (5, 17)])
@pytest.mark.parametrize("is_gemma", [False, True])
def test_rms_norm_matches_torch(rows, k, is_gemma, threads, native_calls):
    torch.manual_seed(rows * k)
    x = (torch.randn(rows, k) * 4).to(BF16)
    w = (torch.randn(k) * 0.3 + (0.0 if is_gemma else 1.0)).to(BF16)
    _assert_within_one_rounding(ew.rms_norm_native(x, w, 1e-6, is_gemma), ew.rms_norm_reference(x, w, 1e-6, is_gemma))
    assert native_calls == ["_rms_norm_native"]


def test_rms_norm_of_strided_head_views_matches_torch(native_calls):
    # Qwen3 / Gemma 3 q_norm: (tokens, heads, head_dim) views into the fused qkv output.
    torch.manual_seed(0)
    qkv = torch.randn(9, 4 * 32 + 2 * 2 * 32).to(BF16)
    q = qkv[:, :128].view(9, 4, 32)
    w = (torch.rand(32) + 0.5).to(BF16)
    got = ew.rms_norm_native(q, w, 1e-6)
    assert got.shape == q.shape
    _assert_within_one_rounding(got, ew.rms_norm_reference(q, w, 1e-6))
    assert native_calls == ["_rms_norm_native"]


@pytest.mark.parametrize("rows,k", [(3, 576), (130, 576), (4, 48)])
def test_add_rms_norm_updates_the_residual_in_place_bitwise(rows, k, threads):
    torch.manual_seed(k)
    h = torch.randn(rows, k).to(BF16)
    residual = (torch.randn(rows, k) * 8).to(BF16)
    w = (torch.rand(k) + 0.5).to(BF16)
    want_normed, want_residual = ew.add_rms_norm_reference(h, residual, w, 1e-5)
    mine = residual.clone()
    normed, new_residual = ew.add_rms_norm_native(h, mine, w, 1e-5)
    assert new_residual.data_ptr() == mine.data_ptr()  # in place: the native path ran
    assert torch.equal(new_residual, want_residual)
    _assert_within_one_rounding(normed, want_normed)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 80, 6])
def test_rotary_is_bitwise_torch_on_qkv_views(head_dim, threads):
    torch.manual_seed(head_dim)
    tokens, heads, kv_heads = 37, 6, 2
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(BF16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    angles = torch.rand(tokens, head_dim // 2) * 50
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(BF16)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(BF16)
    want_q, want_k = ew.apply_rotary_reference(q, cos, sin), ew.apply_rotary_reference(k, cos, sin)
    got_q, got_k = ew.apply_rotary_native(q, cos, sin), ew.apply_rotary_native(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("rows,n", [(1, 1536), (64, 1536), (5, 40), (3, 7)])
def test_silu_mul_matches_torch(rows, n, threads, native_calls):
    torch.manual_seed(n)
    gate_up = (torch.randn(rows, 2 * n) * 5).to(BF16)
    _assert_within_one_rounding(ew.act_mul_native(gate_up, "silu"), ew.act_mul_reference(gate_up, "silu"))
    assert native_calls == ["_silu_mul_native"]


def test_silu_mul_special_values_match_torch(native_calls):
    gate = torch.tensor(
        [
            -1e4,
            -100.0,
            -89.0,
            -88.7,
            -88.0,
            -20.0,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            3.0,
            88.0,
            1e4,
            float("inf"),
            float("-inf"),
            float("nan"),
        ]
    ).to(BF16)
    up = torch.tensor([1.0, -2.0, 3.0, 0.5] * 4).to(BF16)
    gate_up = torch.cat([gate, up])[None].repeat(3, 1)
    got, want = ew.act_mul_native(gate_up, "silu"), ew.act_mul_reference(gate_up, "silu")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert native_calls == ["_silu_mul_native"]


def test_float32_and_the_switch_take_the_torch_path(monkeypatch):
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target

    calls = []
    real = ew._rms_norm_native
    monkeypatch.setattr(ew, "_rms_norm_native", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(4, 64), torch.rand(64)
    assert torch.equal(ew.rms_norm_native(x, w, 1e-6), ew.rms_norm_reference(x, w, 1e-6))
    assert not calls  # float32 is the HF-identical path: torch ops only
    ew.rms_norm_native(x.to(BF16), w.to(BF16), 1e-6)
    assert calls
    calls.clear()
    # The switch is read when a kernel set is bound: with it off a bf16 CPU set binds the torch ops.
    on = bind_kernels(find_target("cpu"), BF16)
    assert (on.rms_norm, on.add_rms_norm, on.act_mul) == (ew.rms_norm_native, ew.add_rms_norm_native, ew.act_mul_native)
    monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")
    off = bind_kernels(find_target("cpu"), BF16)
    assert (off.rms_norm, off.add_rms_norm, off.act_mul) == (
        ew.rms_norm_reference,
        ew.add_rms_norm_reference,
        ew.act_mul_reference,
    )
    off.rms_norm(x.to(BF16), w.to(BF16), 1e-6)
    assert off.qkv_norm_rope_write.keywords["apply_rotary"] is ew.apply_rotary_reference  # not the in-place pass
    assert not calls


def test_engine_greedy_output_is_the_same_with_the_kernels_on_and_off(tiny_llama_dir, monkeypatch):
    import dataclasses
    from functools import partial

    from batchrun.engine import SamplingParams
    from batchrun.kernels import attention, fused_projections
    from batchrun.model import prepare

    # The silu pass as its own kernel: without this the gate/up projections fuse it
    # (NativeSiluMulLinear, tests/kernels/test_cpu_linear.py).
    monkeypatch.setattr(prepare, "pack_silu_mul", lambda linear: None)
    calls = []
    for name in ("_rms_norm_native", "_silu_mul_native", "apply_rotary_native"):
        real = getattr(ew, name)
        monkeypatch.setattr(ew, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    engine = make_tiny_engine(
        tiny_llama_dir, dtype="bfloat16", kv_cache_memory=16 << 20, max_num_batched_tokens=64, block_size=16
    )
    prompts = [[5 + (7 * i + j) % 200 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on = [o.token_ids for o in engine.generate(prompts, params)]
    assert {"_rms_norm_native", "_silu_mul_native", "apply_rotary_native"} <= set(calls)
    engine.reset_prefix_cache()
    # Only these kernels off (BATCHRUN_CPU_KERNELS=0 would switch the attention kernels off too):
    # the engine's kernel set with the torch ops in their places.
    ks = engine.model.kernels
    qkv_write = partial(
        attention.qkv_norm_rope_write_separate,
        rms_norm=ew.rms_norm_reference,
        apply_rotary=ew.apply_rotary_reference,
        write_kv_cache=ks.write_kv_cache,
    )
    engine.model.use_kernels(
        dataclasses.replace(
            ks,
            rms_norm=ew.rms_norm_reference,
            add_rms_norm=ew.add_rms_norm_reference,
            act_mul=ew.act_mul_reference,
            qkv_norm_rope_write=qkv_write,
            qkv_project=partial(fused_projections.qkv_project_separate, qkv_norm_rope_write=qkv_write),
            gate_up_act=partial(fused_projections.gate_up_act_separate, act_mul=ew.act_mul_reference),
        )
    )
    calls.clear()
    assert [o.token_ids for o in engine.generate(prompts, params)] == on
    assert not calls


# ---------------------------------------------------------------------------------------------
# oneDNN-packed bf16 linears (model/linear.py: PackedLinear; the native ones: tests/kernels/test_cpu_linear.py)


@pytest.mark.skipif(
    not __import__("batchrun.kernels.cpu_linear", fromlist=["x"]).packing_available(),
    reason="this torch build has no oneDNN linear packing",
)
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear(rows, bias):
    from batchrun.model.linear import PackedLinear, pack_linear

    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=bias).to(BF16)
    packed = pack_linear(linear)
    assert isinstance(packed, PackedLinear)
    x = torch.randn(rows, 96).to(BF16)
    with torch.inference_mode():
        assert torch.equal(packed(x), linear(x))
        assert torch.equal(packed(x.view(1, rows, 96)), linear(x).view(1, rows, 200))  # leading dims kept
    assert pack_linear(torch.nn.Linear(96, 200)) is None  # float32 stays on F.linear


@pytest.mark.skipif(
    not __import__("batchrun.kernels.cpu_linear", fromlist=["x"]).packing_available(),
    reason="this torch build has no oneDNN linear packing",
)
def test_engine_packs_bf16_linears_and_the_tokens_stay(tiny_llama_dir, monkeypatch):
    from batchrun.engine import SamplingParams
    from batchrun.kernels import cpu_linear
    from batchrun.model.linear import PackedLinear

    # oneDNN's packing, where the native kernel would otherwise take these shapes (tests/kernels/test_cpu_linear.py).
    monkeypatch.setattr(cpu_linear, "native_supported", lambda *shape: False)

    def run(dtype):
        engine = make_tiny_engine(
            tiny_llama_dir, dtype=dtype, kv_cache_memory=16 << 20, max_num_batched_tokens=64, block_size=16
        )
        prompts = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(5)]
        return engine, [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))]

    engine, tokens = run("bfloat16")
    num_layers = engine.model.spec.num_layers
    assert not engine.model.spec.tie_word_embeddings
    assert engine.settings.packed_linears == 4 * num_layers + 1  # qkv, o, gate_up, down per layer, LM head
    assert engine.settings.native_linears == 0
    assert sum(isinstance(m, PackedLinear) for m in engine.model.modules()) == 4 * num_layers + 1
    # The same engine with the packed layers swapped back for plain ones gives the same tokens.
    for parent in list(engine.model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None).to(BF16)
                with torch.no_grad():
                    plain.weight.copy_(child.packed_weight.to_dense())
                    if child.bias is not None:
                        plain.bias.copy_(child.bias)
                setattr(parent, name, plain)
    engine.reset_prefix_cache()
    prompts = [[5 + (3 * i + j) % 150 for j in range(10 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert [o.token_ids for o in engine.generate(prompts, params)] == tokens
    fp32_engine, _ = run("float32")
    assert fp32_engine.settings.packed_linears == 0


@pytest.mark.skipif(
    not __import__("batchrun.kernels.cpu_linear", fromlist=["x"]).packing_available(),
    reason="this torch build has no oneDNN linear packing",
)
def test_a_tied_lm_head_is_not_packed_for_onednn(monkeypatch):
    # Packing it would hold a second copy of the vocabulary matrix beside the embedding's (a native
    # kernel's tied head is packed: tests/kernels/test_cpu_linear.py).
    from batchrun.kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "native_supported", lambda *shape: False)
    from batchrun.model.prepare import prepare_linears

    model = tied_decoder(vocab_size=300)
    assert prepare_linears(model, "none", "cpu", BF16).num_packed == 4 * 2
    assert model.lm_head.weight is model.embed_tokens.weight
