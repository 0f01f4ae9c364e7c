"""The model side of the pooling path (engine.task embed/score): load the backbone and its head,
and turn packed rows of token ids into one float32 vector per row.

Two backbones. A decoder family (model/decoder.py: DecoderLM, loaded, prepared and tuned by
engine/startup.py as for generation) runs every row as a prefill from position 0 over a scratch
paged KV cache: contiguous blocks per row, grown to the largest forward within the token budget
(a longer row runs alone, and its blocks are dropped after its forward; nothing is kept between
forwards, so there is no prefix cache to evict). An encoder family
(model/encoder.py: BERT) runs its rows bidirectionally over packed varlen attention. Heads:
sentence-transformers pooling (model/sentence.py: pool, then Dense and Normalize), or a
*ForSequenceClassification head (decoders: `score` at the rightmost token that is not
pad_token_id, exactly as transformers picks it; BERT: its pooler and classifier).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.config import EngineConfig, EngineConfigError
from batchrun.engine.startup import bind, load_target, tune
from batchrun.engine.tasks import ResolvedTask
from batchrun.kernels.attention_metadata import AttentionMetadata
from batchrun.kernels.kernel_set import KernelSet
from batchrun.kernels.kv_layout import new_kv_cache
from batchrun.model.decoder import DecoderLM
from batchrun.model.linear import NativeEmbedding, count_native_linears
from batchrun.model.loader import load_model
from batchrun.model.sentence import SentencePipeline, pool

log = logging.getLogger(__name__)

# (num_tokens,) packed ids, [row lengths] -> (num_rows, dim): the model with its head
RowsForward = Callable[[torch.Tensor, list[int]], torch.Tensor]
DEFAULT_TOKEN_BUDGET = {"cpu": 8192, "cuda": 16384}  # tokens of one forward when max_num_batched_tokens is not set

# (num_tokens, hidden) final hidden states, [row lengths], (num_tokens,) ids -> (num_rows, dim) float32
Head = Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor]


@dataclass
class PoolingModel:
    """A loaded pooling model: `run` maps packed rows to their vectors."""

    model: nn.Module  # the backbone's module (DecoderLM, BertEncoder or BertClassifier): weight bytes, kernels
    forward: RowsForward  # packed rows -> their vectors
    tokenizer: Any  # the model's Hugging Face tokenizer
    hf_config: Any  # its transformers config
    path: str  # where the weights were read from
    fingerprint: str  # the model files' sha256 (LoadedModel.fingerprint: the job's model fingerprint)
    device: torch.device
    dtype: torch.dtype  # the resolved compute dtype
    kernels: Optional[KernelSet]  # the kernel set bound at start-up
    model_type: str  # the family (qwen3, bert, ...)
    labels: Optional[list[str]]  # score: id2label in label order; None for embed
    embedding_dim: Optional[int]  # embed: the vector's length; None for score
    position_limit: int  # the longest row the model's positions allow
    num_packed_linears: int = 0  # bf16 CPU linears packed at load (decoders)
    scratch: Optional[ScratchKV] = None  # a decoder's scratch KV cache; None for an encoder

    @property
    def num_native_linears(self) -> int:
        return count_native_linears(self.model)

    @torch.inference_mode()
    def run(self, rows: list[list[int]]) -> torch.Tensor:
        """(num_rows, dim) float32 vectors of `rows` (token ids each, none empty), packed back to back."""
        assert rows and all(rows), "every row needs at least one token"
        seq_lens = [len(r) for r in rows]
        input_ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=self.device)  # (num_tokens,)
        return self.forward(input_ids, seq_lens).float()  # (num_rows, dim)


class ScratchKV:
    """A paged KV cache for one forward's rows, each a prefill from position 0 in its own
    contiguous blocks; grown to the largest forward within `token_budget` tokens and kept for the
    next. A forward over the budget (one row longer than it) grows it for that forward only: its
    blocks are dropped after it, so the engine never holds a long row's cache for its lifetime."""

    def __init__(
        self, model: DecoderLM, block_size: int, dtype: torch.dtype, device: torch.device, token_budget: int
    ) -> None:
        self.model, self.block_size, self.dtype, self.device = model, block_size, dtype, device
        self.token_budget = token_budget
        self.num_blocks = 0
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of the KV blocks held now."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.caches)

    def release(self) -> None:
        """Drop the blocks (the next forward allocates what it needs)."""
        self.caches, self.num_blocks = [], 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, not only to torch's allocator

    def _reserve(self, num_blocks: int) -> None:
        if num_blocks > self.num_blocks:
            s = self.model.spec
            self.caches = []  # the old blocks go before the new ones come
            shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
            self.caches = [
                (
                    new_kv_cache(*shape, dtype=self.dtype, device=self.device),
                    new_kv_cache(*shape, dtype=self.dtype, device=self.device),
                )
                for _ in range(s.num_layers)
            ]  # per layer (K, V), each (num_blocks, block_size, num_kv_heads, head_dim)
            self.num_blocks = num_blocks

    def forward(self, input_ids: torch.Tensor, seq_lens: list[int], batch_invariant: bool = False) -> torch.Tensor:
        """(num_tokens, hidden) final-normed hidden states of the packed rows."""
        bs = self.block_size
        row_blocks = [-(-n // bs) for n in seq_lens]
        self._reserve(sum(row_blocks))
        first_block = torch.tensor([0, *row_blocks[:-1]], dtype=torch.long).cumsum(0)  # (num_rows,)
        widest = max(row_blocks)
        block_tables = first_block[:, None] + torch.arange(widest)[None, :]  # (num_rows, widest)
        block_tables = torch.where(torch.arange(widest)[None, :] < torch.tensor(row_blocks)[:, None], block_tables, 0)
        lens = torch.tensor(seq_lens, dtype=torch.long)  # (num_rows,)
        starts = torch.cumsum(lens, 0) - lens  # (num_rows,) each row's first token
        positions = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)  # (num_tokens,)
        slot_mapping = torch.repeat_interleave(first_block * bs, lens) + positions  # (num_tokens,)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=[0, *torch.cumsum(lens, 0).tolist()],
            seq_lens=list(seq_lens),
            block_tables=block_tables.to(self.device),
            block_size=bs,
            decode_seq_ids=torch.zeros(0, dtype=torch.long, device=self.device),
            decode_seq_lens=torch.zeros(0, dtype=torch.long, device=self.device),
            prefill_seq_ids=list(range(len(seq_lens))),  # every row is a whole prompt, one token long or more
            batch_invariant=batch_invariant,
        )
        out: torch.Tensor = self.model(input_ids, positions.to(self.device), self.caches, meta)
        if int(lens.sum()) > self.token_budget:
            self.release()  # an oversized row's blocks: not kept for the forwards within the budget
        return out


def _safetensors_tensor(directory: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors `names` (those present) of a model directory's safetensors files, in float32."""
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in names:
                if name in f.keys():
                    found[name] = f.get_tensor(name).float()
    return found


def _labels(hf_config: Any) -> list[str]:
    id2label = getattr(hf_config, "id2label", None) or {}
    num_labels = int(getattr(hf_config, "num_labels", len(id2label)) or len(id2label))
    return [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]


def rightmost_non_pad(input_ids: torch.Tensor, seq_lens: list[int], pad_token_id: Optional[int]) -> torch.Tensor:
    """(num_rows,) packed index of the token each row is scored at: the rightmost one that is not
    `pad_token_id` (its first token where every one is), as transformers' *ForSequenceClassification
    picks it; the last token without a pad id."""
    lens = torch.tensor(seq_lens, dtype=torch.long, device=input_ids.device)  # (num_rows,)
    ends = torch.cumsum(lens, 0)
    if pad_token_id is None:
        return ends - 1
    starts = ends - lens
    row_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=input_ids.device), lens)
    index = torch.arange(input_ids.shape[0], device=input_ids.device)  # (num_tokens,)
    keyed = torch.where(input_ids != pad_token_id, index, starts[row_of_token])  # a pad token counts as the row start
    last = torch.full_like(lens, -1).scatter_reduce(0, row_of_token, keyed, reduce="amax")
    return last


def embed_head(pipeline: Optional[SentencePipeline]) -> Head:
    """sentence-transformers' steps after the transformer (mean pooling without a pipeline)."""
    mode = pipeline.pooling if pipeline is not None else "mean"

    def head(hidden: torch.Tensor, seq_lens: list[int], input_ids: torch.Tensor) -> torch.Tensor:
        pooled = pool(hidden, seq_lens, mode)  # (num_rows, hidden) float32
        return pipeline.project(pooled) if pipeline is not None else pooled

    return head


def _decoder_score_head(weights: dict[str, torch.Tensor], device: torch.device, pad_token_id: Optional[int]) -> Head:
    weight = weights["score.weight"].to(device)  # (num_labels, hidden) float32
    bias = weights["score.bias"].to(device) if "score.bias" in weights else None  # (num_labels,)

    def head(hidden: torch.Tensor, seq_lens: list[int], input_ids: torch.Tensor) -> torch.Tensor:
        rows = hidden.index_select(0, rightmost_non_pad(input_ids, seq_lens, pad_token_id))  # (num_rows, hidden)
        return F.linear(rows.float(), weight, bias)  # (num_rows, num_labels)

    return head


def load_decoder(config: EngineConfig, resolved: ResolvedTask, kernels: KernelSet) -> PoolingModel:
    """A decoder family loaded as generation loads it (dtype, threads, packed linears, tuning),
    with the score head read beside it and no vocab x hidden LM head kept."""
    target = load_target(config, kernels)
    model = target.model
    head_shared = isinstance(model.embed_tokens, NativeEmbedding) or (
        getattr(model.lm_head, "weight", None) is model.embed_tokens.weight
    )
    if not head_shared:  # the LM head is a copy nothing here reads (a classifier checkpoint has none: the embedding)
        model.lm_head = nn.Identity()  # type: ignore[assignment]
    tune(config, target)
    hf_config = target.hf_config
    labels: Optional[list[str]] = None
    dim: Optional[int] = None
    if resolved.task == "score":
        weights = _safetensors_tensor(resolved.path, ("score.weight", "score.bias"))
        if "score.weight" not in weights:
            raise EngineConfigError(
                f"engine.task=score: {resolved.path} declares a classifier but holds no score.weight"
            )
        labels = _labels(hf_config)
        assert weights["score.weight"].shape[0] == len(labels), "score.weight rows must match num_labels"
        head = _decoder_score_head(weights, target.device, getattr(hf_config, "pad_token_id", None))
    else:
        head = embed_head(resolved.pipeline)
        dim = (resolved.pipeline.dense_out if resolved.pipeline else None) or model.spec.hidden_size
    budget = config.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET.get(target.device.type, DEFAULT_TOKEN_BUDGET["cpu"])
    scratch = ScratchKV(model, config.block_size, target.dtype, target.device, budget)

    def forward(input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return head(scratch.forward(input_ids, seq_lens, config.batch_invariant), seq_lens, input_ids)

    return PoolingModel(
        model=model,
        forward=forward,
        tokenizer=target.tokenizer,
        hf_config=hf_config,
        path=target.path,
        fingerprint=target.fingerprint,
        device=target.device,
        dtype=target.dtype,
        kernels=model.kernels,
        model_type=model.spec.model_type,
        labels=labels,
        embedding_dim=dim,
        position_limit=model.spec.max_position_embeddings,
        num_packed_linears=target.quantization.num_packed,
        scratch=scratch,
    )


def load_encoder(config: EngineConfig, resolved: ResolvedTask, kernels: KernelSet) -> PoolingModel:
    """An encoder family (model/encoder.py: build_encoder): a BertEncoder under the pipeline's
    pooling, or a BertClassifier (pooler and classifier on each row's [CLS]) for score."""
    from batchrun.model.encoder import build_encoder

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device, dtype = kernels.target.device, kernels.dtype
    loaded = load_model(config.model, dtype=dtype, cache_dir=config.cache_dir)
    hf_config, is_score = loaded.config, resolved.task == "score"
    attention = kernels.varlen_attention  # the CPU: the torch reference; a GPU: the Triton kernel
    # A bf16 CPU whose kernel set packs float linears: the encoder's projections packed once for
    # oneDNN (GELU fused into the up projection) instead of F.linear reordering every weight per call.
    pack = device.type == "cpu" and dtype == torch.bfloat16 and kernels.linear_float.packing != "none"
    module = build_encoder(
        hf_config, loaded.state_dict, dtype, attention=attention, classifier=is_score, pack_onednn=pack
    )
    module = module.to(device)
    tokenizer, path, fingerprint = loaded.tokenizer, loaded.path, loaded.fingerprint
    del loaded
    head = embed_head(resolved.pipeline)

    def forward(input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        out: torch.Tensor = module(input_ids, None, seq_lens)  # score: (num_rows, num_labels) logits
        return out if is_score else head(out, seq_lens, input_ids)  # embed: (num_tokens, hidden) pooled

    dim = None if is_score else (resolved.pipeline.dense_out if resolved.pipeline else None) or hf_config.hidden_size
    return PoolingModel(
        model=module,
        forward=forward,
        tokenizer=tokenizer,
        hf_config=hf_config,
        path=path,
        fingerprint=fingerprint,
        device=device,
        dtype=dtype,
        kernels=kernels,
        model_type=str(hf_config.model_type),
        labels=_labels(hf_config) if is_score else None,
        embedding_dim=int(dim) if dim is not None else None,
        position_limit=int(hf_config.max_position_embeddings),
    )


def load_pooling_model(config: EngineConfig, resolved: ResolvedTask) -> PoolingModel:
    """Bind the device's kernel set (engine.device, the dtype 'auto' resolves as for generation) and
    load the resolved task's backbone and head over it."""
    assert resolved.is_pooling, resolved.task
    kernels = bind(config)
    return (load_encoder if resolved.is_encoder else load_decoder)(config, resolved, kernels)
