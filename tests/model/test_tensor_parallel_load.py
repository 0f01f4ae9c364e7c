"""Loading one rank's slices (model/loader.py with a TPShard; model/tensor_parallel.py: ShardSlicer):
each tensor a rank reads equals that rank's slice of the whole checkpoint, the ranks' slices of a
split tensor put together are the tensor (nothing lost, nothing held twice), the last rank's
vocabulary rows are padded with zeros, and a KV head shared by several ranks is the same on each."""

from __future__ import annotations

import pytest
import torch

from batchrun.model.decoder import DecoderSpec
from batchrun.model.loader import load_model
from batchrun.model.tensor_parallel import ShardSlicer, TPShard, head_split_error, local_vocab_size
from batchrun.testing import make_tiny_model


@pytest.mark.parametrize(
    "family,size,overrides",
    [
        ("llama", 2, {"vocab_size": 515}),  # 515 rows: 258 per rank, the last rank's padded by one
        ("qwen3_moe", 2, {}),  # per-expert tensors (save_pretrained's names) sliced by the expert size
        ("gemma3_text", 2, {}),  # one KV head: both ranks hold it
        ("qwen2", 4, {}),  # 2 KV heads over 4 ranks, q/k/v biases
    ],
)
def test_each_rank_reads_its_slice_and_the_slices_make_the_whole(tmp_path, family, size, overrides):
    model_dir = str(make_tiny_model(tmp_path / family, family, **overrides))
    whole = load_model(model_dir).state_dict
    spec = DecoderSpec.from_hf(load_model(model_dir).config)
    assert head_split_error(spec.num_heads, spec.num_kv_heads, size) is None
    ranks = [load_model(model_dir, tp_shard=TPShard(r, size)).state_dict for r in range(size)]
    split = 0
    for name, tensor in whole.items():
        parts = [rank[name] for rank in ranks]
        for r, part in enumerate(parts):
            assert torch.equal(part, ShardSlicer(spec, TPShard(r, size))(name, tensor)), (name, r)
        if all(p.shape == tensor.shape for p in parts):  # replicated: the same on every rank
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        split += 1
        if ("k_proj" in name or "v_proj" in name) and spec.num_kv_heads < size:
            continue  # KV heads shared by several ranks: checked below
        dim = next(d for d in range(tensor.dim()) if parts[0].shape[d] != tensor.shape[d])
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = local_vocab_size(spec.vocab_size, size)
            assert all(p.shape[0] == rows for p in parts)
            joined = torch.cat(parts)
            assert torch.equal(joined[: spec.vocab_size], tensor)
            assert not joined[spec.vocab_size :].any()  # padding rows: zero logits, cut after the gather
        else:
            assert torch.equal(torch.cat(parts, dim=dim), tensor), name
    assert split > 0
    if spec.num_kv_heads < size:  # each KV head on size / num_kv_heads ranks, in order
        name = next(n for n in whole if n.endswith("k_proj.weight"))
        per = size // spec.num_kv_heads
        heads = [ranks[r][name] for r in range(size)]
        for r in range(size):
            assert torch.equal(heads[r], heads[(r // per) * per])
        assert torch.equal(torch.cat(heads[::per]), whole[name])
