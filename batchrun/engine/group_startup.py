"""Start-up of a tensor-parallel worker's group (engine.tensor_parallel_size > 1), before any weight
is read: the checks that need the model's config or the machine, the threads each rank gets, the
devices, and the followers started (engine/group.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.engine.config import EngineConfig, EngineConfigError
from batchrun.engine.device import resolve_device
from batchrun.engine.group import Group, start_group
from batchrun.model.decoder import DecoderSpec
from batchrun.model.gguf import GGUF_BLOCK_SIZE
from batchrun.model.loader import model_config
from batchrun.model.quant import effective_group_size
from batchrun.model.tensor_parallel import TensorParallel, head_split_error, size_split_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenGroup:
    """Rank 0's view of a group that has started: its followers load their shards meanwhile."""

    group: Group
    tp: TensorParallel  # what rank 0's model holds
    device: torch.device  # rank 0's
    threads_per_rank: int  # torch intra-op threads of each rank (CPU)


def check_group(config: EngineConfig, hf_config: Any, num_gpus: int, device: torch.device) -> None:
    """EngineConfigError naming engine.tensor_parallel_size where the model's heads or MLP do not
    split in its ranks, where a grouped quantization's groups would straddle two ranks (a rank's
    slice of a row-parallel projection's inputs must be whole groups, so that each rank quantizes
    exactly its slice of one process's weights), or where a GPU group has fewer GPUs than ranks."""
    size = config.tensor_parallel_size
    key = f"engine.tensor_parallel_size={size}"
    spec = DecoderSpec.from_hf(hf_config)
    why = head_split_error(spec.num_heads, spec.num_kv_heads, size) or size_split_error(spec, size)
    if why is not None:
        raise EngineConfigError(
            f"{key} does not fit {spec.model_type} ({spec.num_heads} attention heads, {spec.num_kv_heads} KV heads): "
            f"{why}"
        )
    if config.quantization in ("int8", "int4", "gguf"):
        # gguf: the file's Q8_0/Q4 blocks of 32 where it has them, int8 in quant_group_size elsewhere
        groups = (
            (config.quant_group_size, GGUF_BLOCK_SIZE) if config.quantization == "gguf" else (config.quant_group_size,)
        )
        inputs = {
            "o_proj": spec.num_heads * spec.head_dim,
            "down_proj": spec.intermediate_size,  # the experts' are not quantized, their shared expert's is
            "shared expert's down_proj": spec.shared_expert_intermediate_size,
        }
        for group in groups:
            for name, total in inputs.items():
                # The groups one process quantizes this layer in: quant_group_size, or where that does not
                # divide the inputs, the largest half of it that does (model/quant: effective_group_size).
                # A group size above the inputs' width is not exempt: the whole row is then one group.
                layer_group = effective_group_size(total, group) if total else group
                if total and (total // size) % layer_group:
                    raise EngineConfigError(
                        f"{key} gives each rank {total // size} of {name}'s {total} inputs, not whole groups of "
                        f"{layer_group} (engine.quant_group_size={config.quant_group_size}"
                        f"{', GGUF blocks of 32' if group == GGUF_BLOCK_SIZE else ''}): "
                        f"pick a size whose share of them is whole groups"
                    )
    if device.type == "cuda" and size > num_gpus:
        raise EngineConfigError(f"{key} needs {size} GPUs, but this worker sees {num_gpus} (CUDA_VISIBLE_DEVICES)")


def open_group(config: EngineConfig) -> OpenGroup:
    """Check the group against the model and machine, convert a GGUF file once, split the CPU's
    threads between the ranks and start the followers (ranks 1..N-1)."""
    size = config.tensor_parallel_size
    device = resolve_device(config.device)
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    check_group(config, model_config(config.model, config.cache_dir), num_gpus, device)
    total_threads = config.num_threads or torch.get_num_threads()
    threads = max(1, total_threads // size)
    if device.type == "cpu":
        torch.set_num_threads(threads)
        devices = ["cpu"] * size
    else:
        device = torch.device("cuda", 0)
        devices = [f"cuda:{r}" for r in range(size)]
    group = start_group(size, device, config, threads if device.type == "cpu" else None, devices)
    log.info("tensor-parallel group of %d ranks on %s started (%d threads each)", size, ", ".join(devices), threads)
    return OpenGroup(group, group.tensor_parallel(), device, threads)
