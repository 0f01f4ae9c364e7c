"""engine.batch_invariant on the GPU dispatch path: in bf16 a row's greedy tokens and logprobs are
bitwise the same alone, in a batch, and with its prompt chunked.

There every linear (the LM head and an MoE router included) runs the batch-invariant Triton matmul
instead of cuBLAS, MoE experts the fixed-tile grouped GEMM with a fixed-order sum over a token's
experts, and attention the prefill kernel on a fixed KV grid. On the CPU the same logic runs in
Triton's interpreter: one child process runs the engine over the kernel set of a simulated sm_90
(kernels/target.py), so CPU tensors take every kernel CUDA tensors take, for a dense and an MoE
family. On a GPU (`-m gpu`) every family, with longer prompts and outputs.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from batchrun.testing import FAMILIES, sample_texts
from tests.support.engines import make_tiny_engine

INTERPRETED_FAMILIES = ("llama", "qwen3_moe")


def _prompts(n: int, max_chars: int) -> list[str]:
    """n real-text prompts of 10 to max_chars characters (about 2 characters a token)."""
    texts = sample_texts()
    return [texts[3 + i][: 10 + (37 * i) % (max_chars - 9)] for i in range(n)]


def _engine(model: str, device: str, budget: int, simulate=None, **kw):
    return make_tiny_engine(
        model,
        simulate=simulate,
        dtype="bfloat16",
        device=device,
        max_num_seqs=32,
        max_num_batched_tokens=budget,
        kv_cache_memory=32 << 20,
        batch_invariant=True,
        **kw,
    )


def _rows(engine, prompts: list[str], max_tokens: int) -> list[tuple]:
    """Per prompt: (greedy tokens, the logprob of each)."""
    from batchrun.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]) for o in engine.generate(prompts, params)]


def compare(
    model: str, device: str, num_prompts: int, max_chars: int, max_tokens: int, chunk_budget: int, simulate=None
) -> dict[str, bool]:
    """Whether each way of computing the rows gives the rows of all prompts at once, whole
    (`simulate`: the GPU whose kernel set a CPU engine runs)."""
    prompts = _prompts(num_prompts, max_chars)
    plain = _engine(model, device, 512, simulate)
    want = _rows(plain, prompts, max_tokens)
    chunked = _engine(model, device, chunk_budget, simulate, enable_prefix_caching=False)
    return {
        "alone": _rows(plain, prompts[1:2], max_tokens) == want[1:2],  # its prefix now from the cache
        "batch": _rows(plain, prompts[:3], max_tokens) == want[:3],
        "chunked": _rows(chunked, prompts, max_tokens) == want,  # prompts cut into chunk_budget tokens
    }


def test_every_linear_becomes_invariant_over_the_same_weights(tiny_model_factory):
    """use_invariant_linears swaps every nn.Linear (projections, router, LM head) without copying a
    weight (a tied head keeps the embedding's), and off a GPU the layer is F.linear bitwise."""
    from transformers import AutoConfig

    from batchrun.model.decoder import DecoderLM
    from batchrun.model.invariant import InvariantLinear, use_invariant_linears

    config = AutoConfig.from_pretrained(tiny_model_factory("qwen3_moe"))
    config.tie_word_embeddings = True
    model = DecoderLM(config)
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    x = torch.randn(5, model.spec.hidden_size)
    want = model.lm_head(x)
    assert use_invariant_linears(model) == len(linears) > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    for name, before in linears.items():
        after = model.get_submodule(name)
        assert isinstance(after, InvariantLinear) and after.weight is before.weight, name
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head(x), want)
    assert all(block.batch_invariant for block in model.modules() if hasattr(block, "token_counts"))


def test_quantized_linears_with_batch_invariant_on_the_gpu_path_are_refused(tiny_llama_dir):
    from batchrun.engine import Engine, EngineConfig
    from batchrun.engine.startup import start_engine
    from batchrun.kernels.target import SM90

    pytest.importorskip("triton")
    config = EngineConfig(
        model=tiny_llama_dir, dtype="bfloat16", device="cpu", quantization="int8", batch_invariant=True
    )
    with pytest.raises(ValueError) as err:
        Engine(config, start_engine(config, simulate=SM90))
    message = str(err.value)
    assert "\n" not in message and "engine.batch_invariant" in message and "engine.quantization=int8" in message


def test_fixed_order_expert_sum_is_the_sum():
    """fused_experts' fixed-order sum over k: the same numbers as torch's sum (float32, two experts,
    where both orders are one add), so the option changes only the order where k > 2."""
    import torch.nn.functional as F

    from batchrun.kernels.moe import fused_experts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=g)
    gate_up, down = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    plain = fused_experts(x, gate_up, down, weights, ids, F.silu)
    fixed = fused_experts(x, gate_up, down, weights, ids, F.silu, fixed_order_sum=True)
    assert torch.equal(plain, fixed)


@pytest.mark.parametrize("family", INTERPRETED_FAMILIES)
def test_rows_identical_alone_batched_and_chunked_on_the_gpu_path_interpreted(family, interpreted):
    result = interpreted[family]
    assert result["calls"].get("_invariant_matmul_kernel", 0) > 0, result  # the linears did run it
    if family == "qwen3_moe":
        assert result["calls"].get("_grouped_gemm_kernel", 0) > 0, result
    assert result["same"] == {"alone": True, "batch": True, "chunked": True}, result


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, dict]:
    """family -> what the one interpreted child reported for it. One layer (Qwen3-MoE's is an MoE
    layer), two query heads and one KV head: the interpreter runs each program in Python."""
    from batchrun.testing import make_tiny_model
    from tests.support.interpreted import interpreted_rows

    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("one_layer_models")
    small = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    models = [str(make_tiny_model(root / f, f, **small)) for f in INTERPRETED_FAMILIES]
    return dict(zip(INTERPRETED_FAMILIES, interpreted_rows(__file__, *models, timeout=600)))


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rows_identical_alone_batched_and_chunked_on_gpu(family, tiny_model_factory):
    same = compare(tiny_model_factory(family), "cuda", num_prompts=32, max_chars=330, max_tokens=32, chunk_budget=64)
    assert same == {"alone": True, "batch": True, "chunked": True}, same


def _child(models: list[str]) -> None:
    from benchmarks.gpu_launches import SM90, count_launches

    torch.set_num_threads(1)
    for model in models:
        with count_launches() as launches:
            same = compare(model, "cpu", num_prompts=3, max_chars=44, max_tokens=4, chunk_budget=8, simulate=SM90)
        calls = {k.split(":", 1)[1]: v for k, v in launches.kernels.items() if k.startswith("triton:")}
        print(json.dumps({"same": same, "calls": calls}), flush=True)


if __name__ == "__main__":  # the interpreted child (TRITON_INTERPRET=1, see tests/support/interpreted.py)
    _child(sys.argv[1:])
