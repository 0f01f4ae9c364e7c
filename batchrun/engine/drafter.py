"""Runs the proposers of speculative decoding around a scheduled batch.

`plan` (before scheduling) says which decoding requests carry how many drafts; `execute` (after
the scheduler reserved their KV slots) produces the drafts (`fill`: n-gram lookup, the target's
first layers (self), or a separate draft model), runs the step on the target's runner, which
verifies them, and records what was accepted and what the step cost. The self draft shares the
target's KV cache for its layers: the target's verification forward rewrites those entries with
the same values, so nothing needs undoing. A draft model keeps its own cache under the same block
ids and slot mapping, and runs over every scheduled token so its cache always covers what the
target's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from batchrun.engine.config import SpeculativeConfig
from batchrun.engine.device import weight_count
from batchrun.engine.request import Request
from batchrun.engine.runners import ModelRunner, PendingStep
from batchrun.engine.sampler import STREAM_DRAFT, Sampler, draw_from_probs, sampling_probs_rows
from batchrun.engine.scheduler import ScheduledBatch, StepResult
from batchrun.engine.speculative import DraftProbs, SpeculationPolicy, StepCostModel, ngram_propose, record_acceptance
from batchrun.kernels.binding import rebind
from batchrun.kernels.kernel_set import KernelSet
from batchrun.model.decoder import DecoderLM, build_decoder
from batchrun.model.generic import GenericLM
from batchrun.model.loader import load_model


def is_eligible(req: Request, is_adaptive: bool = True) -> bool:
    """A request that may carry drafts: decoding, no logprobs asked, no forced token pending (a
    spent thinking budget's closing tag, engine/reasoning.py), not constrained (verification
    would need the grammar's mask at every draft position), and not a seeded sample under the
    adaptive policy: its on/off choices depend on the batch and the measured step costs, and
    speculating or not changes which draws decide a sampled token, while a seeded request's tokens
    must not depend on the batch. Without the adaptive policy a seeded request speculates whenever
    it has drafts, whatever the batch (as long as the token budget and KV pool hold its drafts)."""
    p = req.params
    return (
        req.num_computed_tokens == req.num_tokens - 1
        and p.logprobs is None
        and (p.is_greedy or p.seed is None or not is_adaptive)
        and not p.is_constrained
        and (req.thinking is None or not req.thinking.forced)  # its next tokens are known: nothing to verify
    )


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        policy: SpeculationPolicy,
        runner: ModelRunner,
        sampler: Sampler,
        num_layers: Optional[int] = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.runner = runner  # the target's runner (self) or the draft model's (draft)
        self.sampler = sampler  # the engine's: unseeded requests draw from its generator
        self.num_layers = num_layers  # self: how many target layers make the draft
        self.num_proposed = 0  # draft tokens verified, over the engine's life
        self.num_accepted = 0  # of those, accepted

    def plan(self, running: list[Request]) -> tuple[dict[int, int], dict[int, list[int]]]:
        k = self.config.num_speculative_tokens
        candidates: list[tuple[Request, int]] = []
        proposals: dict[int, list[int]] = {}
        num_decodes = 0
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1:
                continue
            num_decodes += 1
            if not is_eligible(r, self.config.adaptive):
                continue
            if self.config.method == "ngram":
                drafts = ngram_propose(r.token_ids, k, self.config.ngram_min, self.config.ngram_max)
                if not drafts:
                    continue
                proposals[r.seq_id] = drafts
                candidates.append((r, len(drafts)))
            else:
                candidates.append((r, k))
        return self.policy.choose(candidates, num_decodes), proposals

    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch, proposals: dict[int, list[int]]) -> Optional[DraftProbs]:
        """Put the drafts into the batch; return the distributions sampled drafts were drawn from
        (None when there are none: point-mass proposals, n-gram or greedy, need none).

        Each draft pass handles all its requests at once on the device: greedy rows take the
        argmax, sampled rows draw with uniform (seed, position, STREAM_DRAFT) from their masked
        distribution; only the draft token ids come to the host (the next pass's inputs)."""
        if self.config.method == "ngram":
            batch.spec_token_ids = {s: proposals[s][:n] for s, n in batch.num_spec.items()}
            return None
        reqs = [r for r in batch.requests if r.seq_id in batch.num_spec]
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in reqs}
        probs: list[torch.Tensor] = []  # per pass: (its sampled rows, vocab_size)
        prob_rows: dict[int, list[int]] = {}
        num_prob_rows = 0
        for j in range(max(batch.num_spec.values(), default=0)):
            active = [r for r in reqs if batch.num_spec[r.seq_id] > j]
            step = ScheduledBatch(active, [1] * len(active))
            step.spec_token_ids = drafts
            positions = [r.num_tokens - 1 + j for r in active]  # each row's input token
            out = self.runner.forward(step, num_layers=self.num_layers, num_computed=positions)
            tokens = out.logits.argmax(dim=-1)  # (len(active),) int64 on the device
            sampled = [i for i, r in enumerate(active) if not r.params.is_greedy]
            if sampled:
                rows = torch.tensor(sampled, device=tokens.device)
                q = sampling_probs_rows(out.logits.index_select(0, rows), [active[i].params for i in sampled])
                u = self.sampler.uniforms(
                    [active[i].sample_seed for i in sampled],
                    [positions[i] + 1 for i in sampled],  # the position the draft is proposed for
                    STREAM_DRAFT,
                    tokens.device,
                )
                tokens = tokens.index_copy(0, rows, draw_from_probs(q.double(), u))
                probs.append(q)
                for k, i in enumerate(sampled):
                    prob_rows.setdefault(active[i].seq_id, []).append(num_prob_rows + k)
                num_prob_rows += len(sampled)
            for r, token in zip(active, tokens.tolist()):
                drafts[r.seq_id].append(token)
        batch.spec_token_ids = drafts
        return DraftProbs(torch.cat(probs), prob_rows) if probs else None

    def execute(
        self,
        batch: ScheduledBatch,
        proposals: dict[int, list[int]],
        target: ModelRunner,
        clock: Callable[[], float],
    ) -> Union[StepResult, PendingStep]:
        """The scheduled batch's step: its drafts filled in where the plan gave it some, run and
        verified by the `target` runner; the draft model's cache synced, what was accepted recorded
        and what the step cost (on `clock`) told to the policy."""
        drafted_s = clock()
        drafts = self.fill(batch, proposals) if batch.num_spec else None
        started_s = clock()
        result = target.execute(batch, drafts=drafts)
        assert isinstance(result, StepResult), "no step runs ahead beside a drafter"
        if self.config.method == "draft":  # the draft model computes KV for every token the target did
            self.runner.forward(batch)
        self._record(result)
        self._observe(batch, clock() - started_s, started_s - drafted_s)
        return result

    def _record(self, result: StepResult) -> None:
        """Each drafted request's acceptance (its metrics and the rate the policy reads)."""
        batch = result.batch
        by_seq = {r.seq_id: r for r in batch.requests} if batch.spec_token_ids else {}
        for seq, drafts in batch.spec_token_ids.items():
            tokens = result.tokens.get(seq)
            if drafts and tokens is not None:
                record_acceptance(by_seq[seq], len(drafts), len(tokens) - 1)
                self.num_proposed += len(drafts)
                self.num_accepted += len(tokens) - 1

    def _observe(self, batch: ScheduledBatch, step_s: float, draft_s: float) -> None:
        """Tell the policy what a step cost on this device: the target's step (`step_s`) and, where
        draft passes ran, their time (`draft_s`)."""
        num_drafts = sum(batch.num_spec.values())
        self.policy.observe(batch.num_tokens, len(batch.requests), num_drafts, step_s)
        if batch.num_spec and self.config.method != "ngram":
            self.policy.observe_draft(len(batch.num_spec), max(batch.num_spec.values()), draft_s)

    def stats(self) -> dict[str, Any]:
        """EngineStats' speculation fields."""
        policy = self.policy
        return dict(
            num_spec_proposed=self.num_proposed,
            num_spec_accepted=self.num_accepted,
            num_spec_steps=policy.num_steps_on,
            num_spec_switches=policy.num_switches,
            num_spec_probes=policy.num_probes,
            spec_step_s=policy.cost.learned(),
        )


def load_draft_model(
    spec: SpeculativeConfig, tokenizer: Any, kernels: KernelSet, cache_dir: Optional[str]
) -> tuple[DecoderLM, str]:
    """(the draft model, its resolved path), on the target's device and dtype, running the target's
    kernel set bound for its own KV cache (always the model dtype); it must share the target's
    tokenizer."""
    assert spec.draft_model is not None  # SpeculativeConfig requires it for method=draft
    dtype, device = kernels.dtype, kernels.target.device
    loaded = load_model(spec.draft_model, dtype=dtype, cache_dir=cache_dir)
    if len(loaded.tokenizer) != len(tokenizer) or loaded.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"engine.speculative.draft_model {spec.draft_model!r} has a different tokenizer "
            "from the target model; a draft must share the target's vocabulary"
        )
    draft_kernels = rebind(kernels, kv_cache_dtype="auto")
    return build_decoder(loaded.config, loaded.state_dict, dtype, device, draft_kernels).eval(), loaded.path


def build_drafter(
    spec: SpeculativeConfig,
    model: DecoderLM,
    runner: ModelRunner,
    sampler: Sampler,
    profile: dict[str, Any],
    draft: Optional[tuple[DecoderLM, str]],
) -> tuple[Drafter, dict[str, Any]]:
    """The drafter of `spec` for the target `model` (run by `runner`), and the settings it adds to
    the engine's: method, k, self layers, adaptive. `draft`: the loaded draft model and its path
    (method "draft"); `profile`: the engine's start-up profile, whose decode speeds price drafting."""
    num_layers = None
    draft_cost = 0.0  # one draft pass, as a fraction of one target step of the same width
    if spec.method == "self":
        # engine/tasks.py refuses it with the config; a target handed to start_engine is not checked there
        assert not isinstance(model, GenericLM), "self-speculation needs the native decoder's first layers"
        total = model.spec.num_layers
        num_layers = min(spec.self_layers or max(1, total // 4), total - 1)
        draft_cost = num_layers / total
    elif spec.method == "draft":
        assert draft is not None
        draft_model = draft[0]
        # Same block ids and slot mapping as the target, so one block table serves both caches.
        runner = runner.for_draft(draft_model.eval())
        # Weights as parameters or as buffers (packed, quantized, a tied head's tiles), each once.
        draft_cost = weight_count(draft_model) / weight_count(model)
    cost = StepCostModel(profile.get("decode_tok_s") or {1: 1.0})
    policy = SpeculationPolicy(spec, cost, draft_cost)
    settings = {
        "method": spec.method,
        "k": spec.num_speculative_tokens,
        "self_layers": num_layers,
        "adaptive": spec.adaptive,
    }
    return Drafter(spec, policy, runner, sampler, num_layers), settings
