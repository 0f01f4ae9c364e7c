"""LoRA adapters at engine start-up: engine.lora_adapters read and attached to the prepared model.

The adapters wrap the model's linears once their backends are chosen (quantized, packed or plain),
before tuning, the batch-limit profile and the warm-up, which run base-model tokens only. What
start-up made of them is `Adapters`: the slots the scheduler pins and the runner sets per step
(model/lora.py: LoraSlots), each adapter's files' hash (the prefix cache's key and the manifest's),
and what `EngineSettings.lora` records.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from batchrun.engine.config import EngineConfig
from batchrun.model.lora import LoraSlots, attach_lora, read_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapters:
    """engine.lora_adapters, attached."""

    slots: LoraSlots  # resident slots of every wrapped linear; loads, pins, per-step rows
    fingerprints: Mapping[str, str]  # adapter name -> sha256 of its files (adapter_config + weights)
    max_loras: int  # engine.max_loras
    num_slots: int  # slots allocated: max_loras, or fewer where fewer adapters are configured
    max_rank: int  # the largest rank among the adapters' modules (rank_pattern included)

    def settings(self) -> dict[str, Any]:
        """EngineSettings.lora: what a run manifest records of the adapters."""
        return {
            "adapters": dict(self.fingerprints),
            "max_loras": self.max_loras,
            "slots": self.num_slots,
            "max_rank": self.max_rank,
        }


def attach_adapters(config: EngineConfig, model: Any) -> Optional[Adapters]:
    """Read every adapter of engine.lora_adapters and wrap the model's targeted linears; None without
    adapters. An adapter that does not fit the model raises LoraError naming it and the first mismatch."""
    if not config.lora_adapters:
        return None
    adapters = {name: read_adapter(name, directory) for name, directory in config.lora_adapters.items()}
    # A slot holds a copy of an adapter's stacked weights for every wrapped linear: no more of them
    # than there are adapters to hold (the rest would be memory the KV cache never gets).
    num_slots = min(config.max_loras, len(adapters))
    slots = attach_lora(model, adapters, num_slots)
    attached = Adapters(
        slots=slots,
        fingerprints={name: a.fingerprint for name, a in adapters.items()},
        max_loras=config.max_loras,
        num_slots=num_slots,
        max_rank=slots.max_rank,
    )
    log.info(
        "LoRA: %d adapter(s) (%s), %d resident at once, rank <= %d",
        len(adapters),
        ", ".join(sorted(adapters)),
        num_slots,
        attached.max_rank,
    )
    return attached
