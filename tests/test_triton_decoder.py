"""The decoder's GPU path, run in Triton's interpreter, generates the CPU path's greedy tokens.

On a CUDA tensor the decoder takes the fused Triton kernels (q/k-norm + rotary + KV write, add +
RMSNorm, RMSNorm, silu * up) and the Triton paged attention. This test takes that path on the CPU:
an interpreted child (TRITON_INTERPRET=1) makes the dispatch's one "can Triton run here?" check say
yes for CPU tensors, runs the engine in float32 on a tiny model of two families with different
fused-kernel inputs (Qwen3: q/k-norm, GQA, silu MLP, fused residual adds; Gemma 3: (1 + w) norms,
sliding window, MQA, a gelu MLP, sandwich norms without residual fusion), and compares the tokens
with the plain CPU path's in the same process. It also counts the fused kernels' calls, so a
dispatch that silently fell back to torch would fail it.
"""

from __future__ import annotations

import json
import sys

import pytest
from triton_child import run_interpreted

pytest.importorskip("triton")

PROMPTS = ["The quick brown fox jumps over", "Lists are mutable sequences"]


def run(model_dir: str, kv_cache_dtype: str) -> dict:
    import batchrun.kernels.attention as attention
    import batchrun.kernels.elementwise as ew
    import batchrun.kernels.triton_attention as ta
    import batchrun.kernels.triton_elementwise as tew
    from batchrun import Engine, EngineConfig, SamplingParams

    def generate() -> list[list[int]]:
        engine = Engine(
            EngineConfig(
                model=model_dir,
                dtype="float32",
                device="cpu",
                kv_cache_memory=4 << 20,
                max_num_seqs=4,
                max_num_batched_tokens=256,
                kv_cache_dtype=kv_cache_dtype,
            )
        )
        return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0))]

    want = generate()
    calls = {"qkv_norm_rope_write": 0, "add_rms_norm": 0, "rms_norm": 0, "silu_mul": 0, "paged_attention": 0}
    for name in calls:
        module = ta if name == "paged_attention" else tew
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
    attention.triton_usable = ew.triton_usable = lambda x: True  # the GPU path, on CPU tensors
    got = generate()
    return {"same": got == want, "want": want, "got": got, "calls": calls}


@pytest.mark.parametrize(
    "family,kv_cache_dtype", [("qwen3", "auto"), ("gemma3_text", "auto"), ("qwen3", "int8"), ("gemma3_text", "fp8")]
)
def test_decoder_triton_path_generates_the_cpu_tokens_interpreted(family, kv_cache_dtype, tiny_model_factory):
    proc = run_interpreted(__file__, tiny_model_factory(family), kv_cache_dtype, timeout=600)
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"], result
    calls = result["calls"]
    assert calls["qkv_norm_rope_write"] > 0 and calls["paged_attention"] > 0, calls
    if family == "gemma3_text":  # sandwich norms: plain RMSNorm only, the residual added apart; gelu
        assert calls["rms_norm"] > 0, calls
    else:
        assert calls["add_rms_norm"] > 0 and calls["silu_mul"] > 0, calls


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])), flush=True)
