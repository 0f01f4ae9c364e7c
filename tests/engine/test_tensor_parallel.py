"""Tensor parallelism (engine.tensor_parallel_size): a worker as a group of processes.

Oracles (docs: DESIGN.md): float32 greedy tokens at tp=N equal tp=1 and HF transformers' greedy
`generate`; logprobs within 1e-4 of tp=1; two runs at the same N bitwise equal; quantized shards are
slices of the one-process quantized weights; a rank holds about 1/N of the weights; a rank that dies
ends the group with TensorParallelError and leaves no process behind.

Every multi-process engine costs seconds to start on a 2-core machine (each follower imports torch),
so each engine here serves as many checks as it can: one tp=2 engine per family runs greedy requests
with logprobs (chunked, prefix-cached), one with prompt logprobs and one seeded sampled request, all
in one `generate` call.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from batchrun import Engine, EngineConfig, SamplingParams
from batchrun.engine import EngineConfigError, RequestOutput, TensorParallelError
from batchrun.engine.config import SpeculativeConfig
from batchrun.testing import FAMILIES, make_tiny_model, sample_texts
from tests.engine import test_identity as identity

MAX_TOKENS = 20
# Small enough that every prompt but the shortest is prefilled over several steps (chunked), with
# room for the 10 requests' decodes; the KV pool small, so start-up allocates little on each rank.
ENGINE: dict[str, Any] = dict(
    dtype="float32", device="cpu", kv_cache_memory=32 << 20, max_num_seqs=16, max_num_batched_tokens=37
)
LOGPROB_TOLERANCE = 1e-4  # DESIGN.md: a sum over ranks differs from one process's in the last bits
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
# identity._prompts(): 9 prompts of different lengths, prompts[8] sharing its first 520 characters
# (14 full blocks) with prompts[3]
NUM_GREEDY = 9
PROMPT_LOGPROBS = (0, 6)  # requests that also score their prompt (they bypass the prefix cache)
SAMPLED = 9  # the seeded sampled request, over prompts[1] again


def _requests() -> tuple[list[str], list[SamplingParams]]:
    """Greedy requests with logprobs, two of them with prompt logprobs, and one seeded sample."""
    prompts = identity._prompts()
    assert len(prompts) == NUM_GREEDY
    params = [GREEDY] * NUM_GREEDY
    for i in PROMPT_LOGPROBS:
        params[i] = dataclasses.replace(GREEDY, prompt_logprobs=3)
    prompts.append(prompts[1])
    params.append(SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, logprobs=3))
    return prompts, params


# ---- the group's processes -------------------------------------------------------------------------


def _live_followers() -> list[int]:
    """Pids of this process's children that run a follower and have not exited (zombies excluded:
    their command line is empty)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
        if ppid == os.getpid() and b"batchrun.engine.follower" in cmdline:
            pids.append(int(entry))
    return pids


def _assert_group_ended(engine: Engine) -> None:
    """Every follower of `engine`'s group has exited and been reaped: none is left running (judged by
    its pid, so a follower another test leaked is not blamed on this one)."""
    if engine.group is not None:
        assert all(p.poll() is not None for p in engine.group.processes)
        assert not {p.pid for p in engine.group.processes} & set(_live_followers())


@dataclasses.dataclass
class Run:
    outputs: list[RequestOutput]
    settings: Any  # EngineSettings
    stats: Any  # EngineStats


def _run(model: str, tp: int, prompts: list[str], params: Any, **config: Any) -> Run:
    """One engine at `tp` ranks serving one generate call; its followers are checked gone after."""
    with Engine(EngineConfig(model=model, tensor_parallel_size=tp, **{**ENGINE, **config})) as engine:
        assert engine.settings.tensor_parallel_size == tp
        assert engine.group is None if tp == 1 else len(engine.group.processes) == tp - 1
        outputs = engine.generate(prompts, params)
        run = Run(outputs, engine.settings, engine.stats())
    _assert_group_ended(engine)
    for out in outputs:
        assert out.error is None, out.error
    return run


def _assert_logprobs_close(a: Optional[list[dict[int, float]]], b: Optional[list[dict[int, float]]], what: str) -> None:
    """The same candidates at every position, their logprobs within LOGPROB_TOLERANCE."""
    assert a is not None and b is not None and len(a) == len(b) > 0, what
    for pos, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), f"{what}, position {pos}: candidates {sorted(x)} != {sorted(y)}"
        for token, logprob in x.items():
            assert abs(logprob - y[token]) <= LOGPROB_TOLERANCE, f"{what}, position {pos}, token {token}"


def _assert_same_as_tp1(one: Run, many: Run) -> None:
    """Greedy and seeded tokens equal, logprobs and prompt logprobs within the tolerance."""
    for i, (a, b) in enumerate(zip(one.outputs, many.outputs, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i}: tp={many.settings.tensor_parallel_size} differs from tp=1"
        _assert_logprobs_close(a.logprobs, b.logprobs, f"request {i} logprobs")
        if i in PROMPT_LOGPROBS:
            _assert_logprobs_close(a.prompt_logprobs, b.prompt_logprobs, f"request {i} prompt logprobs")


# ---- models ----------------------------------------------------------------------------------------

# Qwen2-MoE (not in FAMILIES): shared expert with a sigmoid gate, QKV bias, a dense layer between the
# sparse ones. Its vocabulary of 515 ids divides by neither 2, 3 nor 4, so the last rank's slice of
# the embedding and LM head is padded (258 rows a rank at tp=2, one of rank 1's padding): it checks
# the padding at no extra engine's cost (the model is built here anyway).
ODD_VOCAB = 515
QWEN2_MOE = dict(
    model_type="qwen2_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    norm_topk_prob=False,
    mlp_only_layers=[1],
    vocab_size=ODD_VOCAB,
)
HIDDEN_SIZE = 64  # batchrun.testing's tiny models
MODELS = sorted(FAMILIES) + ["qwen2_moe"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory) -> Callable[[str], str]:
    """name -> a tiny model directory: a family of FAMILIES (the session's), or "qwen2_moe"."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name in FAMILIES:
            return tiny_model_factory(name)  # type: ignore[no-any-return]
        if name not in built:
            assert name == "qwen2_moe", name
            built[name] = str(make_tiny_model(tmp_path_factory.mktemp("tp_models") / name, "qwen2", **QWEN2_MOE))
        return built[name]

    return get


@pytest.fixture(scope="module")
def runs(model_dir) -> Callable[[str, int], Run]:
    """(model name, tp) -> the run of `_requests()` on that model at tp ranks, made once for the
    module: the tests that compare against a run share it instead of each starting a group."""
    cache: dict[tuple[str, int], Run] = {}

    def get(name: str, tp: int) -> Run:
        if (name, tp) not in cache:
            cache[name, tp] = _run(model_dir(name), tp, *_requests())
        return cache[name, tp]

    return get


# ---- every family at tp=2 against tp=1 and HF --------------------------------------------------


@pytest.mark.parametrize("family", MODELS)
def test_tp2_matches_tp1_and_hf(family, model_dir, runs, one_torch_thread):
    """Greedy tokens equal HF's and tp=1's, logprobs and prompt logprobs close to tp=1's, the seeded
    sample equal to tp=1's, with chunked prefill and a prefix-cache hit; weight bytes split in two."""
    prompts, _ = _requests()
    one, two = runs(family, 1), runs(family, 2)
    _assert_same_as_tp1(one, two)
    hf = identity._hf_greedy(model_dir(family), prompts[:NUM_GREEDY], MAX_TOKENS)
    for i in range(NUM_GREEDY):
        assert two.outputs[i].token_ids == hf[i], f"prompt {i}: tp=2 {two.outputs[i].token_ids} != hf {hf[i]}"
    assert one.outputs[SAMPLED].token_ids != one.outputs[1].token_ids, "the sampled request should not be greedy"

    # What the run was meant to exercise: prompts chunked over steps, prompts[8] served from the cache.
    assert max(len(o.prompt_token_ids) for o in two.outputs) > ENGINE["max_num_batched_tokens"]
    assert two.outputs[8].metrics.num_cached_tokens > 0
    assert two.stats.num_steps == one.stats.num_steps  # rank 0 schedules as one process does

    # Each tensor counted once over the group: tp=1's bytes (each replicated tensor's bytes divide by
    # 2), plus, with the odd vocabulary, the padding row of the embedding and of the LM head.
    padding_bytes = 2 * HIDDEN_SIZE * 4 if family == "qwen2_moe" else 0
    assert two.settings.weight_bytes == one.settings.weight_bytes + padding_bytes
    assert one.settings.rank_weight_bytes == (one.settings.weight_bytes,)
    # A rank holds half, plus its share of what both hold: norms and router whole, and with Gemma 3's
    # one KV head, that head's K and V projections (a sixth of its attention weights).
    half = two.settings.weight_bytes / 2
    replicated_share = 0.07 if family == "gemma3_text" else 0.01
    assert len(two.settings.rank_weight_bytes) == 2
    for rank_bytes in two.settings.rank_weight_bytes:
        assert half <= rank_bytes <= half * (1 + replicated_share)
    if family == "qwen2_moe":  # the padded rows are cut off: ids past the tokenizer's are real rows
        assert any(t >= 512 for o in two.outputs for t in o.token_ids), "no id past 512: the last rows unused"


# ---- bitwise repeatability, a follower that dies between calls -----------------------------------


def test_two_tp2_runs_are_bitwise_equal_and_a_death_between_calls_ends_the_group(model_dir, runs, one_torch_thread):
    """A second tp=2 run gives the first one's bits (same all-reduce order). Then, on its engine (one
    start saved), a follower killed between two generate calls fails the next call."""
    prompts, params = _requests()
    first = runs("qwen2_moe", 2)
    with Engine(EngineConfig(model=model_dir("qwen2_moe"), tensor_parallel_size=2, **ENGINE)) as engine:
        outputs = engine.generate(prompts, params)
        for i, (a, b) in enumerate(zip(first.outputs, outputs, strict=True)):
            assert (a.token_ids, a.logprobs, a.prompt_logprobs) == (b.token_ids, b.logprobs, b.prompt_logprobs), i

        follower = engine.group.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.generate(prompts[:1], GREEDY)
    _assert_group_ended(engine)


# ---- followers that die, and a start-up that fails -------------------------------------------------


def test_a_follower_killed_during_generate_fails_it_and_leaves_no_process(tiny_llama_dir, one_torch_thread):
    """SIGKILL from another thread once steps are running, with far more work queued than runs
    before the kill is noticed: the generate call raises TensorParallelError instead of finishing."""
    # Every request decodes to the model's 512-token limit: hundreds of steps.
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    with Engine(EngineConfig(model=tiny_llama_dir, tensor_parallel_size=2, **{**ENGINE, "max_num_seqs": 4})) as engine:
        follower = engine.group.processes[0]
        killed = threading.Event()

        def kill_once_running() -> None:
            while engine.stats().num_steps < 3 and not killed.is_set():
                time.sleep(0.001)
            os.kill(follower.pid, signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill_once_running, daemon=True)
        killer.start()
        try:
            with pytest.raises(TensorParallelError, match="rank 1"):
                engine.generate(["The quick brown fox"] * 4, long)
        finally:
            killed.set()
            killer.join()
        assert follower.wait() == -signal.SIGKILL
    _assert_group_ended(engine)


def test_a_start_up_that_fails_after_the_followers_loaded_ends_them_cleanly(
    tiny_llama_dir, monkeypatch, one_torch_thread
):
    """Rank 0 fails after the followers have loaded their shards (a KV cache too small for one block):
    the error is rank 0's, and each follower, told to exit while it waits for its KV plan, exits 0."""
    from batchrun.engine import group_startup

    real_start_group, started = group_startup.start_group, []

    def recording_start_group(*args: Any, **kwargs: Any) -> Any:
        started.append(real_start_group(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(group_startup, "start_group", recording_start_group)
    config = EngineConfig(model=tiny_llama_dir, tensor_parallel_size=2, **{**ENGINE, "kv_cache_memory": 1024})
    with pytest.raises(ValueError, match="engine.kv_cache_memory=1024 leaves no room"):
        Engine(config)
    assert len(started) == 1
    assert [p.returncode for p in started[0].processes] == [0]
    assert not {p.pid for p in started[0].processes} & set(_live_followers())


def test_heads_that_do_not_split_raise_before_any_follower_starts(tiny_llama_dir, monkeypatch):
    """tp=3 on 4 attention heads: refused with the key and the head counts, and no process started."""
    from batchrun.engine import group_startup

    def no_group(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a group was started for a model it cannot split")

    monkeypatch.setattr(group_startup, "start_group", no_group)
    before = set(_live_followers())
    with pytest.raises(EngineConfigError) as error:
        Engine(EngineConfig(model=tiny_llama_dir, tensor_parallel_size=3, **ENGINE))
    message = str(error.value)
    assert "engine.tensor_parallel_size=3" in message
    assert "4 attention heads" in message and "2 KV heads" in message
    assert set(_live_followers()) == before


@pytest.mark.parametrize(
    "setting, key",
    [
        (dict(quantization="w8a8"), "engine.quantization=w8a8"),
        (dict(quantization="w4a8"), "engine.quantization=w4a8"),
        (dict(async_scheduling=True), "engine.async_scheduling"),
        (dict(speculative=dict(method="draft", draft_model="some-draft")), "engine.speculative.method=draft"),
        (dict(batch_invariant=True), "engine.batch_invariant"),
    ],
)
def test_settings_a_group_cannot_run_are_refused_naming_both_keys(setting, key):
    with pytest.raises(ValueError) as error:
        EngineConfig(model="unused", tensor_parallel_size=2, **setting)
    assert "engine.tensor_parallel_size=2" in str(error.value) and key in str(error.value)
    EngineConfig(model="unused", tensor_parallel_size=1, **setting)  # alone, each is accepted


@pytest.mark.parametrize("size", [0, -1, True, 2.0])
def test_tensor_parallel_size_must_be_a_whole_number_from_1(size):
    with pytest.raises(ValueError, match="engine.tensor_parallel_size must be a whole number"):
        EngineConfig(tensor_parallel_size=size)


# ---- quantized shards, speculative decoding ------------------------------------------------------


@pytest.mark.parametrize("quantization, method", [("int8", "ngram"), ("int4", "self")], ids=["int8-ngram", "int4-self"])
def test_quantized_speculating_tp2_gives_tp1_greedy_tokens(quantization, method, tiny_llama_dir, one_torch_thread):
    """int8 and int4 (groups of 32) at tp=2 give tp=1's greedy tokens for the same quantization, with
    ngram or self speculation on (it must not change greedy tokens; the follower runs the verify
    forwards and, for self, the draft's first-layers forwards too). One engine serves both checks:
    each multi-process engine costs seconds to start."""
    texts = sample_texts()
    prompts = [texts[i][:n] for i, n in zip(range(4), (60, 300, 120, 25))]
    prompts += [p + " " + p[:80] for p in prompts[:2]]  # text that repeats: n-gram proposals hit
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    quant = dict(quantization=quantization, quant_group_size=32)
    one = _run(tiny_llama_dir, 1, prompts, greedy, **quant)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, self_layers=1, adaptive=False)
    two = _run(tiny_llama_dir, 2, prompts, greedy, speculative=spec, **quant)
    assert [o.token_ids for o in two.outputs] == [o.token_ids for o in one.outputs]
    assert two.settings.quantization == quantization
    assert any(k.startswith(f"linear:{quantization}") for k in two.settings.quant_formats), "nothing quantized"
    assert two.stats.num_spec_proposed > 0 and two.stats.num_spec_accepted > 0, "speculation never ran"


def test_fp8_shards_are_one_process_codes_sliced_and_give_tp1_tokens(tiny_llama_dir, one_torch_thread):
    """fp8 scales are per output channel: a row-parallel projection's (o_proj, down_proj) rank holds
    only some columns of each row, so the ranks agree on each row's magnitude (an all-reduce of the
    maxima at load) and rank 0's codes and scales are one process's, sliced; tokens are tp=1's."""
    prompts = [t[:n] for t, n in zip(sample_texts(), (60, 200, 25))]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    config = dict(ENGINE, quantization="fp8")
    with Engine(EngineConfig(model=tiny_llama_dir, **config)) as one_engine:
        one = one_engine.generate(prompts, greedy)
        whole = {n: b.clone() for n, b in one_engine.model.layers[0].named_buffers()}
    with Engine(EngineConfig(model=tiny_llama_dir, tensor_parallel_size=2, **config)) as group:
        two = group.generate(prompts, greedy)
        rank0 = dict(group.model.layers[0].named_buffers())
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for name, cols in (("self_attn.o_proj", 32), ("mlp.down_proj", 64)):  # 64 and 128 inputs, half each
        assert whole[f"{name}.qweight"].dtype == torch.float8_e4m3fn
        assert torch.equal(rank0[f"{name}.scales"], whole[f"{name}.scales"])  # whole rows' magnitudes
        assert torch.equal(
            rank0[f"{name}.qweight"].view(torch.uint8), whole[f"{name}.qweight"][:, :cols].view(torch.uint8)
        )


class _NoCollectives:
    """Collectives that do nothing: enough to build one rank's model in this process (no forward)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def broadcast(self, tensor: torch.Tensor) -> None:
        pass

    def gather(self, tensor: torch.Tensor) -> None:
        return None


def _engine_model(model: str, quantization: str, group_size: int, rank: Optional[int], size: int) -> Any:
    """The model start-up builds (engine/startup.py: load_target's steps): the checkpoint read whole,
    or rank `rank`'s slices of it, then the engine's quantization prep."""
    from batchrun.engine.quantization import prepare_linears_for_engine
    from batchrun.engine.startup import bind
    from batchrun.model.decoder import build_decoder
    from batchrun.model.loader import load_model
    from batchrun.model.tensor_parallel import TensorParallel, TPShard

    config = EngineConfig(
        model=model, dtype="float32", device="cpu", quantization=quantization, quant_group_size=group_size
    )
    kernels = bind(config)
    shard = TPShard(rank, size) if rank is not None else None
    loaded = load_model(model, torch.float32, tp_shard=shard)
    tp = TensorParallel(shard, _NoCollectives(), None) if shard is not None else None
    decoder = build_decoder(loaded.config, loaded.state_dict, torch.float32, kernels.target.device, kernels, tp)
    prepare_linears_for_engine(decoder, config, loaded.tokenizer, None, kernels)
    return decoder


def _rows(spec: Any, proj: str, rank: int, size: int) -> torch.Tensor:
    """The output rows of the one-process fused projection that rank `rank` holds, in its order."""
    d, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads

    def span(lo: int, n: int) -> torch.Tensor:
        return torch.arange(lo, lo + n)

    if proj == "self_attn.qkv_proj":  # q, k, v rows by head; a KV head shared by ranks where too few
        q = heads // size * d
        kv_head, kv = (rank * kv_heads // size, 1) if kv_heads < size else (rank * kv_heads // size, kv_heads // size)
        k_rows = span(kv_head * d, kv * d)
        return torch.cat([span(rank * q, q), heads * d + k_rows, (heads + kv_heads) * d + k_rows])
    assert proj == "mlp.gate_up_proj"
    part = spec.intermediate_size // size
    return torch.cat([span(rank * part, part), spec.intermediate_size + span(rank * part, part)])


def _columns(spec: Any, proj: str, rank: int, size: int) -> tuple[int, int]:
    """The input columns [lo, hi) of the one-process row-parallel projection rank `rank` holds."""
    width = (spec.num_heads * spec.head_dim if proj == "self_attn.o_proj" else spec.intermediate_size) // size
    return rank * width, (rank + 1) * width


PROJECTIONS = ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj")


def _sharding_mismatches(model: str, quantization: str, group_size: int, size: int = 2) -> tuple[list[str], int]:
    """(the quantized tensors some rank holds that are not its slice of the one-process model's
    quantized tensor, the number compared). A rank's slice: column-parallel qkv and gate/up by output
    rows, row-parallel o_proj and down_proj by input columns, in the tensor's own units (2 codes a
    byte for int4, one scale a group)."""
    from batchrun.model.quant.layers import QuantLinear

    whole = _engine_model(model, quantization, group_size, None, 1)
    spec = whole.spec
    mismatches, num_compared = [], 0
    for rank in range(size):
        shard = _engine_model(model, quantization, group_size, rank, size)
        for name, module in whole.named_modules():
            if not name.startswith("layers.") or name.split(".", 2)[-1] not in PROJECTIONS:
                continue
            proj, part = name.split(".", 2)[-1], shard.get_submodule(name)
            assert isinstance(module, QuantLinear) and type(part) is type(module), name
            buffers = dict(module.named_buffers())
            assert buffers.keys() == dict(part.named_buffers()).keys() and {"qweight", "scales"} <= buffers.keys()
            # A row-parallel bias would be added on every rank before the all-reduce: none is built.
            assert proj not in ("self_attn.o_proj", "mlp.down_proj") or "bias" not in buffers, name
            for key, tensor in buffers.items():
                if proj in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                    expected = tensor[_rows(spec, proj, rank, size)]
                else:
                    lo, hi = _columns(spec, proj, rank, size)
                    per_column = tensor.shape[1] / module.in_features
                    is_whole = (lo * per_column).is_integer() and (hi * per_column).is_integer()
                    expected = tensor[:, int(lo * per_column) : int(hi * per_column)] if is_whole else None
                got = getattr(part, key)
                num_compared += 1
                if expected is None or got.dtype != expected.dtype or not torch.equal(got, expected):
                    mismatches.append(f"rank {rank} {name}.{key}")
    return mismatches, num_compared


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_quantized_shards_are_slices_of_the_one_process_weights(family, quantization, tiny_model_factory):
    """At tp=2, in groups of 32, each rank's quantized projections hold exactly its slice of the
    one-process model's quantized tensors (codes, scales, mins, bias): Qwen2's QKV bias rides along,
    Gemma 3's one KV head is on both ranks."""
    mismatches, num_compared = _sharding_mismatches(tiny_model_factory(family), quantization, 32)
    assert mismatches == []
    assert num_compared >= 2 * 3 * len(PROJECTIONS) * 2, "fewer quantized tensors than 2 ranks' projections hold"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_the_group_check_refuses_exactly_the_group_sizes_whose_shards_would_not_be_slices(
    group_size, quantization, tiny_llama_dir
):
    """Start-up's check (engine/group_startup.py: check_group) refuses a grouped quantization at tp=2
    where, and only where, a rank's quantized weights would not be its slice of one process's. The
    tiny llama's row-parallel inputs are 64 (o_proj) and 128 (down_proj) wide: groups of 32 split
    both; a group size above an input's width is the width (a layer quantizes in the largest group
    that divides it), and a rank's half then quantizes in groups of its own."""
    from batchrun.engine.group_startup import check_group
    from batchrun.model.loader import model_config

    config = EngineConfig(
        model=tiny_llama_dir, quantization=quantization, quant_group_size=group_size, tensor_parallel_size=2
    )
    try:
        check_group(config, model_config(tiny_llama_dir), 0, torch.device("cpu"))
        refused = None
    except EngineConfigError as e:
        refused = str(e)
        assert "engine.tensor_parallel_size=2" in refused and f"engine.quant_group_size={group_size}" in refused
    mismatches, _ = _sharding_mismatches(tiny_llama_dir, quantization, group_size)
    assert (refused is not None) == bool(mismatches), refused or mismatches
    assert (refused is None) == (group_size <= 32), "the tiny llama's o_proj halves are 32 inputs wide"


# ---- more ranks: tp=4, and the real model at tp=3 ------------------------------------------------


@pytest.mark.slow
def test_tp4_matches_tp1(runs, one_torch_thread):
    """Four ranks on Qwen2-MoE: one query head a rank, each of the two KV heads on two ranks, 129
    vocabulary rows a rank (the last one padded), slices of 32, 16 and 24 of the MLP, experts and
    shared expert: the same requests as at tp=2, the same tokens and logprobs as tp=1."""
    four = runs("qwen2_moe", 4)
    _assert_same_as_tp1(runs("qwen2_moe", 1), four)
    assert len(four.settings.rank_weight_bytes) == 4


@pytest.mark.slow
def test_smollm2_at_tp3_gives_tp1_greedy_tokens_over_its_gguf_blocks(smollm2_cache_dir, one_torch_thread):
    """The real SmolLM2-135M (9 heads, 3 KV heads: one a rank; a 49152-id vocabulary, tied
    embeddings) at tp=3, float32 activations over the file's own Q4_1 blocks (engine.quantization=
    gguf): each rank slices the blocks (output rows, or input columns at block boundaries), so rank
    0's blocks are bitwise one process's, sliced, and the group's greedy tokens are one process's.
    One pair of engines serves both checks: the real model's group costs seconds to start."""
    config = dict(cache_dir=smollm2_cache_dir, max_num_seqs=4, max_num_batched_tokens=256, quantization="gguf")
    questions = ["What is the capital of France?", "Write a haiku about batch jobs.", "Name three primary colors."]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    with Engine(EngineConfig(model="smollm2-135m", **{**ENGINE, **config})) as engine:
        tok = engine.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions
        ]
        one = engine.generate(prompts, params)
        whole = {n: b.clone() for n, b in engine.model.layers[0].named_buffers()}
        formats = dict(engine.settings.quant_formats)
    with Engine(EngineConfig(model="smollm2-135m", tensor_parallel_size=3, **{**ENGINE, **config})) as group:
        three = group.generate(prompts, params)
        settings = group.settings
        rank0 = dict(group.model.layers[0].named_buffers())
    for a, b in zip(one, three, strict=True):
        assert b.token_ids == a.token_ids
        _assert_logprobs_close(a.logprobs, b.logprobs, b.text)
    assert "Paris" in one[0].text  # the real model, really loaded
    assert settings.quant_formats == formats and any(k.startswith("linear:int4") for k in formats)
    # o_proj: 576 inputs, rank 0 the first 192 (6 blocks of 32; int4: two columns a byte)
    assert torch.equal(rank0["self_attn.o_proj.qweight"], whole["self_attn.o_proj.qweight"][:, :96])
    assert torch.equal(rank0["self_attn.o_proj.scales"], whole["self_attn.o_proj.scales"][:, :6])
    # gate_up: rank 0's first third of the gate rows, then of the up rows
    gate_up = whole["mlp.gate_up_proj.qweight"]
    assert torch.equal(rank0["mlp.gate_up_proj.qweight"], torch.cat([gate_up[:512], gate_up[1536 : 1536 + 512]]))
    # Each rank holds a third of the weights (+ its share of the norms, which all three hold).
    third = settings.weight_bytes / 3
    assert all(third <= b <= third * 1.01 for b in settings.rank_weight_bytes)


# ---- bf16 on the CPU: the packed and native layers -------------------------------------------------


def test_a_bf16_group_runs_the_packed_cpu_layers(tmp_path, one_torch_thread):
    """bf16 on the CPU packs the linears (and with the native kernels reads a tied embedding out of
    the LM head's tiles: NativeEmbedding, which has no `.weight`), on every rank: the group must run
    whichever module holds a rank's vocabulary slice. bf16 sums in another order than one process,
    so only each prompt's first token is compared (one step from the same prompt, no near tie in
    this model's logits there), and every output must be its full length."""
    model_dir = str(make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True))
    config = dict(ENGINE, dtype="bfloat16")
    prompts = identity._prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with Engine(EngineConfig(model=model_dir, **config)) as one:
        want = one.generate(prompts, params)
    with Engine(EngineConfig(model=model_dir, tensor_parallel_size=2, **config)) as group:
        assert group.settings.packed_linears > 0  # the bf16 CPU path, not float32's plain linears
        got = group.generate(prompts, params)
    assert [o.token_ids[0] for o in got] == [o.token_ids[0] for o in want]
    assert all(len(o.token_ids) == 6 for o in got)


def test_a_cpu_group_shares_a_fraction_of_the_hosts_memory(tiny_llama_dir):
    """KV budget as a fraction of free memory (or the default share): a CPU group's ranks sit on one
    host, so each takes 1/N of the share (its blocks hold 1/N of the heads: the group holds one
    process's blocks); bytes given outright are each rank's. No processes: plan_kv alone."""
    from batchrun.engine import startup

    target = startup.load_target(EngineConfig(model=tiny_llama_dir, dtype="float32"))
    for memory in (0.05, None):
        alone = startup.plan_kv(EngineConfig(model=tiny_llama_dir, kv_cache_memory=memory), target)
        shared = startup.plan_kv(
            EngineConfig(model=tiny_llama_dir, kv_cache_memory=memory, tensor_parallel_size=2), target
        )
        assert shared.num_blocks == pytest.approx(alone.num_blocks / 2, rel=0.05), memory  # free memory moves a little
    fixed = dict(model=tiny_llama_dir, kv_cache_memory=8 << 20)
    assert (
        startup.plan_kv(EngineConfig(**fixed, tensor_parallel_size=2), target).num_blocks
        == startup.plan_kv(EngineConfig(**fixed), target).num_blocks
    )
