"""The CPU's start-up measurement (kernels/cpu_tuning.py), the binder that reads it
(kernels/bind_cpu.py) and the layouts the model's linears take for it (model/prepare.py:
apply_linear_choices), on injected timings: what is timed and confirmed, what is bound and
recorded, which modules hold which weights (and the memory that costs), and that each layout gives
the results of the kernels it runs. Nothing here depends on how fast anything runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_linear
from batchrun.kernels.binding import bind_kernels, with_tuning
from batchrun.kernels.cpu_choices import NATIVE, PACKED, TORCH, UNPACKED, AttentionChoice, KernelTiming, LinearChoice
from batchrun.kernels.cpu_tuning import AttentionShape, CpuRows, LinearShape, measure_cpu
from batchrun.kernels.elementwise import act_mul_native
from batchrun.kernels.target import DeviceTarget
from batchrun.kernels.tuning import Tuning
from tests.support.models import tied_decoder

BF16 = torch.bfloat16
CPU_NATIVE = DeviceTarget(torch.device("cpu"), None, False, True, False)  # csrc kernels built and on

pytestmark = pytest.mark.skipif(
    not cpu_linear.native_supported(32, 64), reason="native kernels not built here, or built without AVX512-BF16"
)


class ScriptedTimer:
    """Runs every candidate once (so each is a real call on real inputs) and returns the next
    scripted times; records the candidates' names per call."""

    def __init__(self, script: list[dict[str, float]]) -> None:
        self.script = list(script)
        self.calls: list[list[str]] = []
        self.outputs: list[dict[str, torch.Tensor]] = []

    def __call__(self, candidates):
        self.calls.append(list(candidates))
        self.outputs.append({name: fn() for name, fn in candidates.items()})
        return self.script.pop(0)


def test_every_shape_is_timed_at_its_rows_and_a_torch_win_is_timed_again():
    native, torch_wins, tie = (
        {"native": 1.0, "torch": 2.0},
        {"native": 3.0, "torch": 1.0},
        {"native": 1.0, "torch": 1.0},
    )
    timer = ScriptedTimer(
        [
            native,  # attention decode, 8 sequences
            torch_wins,  # attention prefill, 64 tokens of a fresh prompt: torch faster ...
            {"native": 0.9, "torch": 1.0},  # ... timed again: native's faster call was noise-free
            native,  # the same chunk after 256 cached tokens
            native,  # qkv at 1 row
            native,  # qkv at 8 rows
            torch_wins,  # qkv at 64 rows: torch faster ...
            {"native": 2.0, "torch": 1.1, "unpacked": 1.05},  # ... and again, torch over unpacked tiles too
            tie,  # lm_head at 1 row
            native,  # lm_head at 8 rows: a head's largest is its decode batch
        ]
    )
    shapes = [LinearShape("qkv", 128, 64), LinearShape("lm_head", 512, 64, tied=True), LinearShape("qkv", 128, 64)]
    attention = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, scale=0.25)
    found = measure_cpu(shapes, attention, CpuRows(decode=8, prefill=64), timer=timer)
    assert not timer.script  # every scripted timing used: the duplicate shape timed once
    # torch over the tiles unpacked: at the largest rows, where torch wins
    two, three = ["native", "torch"], ["native", "torch", "unpacked"]
    assert timer.calls == [two] * 7 + [three] + [two] * 2
    # the fresh prefill's torch win not confirmed
    want = AttentionChoice(
        NATIVE, NATIVE, KernelTiming(8, 1.0, 2.0), (KernelTiming(64, 0.9, 1.0), KernelTiming(64, 1, 2))
    )
    assert found.attention == want
    fresh, after_context = timer.outputs[1], timer.outputs[3]  # what each path computed: the same attention
    for outputs in (fresh, after_context):
        assert outputs["native"].shape == (64, 4, 16)
        torch.testing.assert_close(outputs["native"].float(), outputs["torch"].float(), atol=2e-2, rtol=2e-2)
    qkv, head = found.linears
    assert (qkv.kind, qkv.small, qkv.large, qkv.torch_form) == ("qkv", NATIVE, TORCH, UNPACKED)
    assert [t.rows for t in qkv.timings] == [1, 8, 64]
    assert qkv.timings[-1] == KernelTiming(64, 2.0, 1.0, 1.05)  # each candidate's faster time
    assert head.kind == "lm_head" and head.is_native and [t.rows for t in head.timings] == [1, 8]
    # the candidates computed what they stand for: the same product by all three, the head's too
    (qkv_out,) = [o for o, names in zip(timer.outputs, timer.calls) if len(names) == 3][:1]
    assert qkv_out["native"].shape == (64, 128)
    torch.testing.assert_close(qkv_out["native"].float(), qkv_out["torch"].float(), atol=1e-2, rtol=2e-2)
    assert torch.equal(qkv_out["torch"], qkv_out["unpacked"])  # oneDNN's packed copy is bitwise F.linear
    assert found.seconds >= 0


def test_the_rows_timed_follow_the_engine_limits():
    assert CpuRows.for_limits(None, None) == CpuRows(32, 256)
    assert CpuRows.for_limits(4, 64) == CpuRows(4, 64)
    assert CpuRows.for_limits(256, 8192) == CpuRows(32, 256)
    assert CpuRows(4, 64).of(LinearShape("down", 64, 128)) == [1, 4, 64]
    assert CpuRows(4, 64).of(LinearShape("lm_head", 512, 64)) == [1, 4]


AMX_LIKE = Tuning(
    "measured",
    cpu_linears=(
        LinearChoice("qkv", 128, 64, TORCH, TORCH),
        LinearChoice("o", 64, 64, NATIVE, TORCH, 8, UNPACKED),
        LinearChoice("gate_up_silu", 256, 64, NATIVE, TORCH, 8, PACKED),
        LinearChoice("down", 64, 128, NATIVE, NATIVE),
        LinearChoice("lm_head", 320, 64, TORCH, TORCH),
    ),
    cpu_attention=AttentionChoice(NATIVE, TORCH),
    seconds=0.5,
)


def test_the_cpu_binder_binds_the_measured_kernels_and_records_them():
    kernels = bind_kernels(CPU_NATIVE, BF16, AMX_LIKE)
    described = kernels.describe()
    assert described["kernels"]["paged_attention"] == (
        "kernels.cpu_attention.paged_attention_cpu(native=True, native_prefill=False)"
    )
    assert [c.kind for c in kernels.linear_float.choices] == ["qkv", "o", "gate_up_silu", "lm_head"]  # not down
    assert described["linears"]["float"]["torch_kernels"][1] == {
        "kind": "o",
        "weight": [64, 64],
        "kernels": "native below 8 rows, torch from 8 (torch over the tiles unpacked per call)",
    }
    assert described["tuning"]["source"] == "measured" and described["tuning"]["cpu_seconds"] == 0.5
    assert [c["kind"] for c in described["tuning"]["cpu_linears"]] == ["qkv", "o", "gate_up_silu", "down", "lm_head"]
    assert described["tuning"]["cpu_attention"]["prefill"] == TORCH
    # float32 and a set without the native kernels: the torch paths, whatever was measured
    for target, dtype in (
        (CPU_NATIVE, torch.float32),
        (DeviceTarget(torch.device("cpu"), None, False, False, False), BF16),
    ):
        other = bind_kernels(target, dtype, AMX_LIKE)
        assert other.linear_float.choices == () and "native_prefill" not in function_name(other.paged_attention)


def function_name(fn) -> str:
    from batchrun.kernels.kernel_set import function_name as name

    return name(fn)


def _tied_model():
    from batchrun.model.prepare import prepare_linears

    model = tied_decoder()
    kernels = bind_kernels(CPU_NATIVE, BF16)
    prepare_linears(model, "none", kernels=kernels)
    return model, kernels


def test_each_layer_takes_the_layout_of_its_choice_and_weight_bytes_count_it():
    from batchrun.model.decoder import MLP
    from batchrun.model.gemm_shapes import cpu_linear_shapes
    from batchrun.model.linear import (
        NativeEmbedding,
        NativeLinear,
        NativeSiluMulLinear,
        PackedLinear,
        RowSplitLinear,
        SiluMulAfter,
        UnpackedTilesLinear,
        count_native_linears,
    )
    from batchrun.model.prepare import apply_linear_choices, module_weight_bytes

    model, kernels = _tied_model()
    assert {(s.kind, s.n, s.k, s.tied) for s in cpu_linear_shapes(model)} == {
        ("qkv", 128, 64, False),
        ("o", 64, 64, False),
        ("gate_up_silu", 256, 64, False),
        ("down", 64, 128, False),
        ("lm_head", 320, 64, True),
    }
    assert cpu_linear_shapes(model)[-1].kind == "lm_head"  # timed last
    before = module_weight_bytes(model)
    apply_linear_choices(model, with_tuning(kernels, AMX_LIKE))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, PackedLinear)
    assert isinstance(attn.o_proj, RowSplitLinear) and attn.o_proj.split_rows == 8
    assert isinstance(attn.o_proj.small, NativeLinear) and isinstance(attn.o_proj.large, UnpackedTilesLinear)
    assert isinstance(mlp.gate_up_proj, RowSplitLinear) and isinstance(mlp.gate_up_proj.small, NativeSiluMulLinear)
    assert isinstance(mlp.gate_up_proj.large, SiluMulAfter) and isinstance(mlp.gate_up_proj.large.linear, PackedLinear)
    assert isinstance(mlp, MLP) and mlp.fused_act  # both sides apply silu(gate) * up
    assert type(mlp.down_proj) is NativeLinear
    assert type(model.lm_head) is torch.nn.Linear and type(model.embed_tokens) is torch.nn.Embedding
    assert model.lm_head.weight is model.embed_tokens.weight  # tied again: the vocabulary held once
    assert count_native_linears(model) == 3 * 2  # o, gate/up (their decode side) and down per layer
    # The memory: the gate/up weights held twice (oneDNN's copy), one buffer as large as the largest
    # unpacked weight (o), shared by the layers; qkv's packed copy replaced its tiles.
    buffers = {id(m.buffer) for m in model.modules() if isinstance(m, UnpackedTilesLinear)}
    assert len({m.buffer.data_ptr() for m in model.modules() if isinstance(m, UnpackedTilesLinear)}) == 1
    assert len(buffers) == 1
    packed_copy = 2 * 256 * 64 * 2  # two layers' gate/up weights, bf16
    assert module_weight_bytes(model) == before + packed_copy + 64 * 64 * 2
    assert isinstance(_tied_model()[0].embed_tokens, NativeEmbedding)  # the static layout, for contrast


@pytest.mark.parametrize("rows", [1, 7, 8, 300])
def test_a_split_layer_gives_each_kernels_own_result_at_its_rows(rows):
    from batchrun.model.linear import NativeLinear
    from batchrun.model.prepare import apply_linear_choices

    model, kernels = _tied_model()
    o_native, gate_up_native = model.layers[0].self_attn.o_proj, model.layers[0].mlp.gate_up_proj
    assert isinstance(o_native, NativeLinear) and isinstance(gate_up_native, NativeLinear)
    o_plain, gate_up_plain = o_native.weight(), gate_up_native.weight()
    qkv_plain = model.layers[0].self_attn.qkv_proj.weight()
    apply_linear_choices(model, with_tuning(kernels, AMX_LIKE))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(BF16)
    with torch.inference_mode():
        if rows < 8:  # the decode side: the native kernels, as before
            assert torch.equal(attn.o_proj(x), o_native(x))
            assert torch.equal(mlp.gate_up_proj(x), gate_up_native(x))
        else:  # oneDNN: bitwise F.linear over the plain weight, then the native silu-mul pass
            assert torch.equal(attn.o_proj(x), F.linear(x, o_plain))
            assert torch.equal(mlp.gate_up_proj(x), act_mul_native(F.linear(x, gate_up_plain), "silu"))
        assert torch.equal(attn.qkv_proj(x), F.linear(x, qkv_plain))  # torch's kernel at every row count


def test_a_table_tuning_changes_no_layer():
    from batchrun.model.prepare import apply_linear_choices

    model, kernels = _tied_model()
    before = [type(m) for m in model.modules()]
    apply_linear_choices(model, with_tuning(kernels, Tuning()))
    native = Tuning("measured", cpu_linears=(LinearChoice("o", 64, 64, NATIVE, NATIVE),))
    apply_linear_choices(model, with_tuning(kernels, native))
    assert [type(m) for m in model.modules()] == before
