"""Mixture of experts: routing equals HF's, grouped dispatch equals a per-token loop, weights load
from both HF layouts, expert-load counts add up, and Qwen2-MoE (shared expert) matches HF greedy.

Greedy identity for Mixtral and Qwen3-MoE across all engine settings is in tests/engine/test_identity.py
(both are in batchrun.testing.FAMILIES).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchrun import Engine, EngineConfig, SamplingParams
from batchrun.kernels.moe import fused_experts, grouped_gemm_reference, sort_by_expert
from batchrun.model.moe import SparseMoeBlock, fused_moe_weights, route
from batchrun.testing import make_tiny_model, sample_texts
from benchmarks.cases import moe_per_token as _naive_moe  # the definition: a loop over tokens and experts

# Explicit small limits: a small KV pool is quick to allocate, and given limits skip the start-up profile.
ENGINE_KW = dict(dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=16)


def _random_moe(num_tokens, num_experts, top_k, hidden=32, inter=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = route(logits, top_k, renormalize=True, weights_fp32=True)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 4, 2), (50, 8, 3), (5, 16, 2)])
def test_grouped_dispatch_equals_per_token_reference(num_tokens, num_experts, top_k):
    x, gate_up, down, weights, ids = _random_moe(num_tokens, num_experts, top_k)
    got = fused_experts(x, gate_up, down, weights, ids, F.silu)
    torch.testing.assert_close(got, _naive_moe(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_sort_by_expert_segments():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    d = sort_by_expert(ids, num_experts=4)
    assert d.tokens_per_expert.tolist() == [2, 1, 3, 0]
    assert d.expert_offsets.tolist() == [0, 2, 3, 6, 6]
    flat = ids.reshape(-1)
    assert flat[d.sorted_pair_ids].tolist() == [0, 0, 1, 2, 2, 2]
    assert d.sorted_token_ids.tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order within a segment
    a = torch.randn(3, 8)
    b = torch.randn(4, 5, 8)
    out = grouped_gemm_reference(a, b, d.expert_offsets, d.sorted_token_ids)
    for i, (t, e) in enumerate(zip(d.sorted_token_ids.tolist(), flat[d.sorted_pair_ids].tolist())):
        torch.testing.assert_close(out[i], b[e] @ a[t])


def _hf_block(model_type: str, **kw):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock}
    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        **kw,
    )
    torch.manual_seed(0)
    block = cls[model_type](config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return config, block


@pytest.mark.parametrize(
    "model_type,kw",
    [
        ("mixtral", dict(num_local_experts=6, num_experts_per_tok=2)),
        ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True)),
        ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
        ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=40)),
    ],
)
def test_sparse_moe_block_matches_hf(model_type, kw):
    """Routing (exact top-k ids and weights) and the block output, against HF's own modules."""
    from batchrun.kernels.elementwise import activation
    from batchrun.model.decoder import DecoderSpec

    config, hf = _hf_block(model_type, **kw)
    spec = DecoderSpec.from_hf(config)
    ours = SparseMoeBlock(spec, activation(spec.activation))
    sd = {f"layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}  # in-memory (fused 3D) names
    loaded = fused_moe_weights(sd, "layers.0.", spec.num_experts, spec.shared_expert_intermediate_size > 0)
    assert not sd, f"left unloaded: {sorted(sd)}"
    ours.load_state_dict({k[len("layers.0.mlp.") :]: v for k, v in loaded.items()})
    x = torch.randn(2, 29, 32)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x.view(-1, 32))
        weights, ids = route(
            ours.gate(x.view(-1, 32)), spec.num_experts_per_tok, spec.moe_renormalize, spec.moe_weights_fp32
        )
        assert torch.equal(ids, hf_ids)
        assert weights.dtype == hf_weights.dtype
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        torch.testing.assert_close(ours(x.view(-1, 32)), hf(x).view(-1, 32), rtol=1e-5, atol=1e-5)
    assert ours.token_counts.sum().item() == x.shape[0] * x.shape[1] * spec.num_experts_per_tok


def test_loads_per_expert_and_fused_checkpoint_names(tiny_model_factory):
    """save_pretrained's per-expert names and transformers 5's in-memory fused names load the same."""
    from transformers import AutoModelForCausalLM

    from batchrun.model.decoder import DecoderLM
    from batchrun.model.loader import load_model

    for family in ("mixtral", "qwen3_moe"):
        loaded = load_model(tiny_model_factory(family))
        assert any(".experts.0." in k for k in loaded.state_dict), "save_pretrained wrote per-expert tensors"
        fused = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).state_dict()
        assert any(k.endswith("experts.gate_up_proj") for k in fused)
        a, b = DecoderLM(loaded.config), DecoderLM(loaded.config)
        a.load_hf_state_dict(dict(loaded.state_dict))
        b.load_hf_state_dict(dict(fused))
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), name


def _num_computed_tokens(outs) -> int:
    # Without prefix caching or preemption every prompt token and every generated token but the
    # last (sampled, never fed back) goes through the model once.
    return sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)


@pytest.mark.parametrize("family,num_moe_layers", [("mixtral", 3), ("qwen3_moe", 2)])
def test_expert_counts_add_up_to_tokens_times_top_k(family, num_moe_layers, tiny_model_factory):
    model_dir = tiny_model_factory(family)
    engine = Engine(EngineConfig(model=model_dir, enable_prefix_caching=False, max_num_batched_tokens=40, **ENGINE_KW))
    assert engine.stats().expert_token_counts == [[0] * 4] * num_moe_layers
    prompts = [t[:n] for t, n in zip(sample_texts(), (30, 200, 90))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7))
    counts = engine.stats().expert_token_counts
    top_k = 2
    assert len(counts) == num_moe_layers and all(len(row) == 4 for row in counts)
    assert [sum(row) for row in counts] == [_num_computed_tokens(outs) * top_k] * num_moe_layers
    assert all(c > 0 for row in counts for c in row), f"an expert got no tokens: {counts}"
    more = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3))
    after = engine.stats().expert_token_counts
    assert [sum(r) for r in after] == [
        (_num_computed_tokens(outs) + _num_computed_tokens(more)) * top_k
    ] * num_moe_layers


def test_dense_model_has_no_expert_counts(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, max_num_batched_tokens=64, **ENGINE_KW))
    assert engine.stats().expert_token_counts is None


def test_qwen2_moe_shared_expert_greedy_matches_hf(tmp_path):
    """Qwen2-MoE (shared expert with sigmoid gate, QKV bias, softmax-then-top-k without renorm)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(
        tmp_path / "qwen2_moe",
        "qwen2",
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        num_hidden_layers=2,
    )
    engine = Engine(EngineConfig(model=str(model_dir), max_num_batched_tokens=48, **ENGINE_KW))
    prompts = [t[:n] for t, n in zip(sample_texts()[3:], (25, 260, 110))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=engine.tokenizer.pad_token_id)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
    assert len(engine.stats().expert_token_counts) == 2
