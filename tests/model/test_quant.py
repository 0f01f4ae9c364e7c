"""Quantized formats, kernels and layers: round-trip bounds, exact packing, GGUF block mapping,
the CPU kernels against the torch references, and quantized engines on a tiny model (no network)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchrun.kernels import quant as qk
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.binding import bind_kernels
from batchrun.kernels.target import find_target
from batchrun.model import quant as mq
from batchrun.model.gguf import blocks_to_weight, read_gguf_weights, unpermute_rows
from batchrun.model.prepare import module_weight_bytes, quantize_model
from tests.support.engines import make_tiny_engine


def _weights(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier: it sets its row's (or group's) scale
    w[5] = 0.0  # an all-zero row must not divide by zero
    return w


# ---- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_round_trip_is_within_half_a_step(group_size):
    w = _weights()
    q, s = qk.quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and s.shape == (48, 1 if group_size is None else 4)
    err = (qk.dequantize_int8(q, s) - w).abs().reshape(48, s.shape[1], -1)
    assert (err <= s[..., None] / 2 + 1e-7).all()
    assert torch.equal(qk.dequantize_int8(q, s)[5], torch.zeros(128))


def test_int4_packing_round_trips_exactly():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = qk.pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(qk.unpack_int4(packed), q)
    assert torch.equal(packed[0, 0], q[0, 0] | (q[0, 1] << 4))  # even k in the low nibble


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step(group_size):
    w = _weights()
    packed, scales, mins = qk.quantize_int4(w, group_size)
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape == (48, 128 // group_size)
    deq = qk.dequantize_int4(packed, scales, mins)
    err = (deq - w).abs().reshape(48, scales.shape[1], -1)
    # Half a step, plus the float16 rounding of the stored min (the step is computed against it).
    slack = mins.float().abs()[..., None] * 2**-10 + 1e-6
    assert (err <= scales.float()[..., None] / 2 + slack).all()


def test_fp8_round_trip_relative_error():
    w = _weights()
    q, s = qk.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (48, 1)
    err = (qk.dequantize_fp8(q, s) - w).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative; tiny values fall to subnormals.
    assert (err <= w.abs() / 16 + s * 2**-9 + 1e-9).all()


def test_effective_group_size_divides_the_input_dim():
    assert mq.effective_group_size(576, 128) == 64  # SmolLM2's hidden size
    assert mq.effective_group_size(1536, 128) == 128
    assert mq.effective_group_size(96, 64) == 32


# ---- matmuls --------------------------------------------------------------------------------------


def test_w8a8_matches_the_float_matmul_and_is_batch_invariant():
    w = _weights(96, 128)
    x = torch.randn(9, 128) * torch.linspace(0.1, 4.0, 128)  # uneven channels, like real activations
    q, s = qk.quantize_int8(w)
    y = qk.w8a8_matmul(x, q, s)
    ref = x @ qk.dequantize_int8(q, s).T
    assert ((y - ref).norm() / ref.norm()).item() < 0.01
    # Per-token scales and an exact int32 sum: a row's result does not depend on its batch.
    for i in range(9):
        assert torch.equal(qk.w8a8_matmul(x[i : i + 1], q, s), y[i : i + 1])


def test_cpu_int8_kernel_matches_the_reference():
    w = _weights(96, 128)
    q, s = qk.quantize_int8(w)
    x = torch.randn(3, 128).bfloat16()
    got = qk.int8_weight_matmul_cpu(x, q, s[:, 0].bfloat16()).float()
    want = qk.int8_weight_matmul(x.float(), q, s)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group_size", [32, 64])
def test_cpu_int4_kernel_matches_the_reference(group_size):
    w = _weights(96, 128)
    packed, scales, mins = qk.quantize_int4(w, group_size)
    x = torch.randn(5, 128)
    cpu_w, scales_zeros = qk.int4_pack_for_cpu(packed, scales, mins)
    got = qk.int4_matmul_cpu(x.bfloat16(), cpu_w, group_size, scales_zeros).float()
    want = qk.int4_weight_matmul(x, packed, scales, mins)
    assert ((got - want).norm() / want.norm()).item() < 0.01


@pytest.mark.parametrize(
    "fmt,dtype,max_rel",
    [
        ("int8", torch.float32, 1e-6),
        ("int8", torch.bfloat16, 0.01),
        ("w8a8", torch.float32, 0.01),
        ("int4", torch.float32, 1e-6),
        ("int4", torch.bfloat16, 0.01),
        ("fp8", torch.float32, 1e-6),
    ],
)
def test_quant_linear_layers_match_the_dequantized_weight(fmt, dtype, max_rel):
    w = _weights(96, 128)
    bias = torch.randn(96)
    qw = mq.quantize_weight(w, "int8" if fmt == "w8a8" else fmt, 64)
    layer = mq.make_linear(qw, fmt, bias, dtype)
    for rows in (1, 2, 17):  # the int8 CPU path changes kernel with the row count
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        want = x @ qw.dequantize().T + bias
        got = layer(x.to(dtype)).float()
        assert ((got - want).norm() / want.norm()).item() < max_rel, (fmt, dtype, rows)


# ---- KV cache -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype,max_rel", [("int8", 0.01), ("fp8", 0.07)])
def test_quantized_kv_cache_round_trip(kv_dtype, max_rel):
    cache = qk.QuantizedKVCache.empty((4, 8, 2, 16), qk.KV_CACHE_DTYPES[kv_dtype], torch.float32, torch.device("cpu"))
    x = torch.randn(5, 2, 16) * torch.tensor([1.0, 30.0])[None, :, None]  # heads of very different size
    slots = torch.tensor([0, 3, 8, 9, 31])
    cache.write(x, slots)
    got = cache.gather_slots(slots).transpose(0, 1)  # (num_kv_heads, slots, dim) -> (slots, num_kv_heads, dim)
    assert ((got - x).norm(dim=-1) / x.norm(dim=-1)).max().item() < max_rel
    assert cache[torch.tensor([[1, 0]])].shape == (1, 2, 8, 2, 16)
    assert cache.nbytes() == 4 * 8 * 2 * (16 + 4)


@pytest.mark.parametrize("kv_dtype,qmax", [("int8", 127.0), ("fp8", 448.0)])
def test_kv_scale_is_amax_times_the_float32_reciprocal_of_qmax(kv_dtype, qmax):
    """The scale is max(amax * fl32(1 / qmax), MIN_SCALE): one float32 product, the same operation
    on every device (CUDA torch evaluates `amax / python_float` as amax * (1 / qmax), CPU torch as a
    true division, Triton's div_rn as a true division; they differ by an ulp on a few rows in a
    hundred, and an ulp of scale moves an element across a rounding boundary)."""
    amax = np.abs(np.random.default_rng(0).standard_normal(4000).astype(np.float32)) * np.float32(3.0)
    amax = np.concatenate([amax, np.float32([0.0, 1e-12, qmax])])
    want = np.maximum(amax * np.float32(1.0 / qmax), np.float32(1e-10))
    assert (amax / np.float32(qmax) != amax * np.float32(1.0 / qmax)).sum() > 10  # the rows that tell them apart
    x = torch.zeros(amax.size, 1, 8)
    x[:, 0, 3] = -torch.from_numpy(amax)  # amax carried by a negative entry: |x| is what counts
    _, scale = qk.quantize_kv(x, qk.KV_CACHE_DTYPES[kv_dtype])
    assert np.array_equal(scale[:, 0].numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_write_skips_negative_slots(kv_dtype):
    """Rows with slot -1 (CUDA-graph padding, capture_all's dummies) write nothing: the cache ends
    up as if only the other rows were written, also when a real row writes slot 0 (where the
    skipped rows' stand-in write would land) and when no row has a slot at all."""
    dtype = qk.KV_CACHE_DTYPES[kv_dtype]

    def cache_with_content() -> qk.QuantizedKVCache:
        cache = qk.QuantizedKVCache.empty((4, 8, 2, 16), dtype, torch.float32, torch.device("cpu"))
        cache.write(torch.randn(32, 2, 16, generator=torch.Generator().manual_seed(1)), torch.arange(32))
        return cache

    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(2))
    for slots in ([-1, 0, 5, -1, 17, -1], [3, -1, 0, 9, 30, 12], [-1] * 6, [0, -1, -1, -1, -1, -1]):
        slots = torch.tensor(slots)
        keep = slots >= 0
        got, want = cache_with_content(), cache_with_content()
        got.write(x, slots)
        want.write(x[keep], slots[keep])
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), slots
        assert torch.equal(got.scale, want.scale), slots
    got, want = cache_with_content(), cache_with_content()
    got.write(x[:0], torch.zeros(0, dtype=torch.long))  # an empty step
    assert torch.equal(got.scale, want.scale)


def test_paged_attention_over_an_int8_cache_is_close_to_float():
    torch.manual_seed(0)
    num_blocks, bs, kvh, hd, heads = 6, 4, 2, 16, 4
    float_k = torch.zeros(num_blocks, bs, kvh, hd)
    float_v = torch.zeros_like(float_k)
    qk_cache = qk.QuantizedKVCache.empty((num_blocks, bs, kvh, hd), torch.int8, torch.float32, torch.device("cpu"))
    qv_cache = qk.QuantizedKVCache.empty((num_blocks, bs, kvh, hd), torch.int8, torch.float32, torch.device("cpu"))
    k, v, q = torch.randn(10, kvh, hd), torch.randn(10, kvh, hd), torch.randn(10, heads, hd)
    slots = torch.arange(10) + 4  # blocks 1..3
    # One sequence of 10 tokens: the first 9 already cached, the last one decoding.
    meta = AttentionMetadata(
        slot_mapping=slots[9:],
        query_start_loc=[0, 1],
        seq_lens=[10],
        block_tables=torch.tensor([[1, 2, 3]]),
        block_size=bs,
        decode_seq_ids=torch.tensor([0]),
        decode_seq_lens=torch.tensor([10]),
        prefill_seq_ids=[],
    )
    kernels = bind_kernels(find_target("cpu"), torch.float32)  # the engine's CPU path
    kernels.write_kv_cache(float_k, float_v, k, v, slots)
    kernels.write_kv_cache(qk_cache, qv_cache, k, v, slots)
    want = kernels.paged_attention(q[9:], float_k, float_v, meta, hd**-0.5)
    got = kernels.paged_attention(q[9:], qk_cache, qv_cache, meta, hd**-0.5)
    assert ((got - want).norm() / want.norm()).item() < 0.01


# ---- GGUF blocks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_map_exactly_onto_our_formats(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    w = _weights(16, 96).numpy()
    raw = quantize(w, qtype)  # (16, bytes per row) uint8
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    got = blocks_to_weight(raw, type_name, 16, 96)
    assert got.format == ("int8" if type_name == "Q8_0" else "int4") and got.group_size == 32
    assert torch.equal(got.dequantize(), want)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (the inverse of transformers' un-permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_file_reads_natively_with_q_and_k_rows_unpermuted(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    num_heads, num_kv_heads, hidden = 4, 2, 64
    head_dim = hidden // num_heads
    hf = {
        "q": _weights(hidden, hidden, 1).numpy(),
        "k": _weights(num_kv_heads * head_dim, hidden, 2).numpy(),
        "down": _weights(hidden, 128, 3).numpy(),
        "embd": _weights(100, hidden, 4).numpy(),
    }
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_block_count(1)
    for gguf_name, arr, qtype in [
        ("blk.0.attn_q.weight", _llama_cpp_permute(hf["q"], num_heads), GGMLQuantizationType.Q4_1),
        ("blk.0.attn_k.weight", _llama_cpp_permute(hf["k"], num_kv_heads), GGMLQuantizationType.Q4_0),
        ("blk.0.ffn_down.weight", hf["down"], GGMLQuantizationType.Q4_1),
        ("token_embd.weight", hf["embd"], GGMLQuantizationType.Q8_0),
        ("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32), GGMLQuantizationType.F32),
    ]:
        data = arr if qtype == GGMLQuantizationType.F32 else quantize(arr, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    got = read_gguf_weights(str(tmp_path / "m.gguf"))
    assert set(got) == {
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.k_proj",
        "layers.0.mlp.down_proj",
        "embed_tokens",
    }
    for name, key, qtype in [
        ("layers.0.self_attn.q_proj", "q", GGMLQuantizationType.Q4_1),
        ("layers.0.self_attn.k_proj", "k", GGMLQuantizationType.Q4_0),
    ]:
        # Quantizing the permuted rows and un-permuting equals quantizing the HF rows: blocks are per row.
        want = dequantize(quantize(hf[key], qtype), qtype)
        assert torch.equal(got[name].dequantize(), torch.from_numpy(want.astype(np.float32)))
    assert got["embed_tokens"].format == "int8" and got["embed_tokens"].qweight.shape == (100, hidden)


def test_unpermute_rows_is_transformers_reverse_permute():
    w = mq.quantize_weight(_weights(32, 64), "int4", 32)
    got = unpermute_rows(w, num_heads=2).dequantize().numpy()
    x = w.dequantize().numpy()
    want = x.reshape(2, 8, 2, 64).swapaxes(2, 1).reshape(x.shape)  # transformers' _reverse_permute_weights
    assert np.array_equal(got, want)


# ---- whole models -------------------------------------------------------------------------------


def _tiny_decoder(model_dir: str, dtype=torch.float32):
    from batchrun.model.decoder import DecoderLM
    from batchrun.model.loader import load_model

    loaded = load_model(model_dir)
    model = DecoderLM(loaded.config).to(dtype)
    model.load_hf_state_dict(loaded.state_dict)
    return model.eval()


def test_smoothing_moves_activation_ranges_into_weights_without_changing_the_output(tiny_llama_dir):
    from batchrun.engine.quantization import prefill_forward

    model = _tiny_decoder(tiny_llama_dir)
    ids = list(range(5, 70))
    run = prefill_forward(model, 16, torch.float32, torch.device("cpu"))
    absmax = mq.collect_input_absmax(model, run, [ids])
    assert set(absmax) == {n for n, _ in mq.projections(model)} and all(a.dim() == 1 for a in absmax.values())
    outputs = []
    hook = model.register_forward_hook(lambda _m, _i, out: outputs.append(out.clone()))  # the final hidden states
    run(ids)
    assert mq.smooth_activations(model, dict(absmax)) == 3 * model.spec.num_layers  # qkv, gate_up, down
    run(ids)
    hook.remove()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)  # exact up to float rounding
    after = mq.collect_input_absmax(model, run, [ids])
    name = "layers.0.self_attn.qkv_proj"
    # the largest input channel shrinks relative to the typical one: flatter per-token int8 steps
    assert (after[name].max() / after[name].median()) < (absmax[name].max() / absmax[name].median())


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4", "fp8"])
def test_quantize_model_swaps_the_projections_and_shrinks_the_weights(mode, tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir)
    float_bytes = module_weight_bytes(model)
    summary = quantize_model(model, mode, group_size=32, include_embeddings=True)
    num_layers = model.spec.num_layers
    assert summary.num_quantized == 4 * num_layers + 2  # 4 projections per layer, embedding, LM head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.embed_tokens, mq.QuantEmbedding)
    assert module_weight_bytes(model) < 0.4 * float_bytes


def test_quantize_model_none_leaves_the_model_alone(tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_model(model, "none").num_quantized == 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_gguf_mode_needs_gguf_blocks(tiny_llama_dir):
    with pytest.raises(ValueError, match="GGUF"):
        quantize_model(_tiny_decoder(tiny_llama_dir), "gguf")


def test_engine_config_validates_quantization_fields():
    from batchrun.engine import EngineConfig

    for kwargs, field in [
        (dict(quantization="int3"), "engine.quantization"),
        (dict(quant_group_size=48), "engine.quant_group_size"),
        (dict(kv_cache_dtype="int4"), "engine.kv_cache_dtype"),
        (dict(w8a8_outlier_channels=-1), "engine.w8a8_outlier_channels"),
        (dict(w8a8_outlier_channels=2.5), "engine.w8a8_outlier_channels"),
        (dict(quantization="w4a8", quant_group_size=64), "engine.quant_group_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "mode,kv_dtype,dtype,linear_key",
    [
        ("int4", "int8", "float32", {"linear:int4/g32": 4}),
        # an eighth of the input channels in float: 8 of the 64 hidden, 16 of down_proj's 128
        ("w8a8", "fp8", "bfloat16", {"linear:w8a8/float8": 3, "linear:w8a8/float16": 1}),
        ("w4a8", "int8", "bfloat16", {"linear:w4a8/g32": 4}),
    ],
)
def test_quantized_engine_runs_through_the_whole_job(
    mode, kv_dtype, dtype, linear_key, tmp_path, make_shards, tiny_llama_dir
):
    import json

    from batchrun.engine import Engine, EngineConfig, SamplingParams
    from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job

    engine_cfg = EngineConfig(
        model=tiny_llama_dir,
        dtype=dtype,
        quantization=mode,
        quant_group_size=32,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=16 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=512,
    )
    engine = Engine(engine_cfg)
    ids = make_shards(tmp_path / "in", num_shards=1, rows_per_shard=3)
    cfg = RunConfig(
        job=JobConfig(name="summarize", prompt_template="Summarize:\n{text}"),
        model=ModelConfig(path=tiny_llama_dir),
        engine=engine_cfg,
        sampling=SamplingParams(temperature=0.0, max_tokens=6),
        data=DataConfig(uri=str(tmp_path / "in")),
        output=OutputConfig(uri=str(tmp_path / "out")),
        quiet=True,
    )
    result = run_job(cfg, engine=engine)
    assert result.exit_code == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "results" / "part-00.parquet").to_pylist()
    assert [r["id"] for r in rows] == ids[0] and all(r["error_type"] is None for r in rows)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    settings = manifest["engine_settings"]
    assert settings["quantization"] == mode and settings["kv_cache_dtype"] == kv_dtype
    assert settings["quant_formats"] == {k: n * engine.model.spec.num_layers for k, n in linear_key.items()}
    assert settings["w8a8_outlier_channels"] == (64 if mode == "w8a8" else None)
    assert manifest["config"]["engine"]["quantization"] == mode


def test_int8_kv_cache_halves_kv_bytes_and_keeps_greedy_close(tiny_llama_dir):
    from batchrun.engine import Engine, EngineConfig, SamplingParams

    common = dict(
        model=tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=256
    )
    plain, int8 = Engine(EngineConfig(**common)), Engine(EngineConfig(**common, kv_cache_dtype="int8"))
    # head_dim 16: 16 int8 + a 4-byte scale per token and head, against 64 bytes in float32.
    assert int8.kv.num_blocks >= 3 * plain.kv.num_blocks
    prompts = ["def read(path):\n    with open(path) as f:", "The following sections describe"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    a, b = plain.generate(prompts, params), int8.generate(prompts, params)
    assert sum(x == y for o, p in zip(a, b) for x, y in zip(o.token_ids, p.token_ids)) >= 0.75 * 24


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_fresh_prompt_attends_to_its_keys_as_a_quantized_cache_holds_them(kv_dtype):
    """Handing attention this step's K/V (the fresh-prompt shortcut) must not change what a prompt
    over a quantized cache sees: a prefix served from the cache is read quantized, so the prompt
    computed whole must read its own tokens quantized too, or prefix caching changes outputs."""
    from batchrun.kernels.cpu_attention import paged_attention_cpu
    from benchmarks.cases import attention_case

    case = attention_case([(0, 9), (0, 5), (6, 1)], 4, 2, 16, 4, kv_cache_dtype=kv_dtype)
    args = (case.q, case.k_cache, case.v_cache, case.meta, 16**-0.5)
    for native in (False, True):  # the torch path, and the native kernels where they take the cache
        torch.testing.assert_close(
            paged_attention_cpu(*args, k_new=case.k_new, v_new=case.v_new, native=native),
            paged_attention_cpu(*args, native=native),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_kv_cache_leaves_greedy_unchanged_by_prefix_caching_chunking_and_batch_size(
    tiny_llama_dir, kv_dtype, one_torch_thread
):
    """Every path reads the same quantized K/V: a prompt attends to its own tokens as the cache
    holds them, so a prefix served from the cache, a prompt cut into chunks, or one sequence at a
    time gives the tokens of one full-batch run with every prompt computed."""
    from batchrun.engine import Engine, EngineConfig, SamplingParams

    stem = "The weather report for the coming week says that the mornings will be cold and "
    prompts = [stem + "the sun", stem + "the rain falls", "Once upon a time there was", "def main(): return"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(
        model=tiny_llama_dir,
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        kv_cache_dtype=kv_dtype,
    )
    runs = {}
    for name, change in {
        "no prefix cache": dict(enable_prefix_caching=False),
        "prefix cache": {},
        "chunks of 8 tokens": dict(max_num_batched_tokens=8),
        "one sequence at a time": dict(max_num_seqs=1),
    }.items():
        engine = Engine(EngineConfig(**{**common, **change}))
        runs[name] = [o.token_ids for o in engine.generate(prompts, params)]
        if name == "prefix cache":  # the same prompts again: their full blocks come from the cache
            again = engine.generate(prompts, params)
            assert all(o.metrics.num_cached_tokens >= 16 for o in again[:2])
            runs["prefix cache, served from it"] = [o.token_ids for o in again]
    want = runs.pop("no prefix cache")
    assert {name: got == want for name, got in runs.items()} == dict.fromkeys(runs, True)


def test_w8a8_float_outlier_channels_cut_the_error_of_outlier_heavy_activations():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * 0.05
    x = torch.randn(40, 256, generator=gen)
    x[:, [3, 100, 201]] *= 60.0  # a few channels far larger than the rest, in every token
    absmax = x.abs().amax(dim=0)
    want = x @ w.t()
    plain = mq.W8A8Linear(mq.quantize_weight(w, "int8"))
    zeroed, outliers = mq.split_outlier_channels(w, absmax, 8)
    assert {3, 100, 201} <= set(outliers.index.tolist())
    assert outliers.skip.sum() == 8 and torch.all(zeroed[:, outliers.skip] == 0)
    split = mq.W8A8Linear(mq.quantize_weight(zeroed, "int8"), outliers=outliers)
    assert split.format_key == "w8a8/float8"
    err_plain = (plain(x) - want).abs().mean()
    err_split = (split(x) - want).abs().mean()
    assert err_split < 0.25 * err_plain, (err_split, err_plain)
    # the float channels go where the module goes
    moved = split.to(torch.bfloat16)
    assert moved.outliers.weight_t.dtype == torch.bfloat16 and moved.outliers.weight_t is moved.outlier_weight_t
    assert (moved(x.bfloat16()).float() - want).abs().mean() < 0.5 * err_plain


def test_w8a8_calibrated_model_keeps_an_eighth_at_most_in_float(tiny_llama_dir):
    model = _tiny_decoder(tiny_llama_dir)
    absmax = {name: torch.rand(lin.in_features) + 0.1 for name, lin in mq.projections(model)}
    summary = quantize_model(model, "w8a8", input_absmax=absmax, outlier_channels=64)
    assert summary.formats == {
        "linear:w8a8/float8": 3 * model.spec.num_layers,
        "linear:w8a8/float16": model.spec.num_layers,
    }
    plain = quantize_model(_tiny_decoder(tiny_llama_dir), "w8a8", input_absmax=absmax, outlier_channels=0)
    assert plain.formats == {"linear:w8a8": 4 * model.spec.num_layers}


def test_the_quantization_benchmark_measures_summarize_from_an_empty_prefix_cache(tiny_llama_dir, monkeypatch):
    # Its rounds repeat the same prompts: without the reset, a mode whose KV cache keeps more
    # blocks (int8) served later rounds from cached prefixes and showed a false speed-up.
    from benchmarks.workloads import summarize_tokens_per_s

    engine = make_tiny_engine(
        tiny_llama_dir, kv_cache_memory=16 << 20, max_num_seqs=4, max_num_batched_tokens=256, block_size=16
    )
    prompts = [[5 + (7 * i + j) % 150 for j in range(40)] for i in range(3)]
    generate = engine.generate
    cached = []
    monkeypatch.setattr(
        engine, "generate", lambda *a, **k: [cached.append(o.metrics.num_cached_tokens) or o for o in generate(*a, **k)]
    )
    for _ in range(2):
        summarize_tokens_per_s(engine, prompts)
    assert len(cached) == 6 and cached == [0] * 6
