"""LoRA adapters per request through the engine: an adapter's greedy float32 tokens equal HF greedy
on the model with that adapter merged (PEFT merge_and_unload), whatever else shares the batch.

One tiny random Llama, two PEFT adapters (different targets, ranks, alpha and rsLoRA; A and B drawn
wide so every adapter changes the output). The scheduler's slot handling is also checked alone,
with a fake model and fake slots (no tensors)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from batchrun import Engine, EngineConfig, SamplingParams
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.outputs import EngineRequest
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from batchrun.testing import sample_texts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Pinned limits: no start-up profile; 2 MiB of float32 KV is 64 blocks of 16 tokens for this model.
SMALL = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory=2**21)
# 12 blocks of 16 tokens of the tiny Llama (3 layers, 2 KV heads of 16, float32): the batch does not fit
TIGHT_KV_BYTES = 12 * 2 * 3 * 16 * 2 * 16 * 4
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=4, target_modules="all-linear", use_rslora=True),
}


def _prompts() -> list[str]:
    texts = sample_texts()
    return [texts[i][:n] for i, n in enumerate([40, 150, 70, 260, 20, 110])]


def _shared_prefix_prompts() -> list[str]:
    """Prompts that share more than 4 full blocks, so a second run could hit the prefix cache."""
    stem = sample_texts()[7][:300]
    return [stem + " first ending", stem + " and another one"]


@pytest.fixture(scope="module")
def lora_family(tiny_model_factory, tmp_path_factory):
    """family -> (base model dir, {name: adapter dir}, reference(adapter, prompts) -> HF greedy tokens)."""
    built: dict[str, tuple[str, dict[str, str], Any]] = {}

    def get(family: str) -> tuple[str, dict[str, str], Any]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"lora_{family}")
            if family == "olmo2":  # no native family: the generic path (model/generic.py)
                from batchrun.testing import build_tokenizer
                from tests.support.generic_models import save_tiny

                base = save_tiny(root / "base", build_tokenizer(), family, num_key_value_heads=2)
            else:
                base = tiny_model_factory(family)
            built[family] = _lora_setup(base, root)
        return built[family]

    return get


@pytest.fixture(scope="module")
def lora_setup(lora_family):
    return lora_family("llama")


def _lora_setup(base: str, root: Path) -> tuple[str, dict[str, str], Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = {}
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**kw))
        with torch.no_grad():  # PEFT starts B at zero (no change); draw both wide
            for n, p in peft_model.named_parameters():
                if "lora_A" in n or "lora_B" in n:
                    p.normal_(0.0, 0.3)
        dirs[name] = str(root / name)
        peft_model.save_pretrained(dirs[name])

    models: dict[Optional[str], Any] = {}  # HF causal LMs
    cache: dict[tuple[Optional[str], str], list[int]] = {}

    def reference(adapter: Optional[str], prompts: list[str]) -> list[list[int]]:
        from peft import PeftModel
        from transformers import AutoTokenizer

        if adapter not in models:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, dirs[adapter]).merge_and_unload()
            models[adapter] = model.eval()
        tok = AutoTokenizer.from_pretrained(base)
        for p in prompts:
            if (adapter, p) not in cache:
                ids = tok(p, return_tensors="pt").input_ids
                out = models[adapter].generate(
                    ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id
                )
                cache[adapter, p] = out[0, ids.shape[1] :].tolist()
        return [cache[adapter, p] for p in prompts]

    return base, dirs, reference


def _engine(lora_setup, **kw) -> Engine:
    base, dirs, _ = lora_setup
    return Engine(EngineConfig(model=base, lora_adapters=dirs, **{**SMALL, **kw}))


def _expected(lora_setup, prompts: list[str], names: list[Optional[str]]) -> list[list[int]]:
    reference = lora_setup[2]
    return [reference(name, [p])[0] for p, name in zip(prompts, names)]


@pytest.mark.parametrize("family, max_loras", [("llama", 2), ("llama", 1), ("qwen3", 2), ("olmo2", 2)])
def test_rows_of_two_adapters_and_the_base_match_their_merged_models(lora_family, family, max_loras):
    """max_loras=1: the two adapters take turns in the one slot, loaded on demand, with prompts
    prefilled in chunks beside other rows' decodes and a KV cache too small for the batch
    (preemption). Qwen3: q/k norms after the fused q/k/v projection, head_dim not hidden / heads.
    OLMo 2: served by its transformers class (the generic path), adapters wrapping HF's modules."""
    lora_setup = lora_family(family)
    prompts = _prompts()
    names: list[Optional[str]] = ["a", "b", None, "a", "b", "a"]
    tight = dict(max_num_batched_tokens=37, kv_cache_memory=TIGHT_KV_BYTES) if max_loras == 1 else {}
    engine = _engine(lora_setup, max_loras=max_loras, **tight)
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in outs] == _expected(lora_setup, prompts, names)
    assert all(o.finish_reason == "length" for o in outs)
    base_tokens = lora_setup[2](None, prompts)
    assert all(o.token_ids != t for o, t, n in zip(outs, base_tokens, names) if n), "an adapter changes the output"
    lora = engine.settings.as_dict()["lora"]
    assert lora["max_loras"] == max_loras and lora["max_rank"] == 8 and lora["slots"] == min(max_loras, 2)
    assert lora["adapters"] == engine.adapter_fingerprints and sorted(lora["adapters"]) == ["a", "b"]
    assert all(len(fp) == 64 for fp in engine.adapter_fingerprints.values())
    assert engine.runner.graphs is None
    assert not engine.scheduler.has_unfinished()
    assert engine.runner.lora is not None and not any(engine.runner.lora.is_pinned(n) for n in ("a", "b"))
    assert engine.stats().num_preemptions > 0 or not tight


def test_gpu_runner_runs_adapter_steps_eagerly(lora_setup):
    """The GPU runner's code (a CPU stand-in) over an engine with adapters builds no decode graphs
    (a replay would not apply the step's adapters) and gives the merged models' tokens."""
    from batchrun.engine.runners import GpuRunner

    prompts = _prompts()[:3]
    names: list[Optional[str]] = ["b", None, "a"]
    engine = _engine(lora_setup, async_scheduling=True)
    engine.runner = GpuRunner.stand_in(engine.runner, 8)
    engine.set_async_scheduling(True)
    assert engine.runner.graphs is None and engine.runner.lora is not None
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in outs] == _expected(lora_setup, prompts, names)
    assert engine.stats().num_async_steps == 0


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_decode_steps_spread_over_adapters_take_the_bound_kernel(lora_setup, native, monkeypatch):
    """The CPU kernel set binds the native LoRA kernel (csrc/lora.cpp) for decode steps whose rows
    are spread over adapters, and BATCHRUN_CPU_KERNELS=0 the torch path: the merged models' tokens
    either way, and the native kernel did serve."""
    from batchrun.kernels import cpu_native
    from batchrun.kernels.lora import lora_rows_native

    if not native:
        monkeypatch.setenv("BATCHRUN_CPU_KERNELS", "0")
    elif not cpu_native.available():
        pytest.skip("no C++ compiler: the native kernels are not built")
    engine = _engine(lora_setup)
    assert engine.runner.lora is not None
    layers = list(engine.runner.lora.layers.values())
    assert all(layer.lora_rows is (lora_rows_native if native else None) for layer in layers)
    calls: list[int] = []
    if native:
        for layer in layers:
            layer.lora_rows = lambda *a: calls.append(1) or lora_rows_native(*a)
    prompts = _prompts()
    names: list[Optional[str]] = ["a", "b", None, "b", "a", "b"]
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in outs] == _expected(lora_setup, prompts, names)
    assert bool(calls) == native


def test_prefix_cache_is_keyed_by_adapter(lora_setup):
    """Blocks computed for the base model give an adapter's rows nothing (nor one adapter's the
    other's), and an adapter's rows hit the blocks computed for that adapter."""
    first, second = _shared_prefix_prompts()
    engine = _engine(lora_setup, enable_prefix_caching=True)

    def run(prompt: str, adapter: Optional[str]) -> int:
        """Generate alone; the prompt tokens found cached."""
        out = engine.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert out.token_ids == _expected(lora_setup, [prompt], [adapter])[0]
        return out.metrics.num_cached_tokens

    assert run(first, None) == 0
    assert run(second, None) >= 64, "the prompts share full blocks (base model)"
    assert run(first, "a") == 0 and run(second, "b") == 0
    assert run(second, "a") >= 64 and run(first, "b") >= 64


def test_unknown_adapter_is_an_error_output_and_the_rest_run(lora_setup):
    prompts = _prompts()[:3]
    engine = _engine(lora_setup)
    outs = engine.generate(prompts, GREEDY, adapters=["a", "nope", None])
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert outs[1].error == "unknown adapter 'nope' (known: a, b)"
    assert [outs[0].token_ids, outs[2].token_ids] == _expected(lora_setup, [prompts[0], prompts[2]], ["a", None])
    # engine.max_loras=4 (the default) with two adapters: two slots allocated, not four
    lora = engine.settings.as_dict()["lora"]
    assert lora["max_loras"] == 4 and lora["slots"] == 2
    assert {m.lora_a.shape[0] for m in engine.model.modules() if type(m).__name__ == "LoraLinear"} == {2}


def test_an_abandoned_stream_unpins_its_adapters(lora_setup):
    engine = _engine(lora_setup, max_loras=1)
    requests = [EngineRequest(i, p, GREEDY, adapter=n) for i, (p, n) in enumerate(zip(_prompts(), "abab"))]
    stream = engine.stream(requests)
    first = next(stream)
    stream.close()
    assert first.finish_reason == "length" and not engine.scheduler.has_unfinished()
    slots = engine.runner.lora
    assert slots is not None and not slots.is_pinned("a") and not slots.is_pinned("b")
    out = engine.generate(_prompts()[:1], GREEDY, adapters=["b"])[0]
    assert out.token_ids == _expected(lora_setup, _prompts()[:1], ["b"])[0]


def test_self_speculation_with_adapters_keeps_greedy_tokens(lora_setup):
    """Draft passes (the first layer) and verification both run each row's adapter."""
    prompts = _prompts()[:4]
    names: list[Optional[str]] = ["a", "b", None, "b"]
    spec = dict(method="self", num_speculative_tokens=3, self_layers=1, adaptive=False)
    engine = _engine(lora_setup, speculative=spec)
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in outs] == _expected(lora_setup, prompts, names)
    assert engine.stats().num_spec_proposed > 0


def test_samples_of_one_prompt_share_its_adapter(lora_setup):
    """n=2 at a temperature so low that sampling is greedy: every sample, sample 0's prefill and the
    siblings decoding on its forked prompt blocks, follows its prompt's adapter."""
    prompts = _prompts()[1:3]
    names: list[Optional[str]] = ["b", "a"]
    params = SamplingParams(temperature=1e-4, max_tokens=MAX_TOKENS, ignore_eos=True, n=2, seed=3)
    outs = _engine(lora_setup, max_loras=1).generate(prompts, params, adapters=names)
    expected = _expected(lora_setup, prompts, names)
    assert [o.token_ids for o in outs] == [expected[0], expected[0], expected[1], expected[1]]
    assert [o.sample_index for o in outs] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "setting, key",
    [
        (dict(tensor_parallel_size=2), "engine.tensor_parallel_size=2"),
        (dict(speculative=dict(method="draft", draft_model="x")), "engine.speculative.method=draft"),
        (dict(task="embed"), "engine.task=embed"),
        (dict(batch_invariant=True), "engine.batch_invariant"),
    ],
)
def test_settings_lora_cannot_run_are_refused_naming_both_keys(setting, key):
    with pytest.raises(ValueError, match="engine.lora_adapters") as info:
        EngineConfig(lora_adapters={"a": "/nowhere"}, **setting)
    assert key in str(info.value) and "\n" not in str(info.value)
    EngineConfig(**setting)  # each of them fine without adapters


def test_adapters_on_a_model_served_as_score_are_refused(tmp_path):
    """engine.task=auto resolving to score (a classification head) is refused once the model is seen."""
    from batchrun.engine.config import EngineConfigError
    from tests.support.pooling_models import make_tiny_classifier

    model = make_tiny_classifier(tmp_path / "classifier", labels=["no", "yes"])
    with pytest.raises(
        EngineConfigError, match=r"engine.lora_adapters cannot run with engine.task=auto \(resolved to score\)"
    ):
        Engine(EngineConfig(model=str(model), lora_adapters={"a": "/nowhere"}, device="cpu"))


@pytest.mark.parametrize("max_loras", [0, -1, True, 1.5])
def test_max_loras_must_be_a_whole_number_of_at_least_one(max_loras):
    with pytest.raises(ValueError, match="engine.max_loras"):
        EngineConfig(max_loras=max_loras)


def test_no_adapters_configured_leaves_settings_and_runner_as_they_were(tiny_model_factory, lora_setup):
    engine = Engine(EngineConfig(model=tiny_model_factory("llama"), **SMALL))
    assert "lora" not in engine.settings.as_dict() and engine.adapter_fingerprints == {}
    assert engine.runner.lora is None and engine.scheduler.lora is None
    out = engine.generate(["some text"], GREEDY, adapters=["a"])[0]
    assert out.finish_reason == "error" and out.error == "unknown adapter 'a' (known: none)"


# ---- the scheduler's slots alone: a fake model, fake slots ------------------------------------


class FakeSlots:
    """LoraSlots' bookkeeping (model/lora.py) without weights: LRU slots, pins."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.resident: list[str] = []  # least recently used first
        self.pins: dict[str, int] = {}
        self.num_loads = 0

    def can_admit(self, name: str) -> bool:
        return (
            name in self.resident
            or len(self.resident) < self.max_loras
            or any(n not in self.pins for n in self.resident)
        )

    def pin(self, name: str) -> int:
        if name not in self.resident:
            assert self.can_admit(name), "pinned without a slot"
            if len(self.resident) == self.max_loras:
                self.resident.remove(next(n for n in self.resident if n not in self.pins))
            self.num_loads += 1
        else:
            self.resident.remove(name)
        self.resident.append(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return 0

    def unpin(self, name: str) -> None:
        assert self.pins.get(name, 0) > 0
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]


def _run_slots(
    names: list[Optional[str]],
    max_loras: int,
    max_num_seqs: int,
    num_blocks: int,
    max_tokens: Optional[list[int]] = None,
):
    """Run requests with these adapters through a scheduler with fake slots and a fake model,
    checking the slot invariants at every step; return (requests, each one's first step, slots)."""
    rng = random.Random(0)
    slots = FakeSlots(max_loras)
    kv = KVCacheManager(num_blocks, 4, True, {"a": "fa", "b": "fb"})
    sched = Scheduler(SchedulerConfig(max_num_seqs, 128, 256, True, frozenset()), kv, lora=slots)
    reqs = []
    for i, name in enumerate(names):
        prompt = [rng.randint(1, 50) for _ in range(rng.randint(5, 30))]
        params = SamplingParams(temperature=0, max_tokens=max_tokens[i] if max_tokens else 6)
        reqs.append(Request(i, i, prompt, params, 0.0, adapter=name))
        sched.add(reqs[-1])
    first_step: dict[int, int] = {}
    for step in range(500):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert not batch.is_empty()
        running = [r.adapter for r in sched.running if r.adapter is not None]
        assert len(set(running)) <= max_loras
        assert {n: running.count(n) for n in set(running)} == slots.pins
        for r in batch.requests:
            first_step.setdefault(r.seq_id, step)
        tokens = {
            r.seq_id: [7]
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if r.num_computed_tokens + n == r.num_tokens
        }
        sched.update(StepResult(batch, tokens))
    assert not sched.has_unfinished() and not slots.pins
    assert all(r.finish_reason == "length" for r in reqs)
    return reqs, first_step, slots


def test_scheduler_passes_over_requests_without_a_slot_and_never_deadlocks():
    """One slot, requests of two adapters and the base interleaved: at every step the running
    requests use one adapter at most, each running request pins it, base requests are never held
    back by a waiting adapter, and everything finishes; a request preempted (the KV pool runs
    short) unpins and pins again when it comes back."""
    reqs, first_step, slots = _run_slots(["a", "b", None, "b", "a", "a", None, "b"], 1, 4, 24)
    assert reqs[5].metrics.num_preemptions == 1, "the newest runner, an adapter's, was preempted and came back"
    assert first_step[2] == 0 and first_step[6] < first_step[1], "base requests are never held back by a slot"
    assert first_step[1] <= first_step[3] <= first_step[7], "requests waiting for a slot keep their order"
    assert slots.num_loads == 2


def test_scheduler_lets_no_adapter_starve_a_waiting_one():
    """One slot, one b request among many a's that end at different steps (so an a is always
    running): a's pass b only until max_num_seqs of them have, then the running a's drain and b
    runs before the a's behind it."""
    names: list[Optional[str]] = ["a", "b", *["a"] * 10]
    reqs, first_step, slots = _run_slots(names, 1, 2, 64, [2 + 3 * (i % 3) for i in range(len(names))])
    overtook = [i for i, name in enumerate(names) if name == "a" and first_step[i] < first_step[1]]
    assert 0 < len(overtook) <= 1 + 2, "the first a, then max_num_seqs a's past b"
    assert slots.num_loads == 3  # a, b, a again
