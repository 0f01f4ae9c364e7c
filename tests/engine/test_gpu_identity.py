"""Float32 greedy on the GPU dispatch path is token-identical to HF transformers, for every family.

On a GPU (`-m gpu`): HF float32 `generate` on the same GPU against the engine there (Triton
attention, the fused elementwise kernels, rotary tables read by position), prompts longer than the
tiny Mistral/Gemma 3 sliding windows, 32 tokens each. On the CPU the same logic in Triton's
interpreter: a child process runs the engine over the kernel set of a simulated sm_90 (kernels/target.py),
so CPU tensors take every kernel CUDA tensors take and the launchers size their tiles for that GPU
(float32 dots in IEEE precision, decode tiles of 128 tokens), against HF float32 on the CPU.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from batchrun.testing import FAMILIES, sample_texts
from tests.support.engines import make_tiny_engine

MAX_TOKENS = 32


def _prompts(num: int) -> list[str]:
    texts = sample_texts()
    lengths = [40, 300, 120, 15, 420, 90, 260, 200][:num]  # most past the windows (16 and 24 tokens)
    return [texts[i][:n] for i, n in enumerate(lengths)]


def _hf_greedy(model_dir: str, prompts: list[str], device: str, max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids.to(device)
        gen = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def _engine_greedy(
    model_dir: str, prompts: list[str], device: str, max_new_tokens: int, simulate=None
) -> list[list[int]]:
    from batchrun import SamplingParams

    engine = make_tiny_engine(
        model_dir, simulate=simulate, device=device, kv_cache_memory=32 << 20, max_num_batched_tokens=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)  # stops at EOS, as HF does
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_greedy_matches_hf_on_gpu(family, tiny_model_factory):
    model_dir = tiny_model_factory(family)
    prompts = _prompts(8)
    want = _hf_greedy(model_dir, prompts, "cuda", MAX_TOKENS)
    got = _engine_greedy(model_dir, prompts, "cuda", MAX_TOKENS)
    diverged = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not diverged, "; ".join(_divergence(model_dir, prompts[i], got[i], want[i]) for i in diverged)


def _divergence(model_dir: str, prompt: str, got: list[int], want: list[int]) -> str:
    """Where a prompt's tokens part, and HF's own top-2 logit margin there: a margin near float32's
    resolution says a near-tie that any change of reduction order may flip (the tiny random models'
    logits are flat), a wide one a real difference in the computation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step = next(j for j, (g, w) in enumerate(zip(got + [-1], want + [-2])) if g != w)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    ids = torch.tensor([tok(prompt).input_ids + want[:step]], device="cuda")
    with torch.no_grad():
        logits = hf(ids).logits[0, -1]
    top = torch.topk(logits, 2)
    margin = (top.values[0] - top.values[1]).item()
    return (
        f"diverges at token {step} (engine {got[step : step + 1]}, hf {want[step : step + 1]}): hf's top-2 margin "
        f"{margin:.3e} ({margin / max(abs(top.values[0].item()), 1e-30):.1e} relative), tokens {top.indices.tolist()}"
    )


# The interpreter is slow: fewer prompts and tokens, still past the windows; one child for every
# family (each child pays torch's, transformers' and Triton's imports again).
INTERPRETED = ["llama", "mistral", "qwen3", "gemma3_text"]


@pytest.fixture(scope="module")
def interpreted_results(tiny_model_factory) -> dict[str, dict]:
    from tests.support.interpreted import interpreted_rows

    pytest.importorskip("triton")
    dirs = [f"{family}={tiny_model_factory(family)}" for family in INTERPRETED]
    return {row["family"]: row for row in interpreted_rows(__file__, *dirs, timeout=1200)}


@pytest.mark.parametrize("family", INTERPRETED)
def test_fp32_greedy_on_the_gpu_path_matches_hf_interpreted(family, interpreted_results):
    result = interpreted_results[family]
    assert result["calls"]["_decode_kernel"] > 0 and result["calls"]["_qkv_kernel"] > 0, result
    assert result["got"] == result["want"], result


def _child(family: str, model_dir: str) -> dict:
    from benchmarks.gpu_launches import SM90, count_launches

    prompts, tokens = _prompts(3), 10
    want = _hf_greedy(model_dir, prompts, "cpu", tokens)
    with count_launches() as launches:
        got = _engine_greedy(model_dir, prompts, "cpu", tokens, simulate=SM90)
    calls = {k.split(":", 1)[1]: v for k, v in launches.kernels.items() if k.startswith("triton:")}
    return {"family": family, "got": got, "want": want, "calls": calls}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        name, _, path = arg.partition("=")
        print(json.dumps(_child(name, path)), flush=True)
