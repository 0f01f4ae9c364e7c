"""Who does what in a step: the runner scores prompt tokens without the sampler, and a request
whose grammar failed is reported in the runner's StepResult and ended by the stop rule, in the
scheduler's update."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.grammar import GrammarState
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.request import Request
from batchrun.engine.runners import ForwardOutput, token_logprobs
from batchrun.engine.runners.sampling import StepSampler
from batchrun.engine.sampler import Sampler
from batchrun.engine.scheduler import Scheduler, SchedulerConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_n", [0, 1, 5, 600])  # 600: more than the vocabulary
def test_runner_prompt_scores_are_the_samplers_logprobs_bit_for_bit(dtype, top_n):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 512, generator=g) * 4).to(dtype)  # (rows, vocab_size)
    tokens = torch.randint(0, 512, (7,), generator=g).tolist()
    params = [SamplingParams(temperature=0.0, prompt_logprobs=top_n)] * len(tokens)
    expected = Sampler.logprobs(logits, params, torch.tensor(tokens), tokens, [top_n] * len(tokens))
    got = token_logprobs(logits, tokens, top_n)
    assert got == expected  # the same floats, the same keys in the same order
    assert [list(d) for d in got] == [list(d) for d in expected]
    assert all(len(d) >= min(top_n, 512) for d in got)


def _failed_grammar() -> GrammarState:
    compiled: Future = Future()
    compiled.set_exception(RuntimeError("compiler exploded"))
    return GrammarState(compiled, vocab_size=32)


def test_a_failed_grammar_is_reported_by_the_runner_and_ended_by_the_stop_rule():
    kv = KVCacheManager(16, 16, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256), kv)
    reqs = [Request(i, i, [1, 2, 3], SamplingParams(temperature=0.0), 0.0) for i in range(2)]
    reqs[0].grammar = _failed_grammar()
    for r in reqs:
        scheduler.add(r)
    batch = scheduler.schedule()
    out = ForwardOutput(logits=torch.zeros(2, 8), sample_seq_ids=[0, 1], num_rows=[1, 1])
    result = StepSampler(Sampler(0)).sample(batch, out, None)
    assert result.grammar_errors == {0: "compiler exploded"} and list(result.tokens) == [1]
    # Not ended by the runner: the scheduler still runs it and its blocks are held until the update.
    assert not reqs[0].is_finished and reqs[0] in scheduler.running and reqs[0].block_ids
    assert scheduler.update(result) == [reqs[0]]
    assert (reqs[0].finish_reason, reqs[0].error, reqs[0].output_token_ids) == ("error", "compiler exploded", [])
    assert not reqs[0].block_ids and reqs[0] not in scheduler.running
    assert not reqs[1].is_finished and reqs[1].output_token_ids == result.tokens[1]


def test_only_an_abort_ends_a_request_outside_the_scheduler():
    """Every other end is the stop rule's, called from Scheduler.update (engine/stop.py): no engine
    module but the scheduler calls its `finish`, except Engine.abort_all."""
    import ast
    from pathlib import Path

    import batchrun.engine

    root = Path(batchrun.engine.__file__).parent
    callers = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "scheduler.py":
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "finish":
                    callers.append((path.relative_to(root).as_posix(), func.name, ast.unparse(node.func.value)))
    assert callers == [("engine.py", "abort_all", "self.scheduler")]
