"""The generic serving path (model/generic.py) and native Phi-3: greedy float32 tokens through the
engine equal HF transformers' greedy `generate` on tiny random models of architectures outside the
native families, each picked for a structural difference (fused projections, partial rotary,
norms after attention, parallel residual, multipliers and logit scaling, soft-capping and sliding
windows, layers without RoPE, learned positions); and the one-line refusals of what it cannot run."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.config import EngineConfigError, SpeculativeConfig
from batchrun.engine.startup import start_engine
from batchrun.model.generic import GenericLM
from tests.support.engines import make_tiny_engine, tiny_config
from tests.support.generic_models import save_tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX_TOKENS = 10
SHARED = [11, 42, 7, 300, 19, 88, 5, 230, 61, 17, 402, 33, 9, 150, 77, 4, 250, 90, 13, 66]  # 20 tokens


def prompts() -> list[list[int]]:
    """Prompts of different lengths, three of them opening with one 20-token prefix (more than a
    16-token KV block, so a later request can take it from the prefix cache)."""
    return [SHARED + [101, 102, 103, 104, 105, 106], [7, 8, 9], SHARED + [200] * 13, [480, 3, 57, 222, 91], SHARED]


@pytest.fixture(scope="module")
def tokenizer():
    from batchrun.testing import build_tokenizer

    return build_tokenizer()


def hf_greedy(directory: str, token_lists: list[list[int]]) -> list[list[int]]:
    """HF generate's greedy tokens per prompt, MAX_TOKENS each (no end-of-sequence stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for ids in token_lists:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(generated[0, len(ids) :].tolist())
    return out


# Llama 4 text with every layer attending in full (no chunked attention), a NoPE layer whose attention
# temperature is tuned from small positions (floor_scale 2), no MoE layer.
LLAMA4_TEXT = dict(
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size_mlp=128,
    num_local_experts=2,
    num_experts_per_tok=1,
    attention_chunk_size=None,
    no_rope_layers=[1, 0],
    attn_temperature_tuning=True,
    floor_scale=2,
    attn_scale=2.0,
    interleave_moe_layer_step=1,
    moe_layers=[],
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (id, model_type, config, serving path): the structures the oracle covers.
ARCHITECTURES = [
    ("phi3-native", "phi3", dict(num_key_value_heads=2, sliding_window=12), "native"),  # fused qkv/gate_up
    ("phi3-partial-rotary", "phi3", dict(num_key_value_heads=2, partial_rotary_factor=0.5), "generic"),
    (
        "phi3-longrope",  # Phi-3 128k's rope; every prompt here under original_max_position_embeddings
        "phi3",
        dict(
            num_key_value_heads=2,
            original_max_position_embeddings=64,
            rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8, long_factor=[2.0] * 8),
        ),
        "generic",
    ),
    ("olmo2", "olmo2", dict(num_key_value_heads=2), "generic"),  # norms after attention/MLP, q/k norms
    ("gpt_neox", "gpt_neox", dict(partial_rotary_factor=0.25, use_parallel_residual=True), "generic"),
    (
        "granite",  # embedding/residual/attention multipliers, logits scaled after the head
        "granite",
        dict(
            num_key_value_heads=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
        ),
        "generic",
    ),
    (
        "gemma2",  # attention and final soft-capping, sliding layers shorter than the prompts
        "gemma2",
        dict(
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "generic",
    ),
    ("smollm3", "smollm3", dict(num_key_value_heads=2, no_rope_layers=[1, 0]), "generic"),  # a NoPE layer
    ("cohere", "cohere", dict(num_key_value_heads=2, logit_scale=0.5), "generic"),  # parallel block, logit scale
    ("gpt2", "gpt2", dict(n_inner=128), "generic"),  # learned positions, Conv1D projections
    ("opt", "opt", dict(ffn_dim=128, word_embed_proj_dim=32), "generic"),  # base model's decoder, projections out
]


@pytest.mark.parametrize("model_type,config,path", [a[1:] for a in ARCHITECTURES], ids=[a[0] for a in ARCHITECTURES])
def test_greedy_tokens_equal_hf_generate(tmp_path, tokenizer, one_torch_thread, caplog, model_type, config, path):
    directory = save_tiny(tmp_path / "model", tokenizer, model_type, **config)
    expected = hf_greedy(directory, prompts())
    with caplog.at_level(logging.INFO, logger="batchrun.engine.startup"):
        engine = make_tiny_engine(directory, enable_prefix_caching=True)
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert f"{path} path" in ready[0] and ("off: fused projections" in ready[0]) == (path == "generic")
    assert "CUDA graphs" not in ready[0]  # graphs are a GPU runner's: nothing to turn off on the CPU
    assert engine.settings.model_path == path
    assert isinstance(engine.model, GenericLM) == (path == "generic")
    assert ("model_path" in engine.settings.as_dict()) == (path == "generic")
    batched = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in batched] == expected
    # Again, one at a time: the shared prefix's blocks now come from the prefix cache.
    alone = [engine.generate([p], GREEDY)[0] for p in prompts()]
    assert [o.token_ids for o in alone] == expected
    assert alone[2].metrics.num_cached_tokens >= 16


@pytest.mark.parametrize(
    "arch,setting",
    [
        ("gemma2", dict(max_num_batched_tokens=8, max_num_seqs=2)),  # chunked prefill across sliding windows
        ("gpt_neox", dict(max_num_batched_tokens=8, max_num_seqs=2)),
        ("gpt_neox", dict(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False))),
    ],
    ids=["gemma2-chunked", "gpt_neox-chunked", "gpt_neox-ngram"],
)
def test_engine_settings_leave_the_tokens_unchanged(tmp_path, tokenizer, one_torch_thread, arch, setting):
    model_type, config = next((a[1], a[2]) for a in ARCHITECTURES if a[0] == arch)
    directory = save_tiny(tmp_path / "model", tokenizer, model_type, **config)
    expected = hf_greedy(directory, prompts())
    engine = make_tiny_engine(directory, **setting)
    outputs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == expected
    if "speculative" in setting:  # the verification forwards ran
        assert sum(o.metrics.num_spec_proposed for o in outputs) > 0


def test_the_gpu_runner_runs_the_generic_path_without_cuda_graphs(tmp_path, tokenizer, one_torch_thread):
    from batchrun.engine.runners.gpu import GpuRunner

    directory = save_tiny(tmp_path / "model", tokenizer, "olmo2", num_key_value_heads=2)
    expected = hf_greedy(directory, prompts())
    engine = make_tiny_engine(directory)
    engine.runner = GpuRunner.stand_in(engine.runner, 4)  # the GPU runner's code over the CPU tensors
    assert engine.runner.graphs is None
    assert [o.token_ids for o in engine.generate(prompts(), GREEDY)] == expected


def test_prompt_logprobs_are_the_causal_lms_own(tmp_path, tokenizer, one_torch_thread):
    """Granite divides its logits by logits_scaling after the head: the prompt logprobs (the head
    over every prompt row) are those of HF's CausalLM forward."""
    from transformers import AutoModelForCausalLM

    model_type, config = next((a[1], a[2]) for a in ARCHITECTURES if a[0] == "granite")
    directory = save_tiny(tmp_path / "model", tokenizer, model_type, **config)
    prompt = prompts()[0]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # (len, vocab)
    engine = make_tiny_engine(directory)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(prompt) - 1
    got = [entry[token] for entry, token in zip(out.prompt_logprobs, prompt[1:])]
    ref = [want[i, token].item() for i, token in enumerate(prompt[1:])]
    assert got == pytest.approx(ref, abs=1e-4)


def test_an_int8_kv_cache_serves_the_generic_path(tmp_path, tokenizer, one_torch_thread):
    """The layers' K/V go through the kernel set's cache write and attention, which quantize an
    int8 cache as they do for the native decoder: most greedy tokens stay HF's (bound: 80%)."""
    directory = save_tiny(tmp_path / "model", tokenizer, "olmo2", num_key_value_heads=2)
    expected = hf_greedy(directory, prompts())
    engine = make_tiny_engine(directory, kv_cache_dtype="int8")
    got = [o.token_ids for o in engine.generate(prompts(), GREEDY)]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.8 * sum(map(len, expected)), (got, expected)


def test_bf16_cpu_linears_are_packed_on_the_generic_path(tmp_path, tokenizer, one_torch_thread):
    from batchrun.engine.startup import bind

    if bind(tiny_config(".", dtype="bfloat16")).linear_float.packing == "none":
        pytest.skip("this CPU's bf16 kernel set packs no linears")
    directory = save_tiny(tmp_path / "model", tokenizer, "olmo2", num_key_value_heads=2)
    engine = make_tiny_engine(directory, dtype="bfloat16")
    # 2 layers x (q, k, v, o, gate, up, down) + the untied head
    assert engine.settings.packed_linears == 15
    outputs = engine.generate(prompts(), GREEDY)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)


def write_config(directory: Path, model_type: str, **config: Any) -> str:
    """A model directory holding only config.json: every refusal is decided before weights load."""
    from transformers import AutoConfig

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    directory.mkdir(parents=True)
    hf_config = AutoConfig.for_model(model_type, **{**fields, **config})
    hf_config.save_pretrained(directory)
    return str(directory)


def refusal(directory: str, **config: Any) -> str:
    with pytest.raises(EngineConfigError) as info:
        start_engine(tiny_config(directory, **config))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_custom_code_is_refused_naming_auto_map(tmp_path):
    directory = write_config(tmp_path / "m", "olmo2")
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    path.write_text(json.dumps(config))
    assert "auto_map" in refusal(directory)


def test_a_class_without_the_attention_interface_is_refused(tmp_path):
    message = refusal(write_config(tmp_path / "m", "stablelm"))  # StableLmForCausalLM: no attention backend
    assert "_supports_attention_backend" in message and "StableLm" in message


def test_layers_that_are_not_attention_are_refused(tmp_path):
    message = refusal(write_config(tmp_path / "m", "olmo2", layer_types=["full_attention", "linear_attention"]))
    assert "layer_types" in message and "linear_attention" in message


def test_bidirectional_attention_is_refused_on_the_generic_path(tmp_path):
    message = refusal(write_config(tmp_path / "m", "olmo2", is_causal=False))
    assert "is_causal" in message and "bidirectional" in message


@pytest.mark.parametrize(
    "setting,key",
    [
        (dict(tensor_parallel_size=2), "engine.tensor_parallel_size=2"),
        (dict(quantization="int8"), "engine.quantization=int8"),
        (dict(batch_invariant=True), "engine.batch_invariant=true"),
    ],
)
def test_settings_the_generic_path_lacks_are_refused_naming_the_key(tmp_path, setting, key):
    message = refusal(write_config(tmp_path / "m", "olmo2"), **setting)
    assert message.startswith(key) and "generic path" in message


def test_phi3_native_refuses_tensor_parallelism_naming_the_key(tmp_path):
    message = refusal(write_config(tmp_path / "m", "phi3"), tensor_parallel_size=2)
    assert message.startswith("engine.tensor_parallel_size=2") and "phi3" in message


def test_self_speculation_is_refused_on_the_generic_path(tmp_path):
    message = refusal(
        write_config(tmp_path / "m", "olmo2"), speculative=SpeculativeConfig(method="self", num_speculative_tokens=2)
    )
    assert message.startswith("engine.speculative.method=self")


def test_what_the_generic_path_turns_off_is_said_per_target():
    from batchrun.engine.tasks import generic_turned_off

    assert any("CUDA graphs" in line for line in generic_turned_off(on_gpu=True))
    assert not any("CUDA graphs" in line for line in generic_turned_off(on_gpu=False))


def test_attention_sinks_are_refused_from_the_config_before_loading(tmp_path):
    directory = write_config(tmp_path / "m", "gpt_oss", num_key_value_heads=2, head_dim=16, num_local_experts=4)
    message = refusal(directory)  # config.json only: no weights to load
    assert message.startswith(f"engine.model={directory}") and "gpt_oss" in message and "sinks" in message


def test_a_refusal_found_while_building_is_one_engine_config_error_line(tmp_path, tokenizer, monkeypatch):
    """What build_generic finds only once the class is built (here: the sink check switched off at
    the config) is an EngineConfigError naming engine.model, as the config-time refusals are."""
    from batchrun.engine import tasks

    directory = save_tiny(
        tmp_path / "m",
        tokenizer,
        "gpt_oss",
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    monkeypatch.setattr(tasks, "SINK_MODEL_TYPES", ())
    message = refusal(directory)
    assert message.startswith(f"engine.model={directory}") and "s_aux" in message


def test_the_base_model_is_found_where_base_model_prefix_names_no_attribute(tmp_path, tokenizer):
    """Llama4ForCausalLM's base_model_prefix is "language_model", but its base model is `.model`."""
    from batchrun.model.generic import base_model

    directory = save_tiny(tmp_path / "m", tokenizer, "llama4_text", **LLAMA4_TEXT)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert not hasattr(hf, hf.base_model_prefix)
    assert base_model(hf) is hf.model


def test_a_head_that_cannot_run_on_given_hidden_states_is_refused_at_start_up(tmp_path, tokenizer, monkeypatch):
    """The head runs once at start-up: a CausalLM whose forward reaches past its base model's
    output is one EngineConfigError line then, not a failure in the first step."""
    from transformers import OlmoForCausalLM

    directory = save_tiny(tmp_path / "m", tokenizer, "olmo", num_key_value_heads=2)
    forward = OlmoForCausalLM.forward

    def reaching(self, *args, **kwargs):
        _ = self.model.embed_tokens.weight  # the stand-in base model has no embed_tokens
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(OlmoForCausalLM, "forward", reaching)
    message = refusal(directory)
    assert message.startswith(f"engine.model={directory}") and "olmo" in message and "head" in message


def test_attention_that_computes_its_own_positions_is_refused_at_start_up(tmp_path, tokenizer):
    """Llama 4 text's NoPE layers tune their attention temperature from arange(num_tokens) + the
    cache length, not position_ids: the self-check at the end of build_generic (two sequences in
    one step against each alone, and a decode at an offset) refuses it in one line."""
    from batchrun.model.generic import GenericModelError, build_generic
    from batchrun.model.loader import load_model

    directory = save_tiny(tmp_path / "m", tokenizer, "llama4_text", **LLAMA4_TEXT)
    loaded = load_model(directory, dtype=torch.float32)
    with pytest.raises(GenericModelError) as info:
        build_generic(loaded.config, loaded.state_dict, torch.float32, torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and "llama4_text" in message and "computes positions" in message


def test_attention_temperature_tuning_is_refused_from_the_config(tmp_path):
    """Llama 4's own floor_scale (8192) hides the temperature from a few-token self-check: the
    config key is refused before loading."""
    message = refusal(write_config(tmp_path / "m", "llama4_text", **{**LLAMA4_TEXT, "floor_scale": 8192}))
    assert "attn_temperature_tuning" in message and "llama4_text" in message
