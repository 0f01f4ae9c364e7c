"""LoRA adapters per row (batchrun/model/lora.py): rows of two adapters and the base model in one
flattened forward of the native DecoderLM give each row the logits and greedy tokens of HF's model
with that adapter merged (PEFT merge_and_unload, float32); adapters are refused with the adapter and
the module named; slots are reused least recently used first and pinned ones are kept."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional

import pytest
import torch
from torch import nn

from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.model.decoder import DecoderLM
from batchrun.model.lora import LoraAdapter, LoraError, LoraLinear, LoraSlots, attach_lora, read_adapter

peft = pytest.importorskip("peft")

BLOCK_SIZE = 8
BLOCKS_PER_ROW = 4  # prompt + generated tokens stay under 32


def _tiny_hf(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random HF causal LM in float32: 2 layers, hidden 64, vocabulary 256, GQA."""
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
    }[model_type]
    if model_type == "qwen3":
        fields["head_dim"] = 16
    if model_type == "phi3":
        fields["pad_token_id"] = 0
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**fields, **overrides}))
    return model.float().eval()


def _make_adapter(hf: nn.Module, directory: str, seed: int, **lora: Any) -> nn.Module:
    """Save a PEFT adapter of `hf` with B drawn non-zero (PEFT starts B at zero) to `directory`;
    the merged float32 model (a copy: `hf` is left as it is)."""
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, **lora})
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(directory)
    return model.merge_and_unload().eval()


def _decoder(hf: nn.Module) -> DecoderLM:
    model = DecoderLM(hf.config)
    model.load_hf_state_dict({k: v.clone() for k, v in hf.state_dict().items()})
    return model.float().eval()


class _Rows:
    """A paged KV cache for a few rows (own blocks each) and a flattened prefill / decode step."""

    def __init__(self, model: Any, num_rows: int) -> None:
        s = model.spec
        shape = (num_rows * BLOCKS_PER_ROW, BLOCK_SIZE, s.num_kv_heads, s.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(s.num_layers)]
        self.tables = torch.arange(num_rows * BLOCKS_PER_ROW).view(num_rows, BLOCKS_PER_ROW)
        self.model = model

    def step(
        self, new_tokens: list[list[int]], done: list[int], slots: Optional[LoraSlots], row_slots: list[int]
    ) -> torch.Tensor:
        """Logits (num_rows, vocab) at each row's last new token; `done`: tokens each row has cached."""
        ids, pos, slot_mapping, token_slots, starts = [], [], [], [], [0]
        for row, (tokens, start) in enumerate(zip(new_tokens, done)):
            for i, token in enumerate(tokens):
                p = start + i
                ids.append(token)
                pos.append(p)
                slot_mapping.append(int(self.tables[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
                token_slots.append(row_slots[row])
            starts.append(starts[-1] + len(tokens))
        seq_lens = [d + len(t) for d, t in zip(done, new_tokens)]
        decode = [r for r, t in enumerate(new_tokens) if len(t) == 1]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=self.tables,
            block_size=BLOCK_SIZE,
            decode_seq_ids=torch.tensor(decode, dtype=torch.long),
            decode_seq_lens=torch.tensor([seq_lens[r] for r in decode], dtype=torch.long),
            prefill_seq_ids=[r for r, t in enumerate(new_tokens) if len(t) > 1],
        )
        if slots is not None:
            slots.set_step(torch.tensor(token_slots, dtype=torch.int64))
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta)
        if slots is not None:
            slots.clear_step()
        return self.model.compute_logits(hidden[[e - 1 for e in starts[1:]]])


def _greedy(rows: _Rows, prompts, slots, row_slots, steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(prefill logits at each row's last prompt token, `steps` greedy tokens per row)."""
    logits = rows.step(prompts, [0] * len(prompts), slots, row_slots)
    first = logits
    out = [[int(t)] for t in logits.argmax(-1)]
    done = [len(p) for p in prompts]
    for _ in range(steps - 1):
        logits = rows.step([[o[-1]] for o in out], done, slots, row_slots)
        done = [d + 1 for d in done]
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(int(t))
    return first, out


def _hf_reference(hf: Any, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].float()
        generated = hf.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return logits, generated[0, len(prompt) :].tolist()


PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 7, 1, 200, 31], [100, 2, 3], [9, 18, 27, 36, 45, 54, 63], [11, 250]]


@pytest.mark.parametrize(
    "model_type,lora_a,lora_b",
    [
        (
            "llama",
            dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            # only some modules; rsLoRA; a rank and an alpha by pattern
            dict(
                r=2,
                lora_alpha=16,
                use_rslora=True,
                target_modules=["q_proj", "v_proj", "down_proj"],
                rank_pattern={"down_proj": 6},
                alpha_pattern={"v_proj": 4},
            ),
        ),
        ("qwen3", dict(target_modules="all-linear"), dict(target_modules=r".*\.(k_proj|o_proj|up_proj)")),
    ],
)
def test_rows_of_two_adapters_and_the_base_equal_the_merged_models(tmp_path, model_type, lora_a, lora_b):
    hf = _tiny_hf(model_type)
    merged = {
        "a": _make_adapter(hf, str(tmp_path / "a"), seed=1, **lora_a),
        "b": _make_adapter(hf, str(tmp_path / "b"), seed=2, **lora_b),
    }
    adapters = {name: read_adapter(name, str(tmp_path / name)) for name in merged}
    model = _decoder(hf)
    slots = attach_lora(model, adapters, max_loras=2)
    assert any(isinstance(m, LoraLinear) for m in model.modules())
    row_adapters = [None, "a", "b", "a", None]
    row_slots = [-1 if a is None else slots.load(a) for a in row_adapters]
    steps = 4
    logits, tokens = _greedy(_Rows(model, len(PROMPTS)), PROMPTS, slots, row_slots, steps)
    for row, (prompt, adapter) in enumerate(zip(PROMPTS, row_adapters)):
        want_logits, want_tokens = _hf_reference(hf if adapter is None else merged[adapter], prompt, steps)
        torch.testing.assert_close(logits[row], want_logits, atol=1e-4, rtol=1e-4, msg=f"row {row} ({adapter})")
        assert tokens[row] == want_tokens, (row, adapter)
        if adapter is not None:  # the adapter changes the model: the comparison above is not vacuous
            base_logits, _ = _hf_reference(hf, prompt, 1)
            assert (want_logits - base_logits).abs().max() > 1e-2


def test_a_step_without_adapter_tokens_is_the_base_model_bitwise(tmp_path):
    hf = _tiny_hf("llama")
    _make_adapter(hf, str(tmp_path / "a"), seed=1, target_modules=["q_proj", "down_proj"])
    plain, wrapped = _decoder(hf), _decoder(hf)
    slots = attach_lora(wrapped, {"a": read_adapter("a", str(tmp_path / "a"))}, max_loras=1)
    slots.load("a")
    want, _ = _greedy(_Rows(plain, 2), PROMPTS[:2], None, [-1, -1], 1)
    got, _ = _greedy(_Rows(wrapped, 2), PROMPTS[:2], slots, [-1, -1], 1)
    assert torch.equal(got, want)


def test_phi3_fused_projections_and_a_wrapped_hf_model_take_peft_names_directly(tmp_path):
    """A model run through HF's own modules (held under an attribute, as the generic path holds it):
    PEFT's module names, Phi-3's fused qkv_proj / gate_up_proj among them, are wrapped as they are."""
    hf = _tiny_hf("phi3")
    merged = _make_adapter(hf, str(tmp_path / "a"), seed=3, target_modules=["qkv_proj", "o_proj", "gate_up_proj"])

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.hf_model = inner

    holder = Holder(copy.deepcopy(hf))
    slots = attach_lora(holder, {"a": read_adapter("a", str(tmp_path / "a"))}, max_loras=1)
    assert isinstance(holder.hf_model.model.layers[0].self_attn.qkv_proj, LoraLinear)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        slots.set_step(torch.full((ids.shape[1],), slots.load("a"), dtype=torch.int64))
        got = holder.hf_model(ids).logits[0]
        slots.set_step(torch.full((ids.shape[1],), -1, dtype=torch.int64))
        base = holder.hf_model(ids).logits[0]
        torch.testing.assert_close(got, merged(ids).logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(base, hf(ids).logits[0], atol=1e-5, rtol=1e-5)


# ---- refusals -------------------------------------------------------------------------------------


def _write_adapter(directory, tensors: dict[str, torch.Tensor], **config: Any) -> str:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", **config}, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "adapter_model.safetensors"))
    return str(directory)


def _pair(path: str, r: int, in_features: int, out_features: int) -> dict[str, torch.Tensor]:
    return {
        f"base_model.model.{path}.lora_A.weight": torch.randn(r, in_features),
        f"base_model.model.{path}.lora_B.weight": torch.randn(out_features, r),
    }


def _attach_error(model: nn.Module, directory: str) -> str:
    with pytest.raises(LoraError) as info:
        attach_lora(model, {"mine": read_adapter("mine", directory)}, max_loras=1)
    return str(info.value)


def test_an_adapter_that_does_not_fit_the_model_is_named_with_the_first_mismatch(tmp_path):
    model = _decoder(_tiny_hf("llama"))  # hidden 64, q 64, kv 32, intermediate 96
    wrong_in = _write_adapter(tmp_path / "in", _pair("model.layers.0.self_attn.q_proj", 4, 32, 64))
    msg = _attach_error(model, wrong_in)
    assert msg.startswith("model.lora_adapters.mine: model.layers.0.self_attn.q_proj: ") and "64 in" in msg
    wrong_out = _write_adapter(tmp_path / "out", _pair("model.layers.1.self_attn.k_proj", 4, 64, 64))
    assert "32 out" in _attach_error(model, wrong_out)
    missing = _write_adapter(tmp_path / "missing", _pair("model.layers.2.self_attn.q_proj", 4, 64, 64))
    assert "model.layers.2.self_attn.q_proj: the model has no such module" in _attach_error(model, missing)
    norm = _write_adapter(tmp_path / "norm", _pair("model.layers.0.input_layernorm", 4, 64, 64))
    assert "RMSNorm is not a linear layer" in _attach_error(model, norm)
    head = _write_adapter(tmp_path / "head", _pair("lm_head", 4, 64, 256))
    assert "lm_head: LoRA on embeddings and the LM head" in _attach_error(model, head)
    experts = _write_adapter(tmp_path / "moe", _pair("model.layers.0.mlp.experts.0.gate_proj", 4, 64, 32))
    assert "mixture-of-experts" in _attach_error(model, experts)
    # nothing was wrapped by the refused attempts
    assert not any(isinstance(m, LoraLinear) for m in model.modules())


@pytest.mark.parametrize(
    "config,problem",
    [
        (dict(use_dora=True), "use_dora=true"),
        (dict(bias="all"), "bias='all'"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(alora_invocation_tokens=[5, 6]), "alora_invocation_tokens"),
        (dict(peft_type="LOHA"), "peft_type 'LOHA'"),
        (dict(r=2), "do not have the config's rank 2"),
        (dict(rank_pattern={"q_proj": 8}), "rank 8"),
    ],
)
def test_adapter_configs_this_runtime_cannot_apply_are_refused(tmp_path, config, problem):
    directory = _write_adapter(tmp_path / "x", _pair("model.layers.0.self_attn.q_proj", 4, 64, 64), **config)
    with pytest.raises(LoraError, match=r"^model\.lora_adapters\.x: ") as info:
        read_adapter("x", directory)
    assert problem in str(info.value)


def test_missing_files_pickle_weights_and_dora_from_peft_are_refused(tmp_path):
    with pytest.raises(LoraError, match="is not a directory"):
        read_adapter("gone", str(tmp_path / "nowhere"))
    hf = _tiny_hf("llama")
    peft_model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    with pytest.raises(LoraError, match=r"^model\.lora_adapters\.p: adapter_model\.bin \(pickle\)"):
        read_adapter("p", str(tmp_path / "bin"))
    dora = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(LoraError, match="use_dora"):
        read_adapter("d", str(tmp_path / "dora"))
    os.remove(tmp_path / "dora" / "adapter_config.json")
    with pytest.raises(LoraError, match="has no adapter_config.json"):
        read_adapter("d", str(tmp_path / "dora"))


def test_scale_and_fingerprint(tmp_path):
    tensors = _pair("model.layers.0.self_attn.q_proj", 4, 64, 64)
    plain = read_adapter("p", _write_adapter(tmp_path / "p", tensors, lora_alpha=8))
    rs = read_adapter("r", _write_adapter(tmp_path / "r", tensors, lora_alpha=8, use_rslora=True))
    (weights,) = plain.modules.values()
    assert weights.scale == 2.0 and next(iter(rs.modules.values())).scale == 4.0
    assert len(plain.fingerprint) == 64 and plain.fingerprint != rs.fingerprint  # configs differ
    again = read_adapter("p2", _write_adapter(tmp_path / "p2", tensors, lora_alpha=8))
    assert again.fingerprint == plain.fingerprint


def test_an_adapter_directory_under_home_is_found_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write_adapter(tmp_path / "ft" / "sql", _pair("model.layers.0.self_attn.q_proj", 4, 64, 64), lora_alpha=8)
    assert read_adapter("sql", "~/ft/sql").directory == str(tmp_path / "ft" / "sql")


# ---- slots ----------------------------------------------------------------------------------------


def _slots(tmp_path, names: list[str], max_loras: int) -> tuple[DecoderLM, LoraSlots, dict[str, LoraAdapter]]:
    model = _decoder(_tiny_hf("llama"))
    adapters = {
        n: read_adapter(n, _write_adapter(tmp_path / n, _pair("model.layers.0.self_attn.o_proj", 4, 64, 64)))
        for n in names
    }
    return model, attach_lora(model, adapters, max_loras), adapters


def test_slots_evict_the_least_recently_used_unpinned_adapter(tmp_path):
    model, slots, adapters = _slots(tmp_path, ["a", "b", "c"], max_loras=2)
    assert slots.load("a") == 0 and slots.load("b") == 1
    slots.load("a")  # a is now the most recently used
    assert slots.can_admit("c") and slots.load("c") == 1 and slots.slot_of("b") is None
    assert slots.resident() == ["a", "c"]
    layer = model.layers[0].self_attn.o_proj
    assert isinstance(layer, LoraLinear)
    weights = adapters["c"].modules["model.layers.0.self_attn.o_proj"]
    torch.testing.assert_close(layer.lora_b[1, :, :4], weights.lora_b * weights.scale)
    torch.testing.assert_close(layer.lora_a[1, :4], weights.lora_a)
    slots.set_step(torch.tensor([-1, 0, 0]))  # a step's use counts as use: c becomes least recent
    slots.clear_step()
    assert slots.load("b") == 1 and slots.slot_of("c") is None


def test_pinned_adapters_stay_and_a_full_set_of_pins_admits_nothing_new(tmp_path):
    _, slots, _ = _slots(tmp_path, ["a", "b", "c"], max_loras=2)
    slots.pin("a")
    slots.pin("b")
    assert not slots.can_admit("c") and slots.can_admit("a")
    with pytest.raises(RuntimeError, match="pinned"):
        slots.load("c")
    slots.pin("a")
    slots.unpin("a")
    assert not slots.can_admit("c")  # a is still pinned once
    slots.unpin("a")
    assert slots.can_admit("c") and slots.load("c") == 0 and slots.is_pinned("b")
    with pytest.raises(KeyError, match="unknown adapter 'zz'"):
        slots.load("zz")


# ---- packed and quantized bases -------------------------------------------------------------------


def _row_split(model: DecoderLM) -> None:
    """Each MLP's fused native gate/up as start-up tuning may lay it out: the tiles below 4 rows,
    torch's kernel over the tiles unpacked per call from there (model/linear.py: RowSplitLinear)."""
    from batchrun.model.linear import NativeSiluMulLinear, RowSplitLinear, UnpackedTilesLinear

    for layer in model.layers:
        mlp: Any = layer.mlp
        fused = mlp.gate_up_proj
        if isinstance(fused, NativeSiluMulLinear):
            buffer = torch.empty(fused.packed_weight.numel(), dtype=torch.bfloat16)
            mlp.gate_up_proj = RowSplitLinear(fused, UnpackedTilesLinear(fused, buffer), 4)


@pytest.mark.parametrize("mode", ["none", "row_split", "w4a8"])
def test_packed_and_quantized_bases_take_the_update_beside_their_own_kernels(tmp_path, mode):
    """bf16 on the CPU: packed float linears (a gate/up that applies silu itself among them) or W4A8
    ones. A layer whose activation is fused into its gate/up projection is unfused, bitwise the same
    for base rows and for an adapter whose B is zero; an adapter's row is near the float32 merged model."""
    from batchrun.kernels.binding import default_kernels
    from batchrun.model.prepare import prepare_linears

    hf = _tiny_hf("llama", intermediate_size=128)
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    merged = _make_adapter(hf, str(tmp_path / "a"), seed=1, target_modules=targets)
    adapter = read_adapter("a", str(tmp_path / "a"))
    zero = read_adapter("z", str(tmp_path / "a"))
    for weights in zero.modules.values():
        weights.lora_b.zero_()
    kernels = default_kernels("cpu", torch.bfloat16)

    def prepared() -> DecoderLM:
        model = _decoder(hf).to(torch.bfloat16)
        prepare_linears(model, "w4a8" if mode == "w4a8" else "none", "cpu", torch.bfloat16, kernels=kernels)
        model.use_kernels(kernels)
        if mode == "row_split":
            _row_split(model)
        return model

    def rows(model: DecoderLM) -> _Rows:
        r = _Rows(model, 3)
        r.kv = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in r.kv]
        return r

    plain, wrapped = prepared(), prepared()
    slots = attach_lora(wrapped, {"a": adapter, "z": zero}, max_loras=2)
    assert not any(layer.mlp.fused_act for layer in wrapped.layers)
    prompts = PROMPTS[:3]
    want, want_tokens = _greedy(rows(plain), prompts, None, [-1] * 3, 2)
    got, got_tokens = _greedy(rows(wrapped), prompts, slots, [-1, slots.load("z"), slots.load("a")], 2)
    assert torch.equal(got[:2], want[:2]) and got_tokens[:2] == want_tokens[:2]
    with torch.no_grad():
        ref = merged(torch.tensor([prompts[2]])).logits[0, -1]
        base = hf(torch.tensor([prompts[2]])).logits[0, -1]
    assert (got[2] - ref).abs().max() < 0.15 * (base - ref).abs().max()


# ---- Phi-3 native and the generic path ------------------------------------------------------------


def _phi3_native_or_generic_neox(kind: str) -> tuple[nn.Module, nn.Module, list[str]]:
    """(HF model, batchrun model over its weights, PEFT targets), or a skip where this build lacks
    the serving path."""
    import transformers

    if kind == "phi3":
        hf = _tiny_hf("phi3")
        try:
            model: nn.Module = _decoder(hf)
        except ValueError:
            pytest.skip("Phi-3 is not native in this build")
        return hf, model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    generic = pytest.importorskip("batchrun.model.generic")
    config = transformers.GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model = generic.build_generic(hf.config, {k: v.clone() for k, v in hf.state_dict().items()}, torch.float32, "cpu")
    return hf, model, ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


@pytest.mark.parametrize("kind", ["phi3", "gpt_neox"])
def test_fused_checkpoint_projections_and_the_generic_path_equal_the_merged_models(tmp_path, kind):
    """Phi-3's own fused qkv_proj / gate_up_proj (native), and GPT-NeoX through the generic path
    (HF's modules by PEFT's names, its fused query_key_value among them)."""
    hf, model, targets = _phi3_native_or_generic_neox(kind)
    merged = {
        "a": _make_adapter(hf, str(tmp_path / "a"), seed=1, target_modules=targets),
        "b": _make_adapter(hf, str(tmp_path / "b"), seed=2, target_modules=targets[:1], use_rslora=True),
    }
    slots = attach_lora(model, {n: read_adapter(n, str(tmp_path / n)) for n in merged}, max_loras=2)
    row_adapters = [None, "a", "b"]
    row_slots = [-1 if a is None else slots.load(a) for a in row_adapters]
    logits, tokens = _greedy(_Rows(model, 3), PROMPTS[:3], slots, row_slots, 3)
    for row, adapter in enumerate(row_adapters):
        want_logits, want_tokens = _hf_reference(hf if adapter is None else merged[adapter], PROMPTS[row], 3)
        torch.testing.assert_close(logits[row], want_logits, atol=1e-4, rtol=1e-4, msg=f"row {row} ({adapter})")
        assert tokens[row] == want_tokens, (row, adapter)


def test_a_step_groups_tokens_by_slot_once_and_each_row_gets_its_own_update(tmp_path):
    model, slots, adapters = _slots(tmp_path, ["a", "b", "c"], max_loras=3)
    layer = model.layers[0].self_attn.o_proj
    assert isinstance(layer, LoraLinear) and isinstance(layer.base, nn.Linear)
    assert (slots.load("a"), slots.load("b"), slots.load("c")) == (0, 1, 2)
    x = torch.randn(5, 64)
    base = layer.base(x)

    def update(name: str, row: torch.Tensor) -> torch.Tensor:
        w = adapters[name].modules["model.layers.0.self_attn.o_proj"]
        return (row @ w.lora_a.T) @ (w.lora_b * w.scale).T

    # runs batched (equal; padded); runs one by one (padding would be large); one slot among base
    # tokens; the whole step one slot; no adapter
    cases = ([1, -1, 0, 1, 0], [2, 0, 2, 1, 0], [0, 0, 1, 0, 0], [-1, 0, -1, 0, -1], [1, 1, 1, 1, 1], [-1] * 5)
    for token_slots in cases:
        slots.set_step(torch.tensor(token_slots))
        got = layer(x)
        want = base.clone()
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                want[row] += update("abc"[slot], x[row])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(token_slots))
    step = layer.step
    slots.set_step(torch.tensor([1, -1, 0, 1, 0]))
    assert step.segments == [(0, 0, 2), (1, 2, 4)] and step.rows is None  # made on first use
    step.ensure_rows()
    assert step.rows is not None and step.rows.tolist() == [2, 4, 0, 3]
    assert step.padded is not None and step.padded.valid is None and step.padded.slot_ids is not None
    assert step.padded.slot_ids.tolist() == [0, 1]  # two of the three slots
    slots.set_step(torch.tensor([1, 1, -1, 1]))
    step.ensure_rows()
    assert step.padded is None  # one slot: its run alone
    slots.set_step(torch.tensor([0, 0, 1, 0, 0]))
    step.ensure_rows()
    assert step.padded is None  # padding the runs to 4 rows each would compute 8 rows for 5
    slots.set_step(torch.tensor([0, 1, 0, 1, 0]))
    step.ensure_rows()
    assert step.padded is not None and step.padded.valid is not None and step.padded.valid.tolist() == [0, 1, 2, 3, 4]
    assert step.padded.rows.tolist() == [0, 2, 4, 1, 3, 1]
    slots.set_step(torch.tensor([1, 1]))
    assert step.segments == [(1, 0, 2)] and step.rows is None  # the whole step one slot: no gather
    slots.clear_step()
    assert step.segments == [] and torch.equal(layer(x), base)


def test_long_ranges_of_one_slot_are_updated_in_place_and_a_bf16_layer_computes_in_bf16(tmp_path):
    model, slots, adapters = _slots(tmp_path, ["a", "b", "c"], max_loras=2)
    layer = model.layers[0].self_attn.o_proj
    assert isinstance(layer, LoraLinear)
    assert (slots.load("a"), slots.load("b")) == (0, 1)
    step = layer.step

    def update(name: str, row: torch.Tensor) -> torch.Tensor:
        w = adapters[name].modules["model.layers.0.self_attn.o_proj"]
        return (row @ w.lora_a.T) @ (w.lora_b * w.scale).T

    # a prefill chunk: two rows of 10 tokens on a and b, 4 base tokens between them, 9 more on a
    token_slots = [0] * 10 + [-1] * 4 + [1] * 10 + [0] * 9
    slots.set_step(torch.tensor(token_slots))
    assert step.spans == [(0, 0, 10), (1, 14, 24), (0, 24, 33)] and step.rows is None
    x = torch.randn(len(token_slots), 64)
    want = layer.base(x)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            want[row] += update("ab"[slot], x[row])
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    slots.set_step(torch.tensor([0, 1] * 8))  # ranges of one token: grouped by slot instead
    assert step.spans is None

    # a bf16 layer: the update of a step of at most _MAX_ADDMM_SPANS ranges in bf16, from a copy of
    # the slots' weights, renewed on a slot load (more ranges go to the native kernel where it serves)
    layer.base.to(torch.bfloat16)
    token_slots = token_slots[:24]
    want = want[:24]
    x = x[:24]
    slots.set_step(torch.tensor(token_slots))
    assert step.spans == [(0, 0, 10), (1, 14, 24)]
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16 and set(layer._cast) == {torch.bfloat16}
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()  # bf16 rounding only
    slots.load("c")
    assert not layer._cast
