"""The decoder's GPU path, run in Triton's interpreter, generates the CPU path's greedy tokens.

On a GPU the decoder runs the Triton kernel set (kernels/bind_triton.py): the fused kernels (q/k-norm
+ rotary + KV write, add + RMSNorm, RMSNorm, silu * up, embedding + norm) and the Triton paged
attention. This test takes that path on the CPU: an interpreted child (TRITON_INTERPRET=1) binds the
Triton kernel set for the CPU target (the interpreter's tiles), runs the engine over it in float32
on a tiny model of two families with different
fused-kernel inputs (Qwen3: q/k-norm, GQA, silu MLP, fused residual adds; Gemma 3: (1 + w) norms,
sliding window, MQA, a gelu MLP, sandwich norms without residual fusion), and compares the tokens
with the plain CPU path's in the same process. It also counts the fused kernels' calls, so a
kernel set that silently took torch's paths would fail it.

Run with an int8 cache (Qwen3) and an fp8 one (Gemma 3), engine.kv_cache_dtype: the Triton kernels
quantize on write and dequantize tiles on read, the CPU path quantizes the same way and dequantizes
what it gathers, so the tokens agree (quantized against quantized: quantization itself may change
tokens against a float cache; with a float cache the same GPU path is checked against HF itself, in
tests/engine/test_gpu_identity.py). In these runs the Triton engine's decode steps go through the CUDA-graph
path (engine/runners/cuda_graphs.py: static buffers, bucket padding), with EagerReplay standing in for the
capture, as on a GPU where every decode step replays a graph.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.engines import make_tiny_engine
from tests.support.interpreted import interpreted_rows

pytest.importorskip("triton")

PROMPTS = ["The quick brown fox jumps over", "Lists are mutable sequences"]


def run(model_dir: str, kv_cache_dtype: str) -> dict:
    import torch

    import batchrun.kernels.triton_attention as ta
    import batchrun.kernels.triton_elementwise as tew
    from batchrun import SamplingParams
    from batchrun.engine.runners import GpuRunner
    from batchrun.kernels.binding import bind_kernels
    from batchrun.kernels.target import find_target

    replays = []

    def generate(graphs: bool = False) -> list[list[int]]:
        # the GPU path: the Triton kernel set, on CPU tensors (the interpreter's tiles)
        kernels = None
        if graphs:
            kernels = bind_kernels(find_target("cpu"), torch.float32, kv_cache_dtype=kv_cache_dtype, binder="triton")
        engine = make_tiny_engine(
            model_dir,
            kernels=kernels,
            kv_cache_memory=4 << 20,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            kv_cache_dtype=kv_cache_dtype,
        )
        if graphs:
            engine.runner = r = GpuRunner.stand_in(engine.runner, 8)  # EagerReplay standing in for capture
            graph_execute = r.graphs.execute
            r.graphs.execute = lambda batch: replays.append(len(batch.requests)) or graph_execute(batch)
        return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0))]

    want = generate()
    calls = {"qkv_norm_rope_write": 0, "add_rms_norm": 0, "rms_norm": 0, "silu_mul": 0, "paged_attention": 0}
    # Counted for this case only (patched before the kernel set is bound, which takes paged_attention).
    saved = []
    for name in calls:
        module = ta if name == "paged_attention" else tew
        original = getattr(module, name)
        saved.append((module, name, original))

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
    try:
        got = generate(graphs=True)
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    return {"same": got == want, "want": want, "got": got, "calls": calls, "replays": len(replays)}


# With a float cache the same path is checked against HF itself (tests/engine/test_gpu_identity.py).
CASES = [("qwen3", "int8"), ("gemma3_text", "fp8")]


@pytest.fixture(scope="module")
def interpreted(tiny_model_factory) -> dict[str, dict]:
    """One child for every case (each child pays torch's and Triton's imports again)."""
    args = [f"{family}:{kv}={tiny_model_factory(family)}" for family, kv in CASES]
    return {row["case"]: row for row in interpreted_rows(__file__, *args, timeout=900)}


@pytest.mark.parametrize("family,kv_cache_dtype", CASES)
def test_decoder_triton_path_generates_the_cpu_tokens_interpreted(family, kv_cache_dtype, interpreted):
    result = interpreted[f"{family}:{kv_cache_dtype}"]
    assert result["same"], result
    calls = result["calls"]
    assert calls["qkv_norm_rope_write"] > 0 and calls["paged_attention"] > 0, calls
    assert result["replays"] > 0, "no decode step went through the graph path"
    if family == "gemma3_text":  # sandwich norms: plain RMSNorm only, the residual added apart; gelu
        assert calls["rms_norm"] > 0, calls
    else:
        assert calls["add_rms_norm"] > 0 and calls["silu_mul"] > 0, calls


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        case, _, model_dir = arg.partition("=")
        print(json.dumps({"case": case, **run(model_dir, case.split(":")[1])}), flush=True)
