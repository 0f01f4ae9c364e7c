"""LoRA adapters applied per token beside the base GEMM (many adapters in one batch).

- `read_adapter`: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) read
  once into host memory (float32), its scale alpha / r (rsLoRA: alpha / sqrt(r)) per module,
  rank_pattern / alpha_pattern honoured. The modules are those whose pairs the weights file holds
  (what target_modules, a list, "all-linear" or a regex, matched when PEFT made it). What this
  runtime cannot apply exactly is refused (LoraError): biases, DoRA, modules_to_save,
  fan_in_fan_out (Conv1D targets), embedding targets, variants with another forward (QALoRA,
  aLoRA, Arrow routing, ...).
- `attach_lora`: checks every adapter against the model first (the first mismatch named), then
  wraps each targeted linear once with `LoraLinear`: y = base(x) + delta, the base module kept as
  it is (nn.Linear, packed or quantized), so the base GEMM runs once for all rows. The native
  DecoderLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` at load: PEFT's q_proj,
  k_proj, v_proj (gate_proj, up_proj) are row slices of the fused output. Any other model (the
  generic path over HF's own modules) is wrapped by the module names PEFT uses. Refused: embedding
  and LM head targets, mixture-of-experts layers, tensor-parallel models. A LoraLinear is not an
  nn.Linear, so the kernels that would read a projection's weight themselves (the fused Triton
  GEMMs of kernels/fused_projections.py, layer 0's embedding + norm) call the module instead, and
  it takes no pre-quantized rows (no `input_quant`): its base quantizes its own input. An MLP whose
  gate/up projection applies the activation itself (MLP.fused_act) is unfused, bitwise the same.
- `LoraSlots`: `max_loras` resident slots. Per wrapped linear, slot s holds its adapter's A
  (r_total, in) and B (out, r_total) (scale folded into B, q/k/v pieces stacked along r, zero
  padded to the largest adapter), float32 on the model's device (a bf16 model computes with a
  bf16 copy). `set_step` looks at the step's adapter tokens once per forward, for every layer:
  where they come in few long contiguous ranges of one slot (a prefill chunk, a step of one
  adapter), each LoraLinear adds y[range] += (x[range] @ A_s^T) @ B_s^T in place (addmm, no gather
  or scatter); else (a decode step, its rows spread over adapters) it groups them by slot (one
  index tensor sorted by slot, each slot's run in it), gathers those rows once, computes the
  runs' updates (two batched matmuls over all runs padded to one length where that pads little)
  and adds them back with one index_add. Where the kernel set binds a native kernel for that case
  (KernelSet.lora_rows: csrc/lora.cpp on the CPU, where the native kernels are built and on), it
  is one call per linear instead, adding every token's update into y in place (float32 weights,
  x and y float32 or bf16, accumulated in float32); the torch path stays the reference and the
  fallback. A step without adapter tokens runs the base modules alone.

Adapters are read from disk once (`read_adapter`) and their weights kept on the host; a slot load
copies them to the device (so a reload after eviction never touches the disk).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from batchrun.kernels.cpu_native import on_host
from batchrun.model.loader import file_sha256

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
_REFUSED_NAMES = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")
# adapter_config.json keys of LoRA variants whose forward is not y + B @ A @ x at every token (or
# that change the base model's structure or embeddings): refused when set
_VARIANT_KEYS = (
    "use_qalora",
    "alora_invocation_tokens",
    "layer_replication",
    "trainable_token_indices",
    "arrow_config",
    "kasa_config",
    "use_bdlora",
)


class LoraError(ValueError):
    """An adapter that cannot be read or does not fit the model: `model.lora_adapters.<name>: <problem>`."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"model.lora_adapters.{name}: {problem}")
        self.adapter = name
        self.problem = problem


@dataclass(frozen=True)
class LoraModuleWeights:
    """One targeted module's low-rank pair, as PEFT names the module (path after `base_model.model.`)."""

    lora_a: torch.Tensor  # (r, in_features) float32, host memory
    lora_b: torch.Tensor  # (out_features, r) float32, host memory, not yet scaled
    scale: float  # alpha / r, or alpha / sqrt(r) for rsLoRA

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter read into host memory."""

    name: str
    directory: str
    rank: int  # the config's r (rank_pattern may give modules others)
    alpha: float
    use_rslora: bool
    target_modules: Any  # as the config says: a list of names, "all-linear" or a regex string
    modules: dict[str, LoraModuleWeights] = field(repr=False)  # PEFT module path -> its pair
    fingerprint: str = ""  # sha256 over the config's and the weights' sha256

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def _pattern_value(patterns: dict[str, Any], path: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the path."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return patterns[key]
    return default


def read_adapter(name: str, directory: str) -> LoraAdapter:
    """The adapter in `directory` (`~` expanded, as a model path is), read and checked (LoraError
    naming `name` and the problem)."""
    directory = os.path.expanduser(directory)
    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isdir(directory):
        raise LoraError(name, f"{directory!r} is not a directory")
    if not os.path.isfile(config_path):
        raise LoraError(name, f"{directory!r} has no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
            raise LoraError(
                name, "adapter_model.bin (pickle) is not read; save the adapter with safe_serialization (safetensors)"
            )
        raise LoraError(name, f"{directory!r} has no {WEIGHTS_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoraError(name, f"{CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(name, f"{CONFIG_FILE} is not a JSON object")

    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraError(name, f"peft_type {peft_type!r} is not supported (LORA only)")
    if config.get("bias", "none") != "none":
        raise LoraError(name, f"bias={config.get('bias')!r} is not supported (bias 'none' only)")
    if config.get("lora_bias"):
        raise LoraError(name, "lora_bias=true is not supported")
    if config.get("use_dora"):
        raise LoraError(name, "use_dora=true (DoRA) is not supported")
    if config.get("modules_to_save"):
        raise LoraError(name, f"modules_to_save={config.get('modules_to_save')!r} is not supported")
    if config.get("fan_in_fan_out"):
        raise LoraError(name, "fan_in_fan_out=true (Conv1D targets) is not supported; nn.Linear targets only")
    if config.get("target_parameters"):
        raise LoraError(name, "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not supported")
    for key in _VARIANT_KEYS:
        if config.get(key):
            raise LoraError(name, f"{key}={config[key]!r} is not supported (plain LoRA only)")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", 8))  # PEFT's default
    except (KeyError, TypeError, ValueError) as exc:
        raise LoraError(name, f"{CONFIG_FILE} lacks a valid r / lora_alpha ({exc})") from exc
    if rank <= 0:
        raise LoraError(name, f"r must be positive, got {rank}")
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}

    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_path)
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise LoraError(name, f"{WEIGHTS_FILE} cannot be read: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise LoraError(name, f"{key}: DoRA magnitudes are not supported")
        if "lora_embedding" in key:
            raise LoraError(name, f"{key}: embedding targets are not supported")
        m = re.fullmatch(rf"(?:{re.escape(_PEFT_PREFIX)})?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoraError(name, f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA A/B weight")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise LoraError(name, f"{WEIGHTS_FILE} holds no LoRA weights")

    modules: dict[str, LoraModuleWeights] = {}
    for path, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(name, f"{path}: lora_A and lora_B must both be present")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2:
            raise LoraError(name, f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not matrices")
        try:
            r = int(_pattern_value(rank_pattern, path, rank))
            module_alpha = float(_pattern_value(alpha_pattern, path, alpha))
        except (re.error, TypeError, ValueError) as exc:
            raise LoraError(name, f"rank_pattern / alpha_pattern cannot be applied to {path}: {exc}") from exc
        if a.shape[0] != r or b.shape[1] != r:
            raise LoraError(
                name, f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have the config's rank {r}"
            )
        scale = module_alpha / (math.sqrt(r) if use_rslora else r)
        modules[path] = LoraModuleWeights(a.contiguous(), b.contiguous(), scale)

    digest = hashlib.sha256()
    for path in (config_path, weights_path):
        digest.update(file_sha256(path).encode())
    return LoraAdapter(
        name=name,
        directory=directory,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        target_modules=config.get("target_modules"),
        modules=modules,
        fingerprint=digest.hexdigest(),
    )


@dataclass(frozen=True)
class _Piece:
    """Where one PEFT module's update lands in a wrapped linear: output rows [start, start + rows)."""

    target: str  # the wrapped module's name in the model
    start: int
    rows: int


@dataclass(frozen=True)
class _Padded:
    """A step's slot runs padded to one length, for two batched matmuls over all slots at once
    (taken where the padding is small: a decode step's rows spread over several adapters)."""

    rows: torch.Tensor  # (num_slots * length,) token indices, each run padded with its first row's
    valid: Optional[torch.Tensor]  # (num_rows,) positions of the real rows in `rows`; None: no padding
    slot_ids: Optional[torch.Tensor]  # (num_slots,) the runs' slots; None: every slot, in order
    length: int


class _StepRows:
    """The step's adapter tokens grouped by slot: `rows` (num_rows,) the token indices, sorted by
    slot (None: every token of the step, all of one slot), and `segments` [(slot, start, end)]
    their runs in that order; `padded` the same runs padded for batched matmuls, or None; `spans`
    [(slot, start, end)] the step's adapter tokens as contiguous token ranges of one slot each,
    where they come in few long ranges (a prefill chunk, a step of one slot), or None: then each
    range's update is added in place, no gather or scatter. Empty segments: every token runs the
    base model. `rows` and `padded` are made on first use (`ensure_rows`): a step the native
    kernel serves never needs them."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.spans: Optional[list[tuple[int, int, int]]] = None
        self.rows: Optional[torch.Tensor] = None
        self.padded: Optional[_Padded] = None
        self.token_slots: Optional[torch.Tensor] = None  # (num_tokens,) int64 on the host, as set_step got it
        self.num_tokens = 0
        # What `ensure_rows` makes `rows` and `padded` from, the first time a layer takes the torch
        # gather path in this step (never, where the native kernel serves every layer): the token
        # order by slot (host), the runs' slots (host), the model's device, the slot count.
        self._grouping: Optional[tuple[torch.Tensor, torch.Tensor, torch.device, int]] = None

    def ensure_rows(self) -> None:
        """Fill `rows` and `padded` for the torch gather path (once per step)."""
        if self.rows is not None or self._grouping is None:
            return
        order, slots, device, num_slots = self._grouping
        self.rows = order.to(device)
        num_rows = int(order.shape[0])
        length = max(end - start for _, start, end in self.segments)
        num_runs = len(self.segments)
        if num_runs > 1 and num_runs * length <= _MAX_PADDING * num_rows:
            padded = torch.empty(num_runs * length, dtype=torch.int64)
            valid = []
            for k, (_, start, end) in enumerate(self.segments):
                padded[k * length : (k + 1) * length] = order[start]
                padded[k * length : k * length + end - start] = order[start:end]
                valid.append(torch.arange(k * length, k * length + end - start))
            all_slots = slots.tolist() == list(range(num_slots))
            self.padded = _Padded(
                rows=padded.to(device),
                valid=None if num_runs * length == num_rows else torch.cat(valid).to(device),
                slot_ids=None if all_slots else slots.to(device),
                length=length,
            )


# Runs padded to one length are batched where that at most adds this share of rows to compute.
_MAX_PADDING = 1.5
# A step's adapter tokens are updated range by range in place (`_StepRows.spans`) where their
# contiguous ranges of one slot hold at least this many tokens on average.
_MIN_SPAN = 8
# Where the native kernel serves, ranges are updated with matmuls in place only up to this many
# (one long prompt's chunk: a large GEMM); more ranges go to the kernel in one call.
_MAX_ADDMM_SPANS = 2


class LoraLinear(nn.Module):
    """y = base(x) + per-slot low-rank updates at the rows `LoraSlots.set_step` gave each slot.

    Where the kernel set binds the native kernel (`lora_rows`), it serves every step but one of at
    most _MAX_ADDMM_SPANS long ranges. Elsewhere a step of long contiguous ranges computes its update
    in y's dtype (a bf16 model's in bf16, from a copy of the weights kept until the next slot load)
    and gathered rows are computed in float32. Either is added to y in place.
    `lora_a` (slots, r_max, in) and `lora_b` (slots, out, r_max) are float32, zero where a slot's
    adapter does not reach."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        num_slots: int,
        max_rank: int,
        lora_rows: Optional[Callable[..., bool]] = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = out_features
        device = _module_device(base)
        # Ordinary tensors even where the model is attached under inference mode: slots are
        # loaded in place later, from wherever the scheduler runs.
        with torch.inference_mode(False):
            lora_a = torch.zeros(num_slots, max_rank, in_features, device=device)
            lora_b = torch.zeros(num_slots, out_features, max_rank, device=device)
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.slot_ranks = [0] * num_slots  # per slot: the rows of lora_a in use (0: no update here)
        # lora_a / lora_b in the activations' dtype where that is not float32 (a bf16 model computes
        # its update in bf16: no conversion of x or of the update per call); dropped on a slot load
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.step = _StepRows()  # replaced by LoraSlots: one object every LoraLinear of a model shares
        # The kernel set's native kernel for gathered rows (KernelSet.lora_rows; host buffers only),
        # over B transposed (slots, r_max, out) and the slot ranks as a host int64 tensor, both made
        # on first use and dropped on a slot load
        self.lora_rows = lora_rows if lora_rows is not None and on_host(self.lora_a) else None
        self._native: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        segments = step.segments
        if not segments:
            return y
        ranks = self.slot_ranks
        if not any(ranks[slot] for slot, _, _ in segments):
            return y  # no adapter of this step reaches this module
        x2 = x.reshape(-1, self.in_features)  # (num_tokens, in_features)
        assert x2.shape[0] == step.num_tokens, f"LoRA step of {step.num_tokens} tokens, the layer sees {x2.shape[0]}"
        y2 = y.reshape(-1, self.out_features)  # (num_tokens, out_features): y's storage where contiguous
        spans = step.spans
        if self.lora_rows is not None and (spans is None or len(spans) > _MAX_ADDMM_SPANS):
            # one native call: every token's update added in place (a prefill of many prompts'
            # ranges too: per-range matmuls cost more in dispatch than the kernel in arithmetic)
            assert step.token_slots is not None
            bt, ranks_t = self._native_weights()
            if self.lora_rows(x2, y2, self.lora_a, bt, step.token_slots, ranks_t):
                return y2.view(y.shape)
        if spans is not None:  # few long ranges of one slot: y[range] += (x[range] @ A^T) @ B^T in place
            a, b = self._weights(y2.dtype)
            if x2.dtype != a.dtype:
                x2 = x2.to(a.dtype)
            for slot, start, end in spans:
                r = ranks[slot]
                if r:
                    y2[start:end].addmm_(x2[start:end] @ a[slot, :r].T, b[slot, :, :r].T)
            return y2.view(y.shape)
        # Gathered rows are computed in float32 (CPU bmm in bf16 takes twice float32's time) and
        # added back in y's dtype.
        a, b = self.lora_a, self.lora_b
        step.ensure_rows()
        rows = step.rows
        assert rows is not None
        padded = step.padded
        if padded is not None:  # one pair of batched matmuls over every slot's run (zero padded ranks add 0)
            xs = x2.index_select(0, padded.rows).float().view(len(segments), padded.length, self.in_features)
            if padded.slot_ids is not None:
                a, b = a.index_select(0, padded.slot_ids), b.index_select(0, padded.slot_ids)
            delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)).view(-1, self.out_features)
            if padded.valid is not None:
                delta = delta.index_select(0, padded.valid)  # (num_rows, out_features)
            y2.index_add_(0, rows, delta.to(y2.dtype))
            return y2.view(y.shape)
        xs = x2.index_select(0, rows).float()  # (num_rows, in_features), by slot
        delta = xs.new_empty(xs.shape[0], self.out_features)
        for slot, start, end in segments:
            r = ranks[slot]
            if r == 0:
                delta[start:end].zero_()
                continue
            low = xs[start:end] @ a[slot, :r].T  # (end - start, r)
            torch.mm(low, b[slot, :, :r].T, out=delta[start:end])
        y2.index_add_(0, rows, delta.to(y2.dtype))
        return y2.view(y.shape)

    def _native_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B transposed (slots, r_max, out) float32 contiguous, slot ranks (slots,) int64) for
        the native kernel, kept until the next slot load."""
        if self._native is None:
            bt = self.lora_b.transpose(1, 2).contiguous()
            self._native = (bt, torch.tensor(self.slot_ranks, dtype=torch.int64))
        return self._native

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_a, lora_b) in `dtype` (float32: the buffers themselves; another: a copy kept until
        the next slot load)."""
        if dtype == self.lora_a.dtype or not dtype.is_floating_point:
            return self.lora_a, self.lora_b
        cast = self._cast.get(dtype)
        if cast is None:
            cast = self._cast[dtype] = (self.lora_a.to(dtype), self.lora_b.to(dtype))
        return cast

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}"
        )


def _module_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


class LoraSlots:
    """`max_loras` resident adapter slots over the model's LoraLinear layers (see the module doc).

    Slots are reused least recently used first; a pinned adapter (running requests hold it) is never
    evicted."""

    def __init__(
        self,
        adapters: dict[str, LoraAdapter],
        max_loras: int,
        layers: dict[str, LoraLinear],
        pieces: dict[str, dict[str, list[tuple[str, _Piece]]]],
        step: _StepRows,
    ) -> None:
        assert max_loras >= 1
        self.adapters = dict(adapters)
        self.max_loras = max_loras
        self.layers = layers  # wrapped module name -> its LoraLinear
        self._pieces = pieces  # adapter -> wrapped module name -> [(PEFT module path, piece)]
        self._step = step
        self._slot_names: list[Optional[str]] = [None] * max_loras
        self._resident: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self.max_rank = max((a.max_rank for a in adapters.values()), default=0)

    def slot_of(self, name: str) -> Optional[int]:
        """The slot `name` is resident in, or None."""
        return self._resident.get(name)

    def can_admit(self, name: str) -> bool:
        """Whether `name` is resident or can be loaded now (a free slot, or one not pinned)."""
        if name in self._resident:
            return True
        return self._free_slot() is not None

    def load(self, name: str) -> int:
        """The slot holding `name`, loading it (evicting the least recently used unpinned adapter)
        where it is not resident; RuntimeError when every slot is pinned."""
        if name not in self.adapters:
            raise KeyError(f"unknown adapter {name!r} (known: {', '.join(sorted(self.adapters))})")
        slot = self._resident.get(name)
        if slot is not None:
            self._resident.move_to_end(name)
            return slot
        slot = self._free_slot()
        if slot is None:
            raise RuntimeError(f"no LoRA slot for {name!r}: all {self.max_loras} are pinned")
        old = self._slot_names[slot]
        if old is not None:
            del self._resident[old]
        self._copy_in(name, slot)
        self._slot_names[slot] = name
        self._resident[name] = slot
        return slot

    def pin(self, name: str) -> int:
        """Keep `name` resident until as many `unpin`s (loading it if needed); its slot."""
        slot = self.load(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        return slot

    def unpin(self, name: str) -> None:
        count = self._pins.get(name, 0)
        assert count > 0, f"adapter {name!r} is not pinned"
        if count == 1:
            del self._pins[name]
        else:
            self._pins[name] = count - 1

    def is_pinned(self, name: str) -> bool:
        return name in self._pins

    def resident(self) -> list[Optional[str]]:
        """Per slot, the adapter it holds (None: empty)."""
        return list(self._slot_names)

    def set_step(self, token_slots: torch.Tensor) -> None:
        """This forward's slot per token (T,) int64, -1 for the base model: the grouping every
        LoraLinear of the model reads, on the model's device (computed here once). A host
        tensor is best: the grouping runs on the host (a device tensor is copied, one sync). The
        step's slots count as used (LRU). Lasts until the next set_step or clear_step."""
        assert token_slots.dim() == 1, "token_slots is (num_tokens,)"
        host = token_slots.to("cpu", torch.int64)
        step = self._step
        step.num_tokens = int(host.shape[0])
        step.segments = []
        step.spans = None
        step.rows = None
        step.padded = None
        step._grouping = None
        step.token_slots = host.contiguous()
        is_lora = host >= 0
        num_rows = int(is_lora.sum())
        if num_rows == 0:
            return
        order = torch.sort(host, stable=True).indices[step.num_tokens - num_rows :]  # base tokens (-1) first
        slots, counts = torch.unique_consecutive(host[order], return_counts=True)
        start = 0
        for slot, count in zip(slots.tolist(), counts.tolist()):
            name = self._slot_names[slot] if slot < self.max_loras else None
            assert name is not None, f"LoRA slot {slot} holds no adapter"
            self._resident.move_to_end(name)
            step.segments.append((slot, start, start + count))
            start += count
        # contiguous ranges of one slot in token order (base tokens break them)
        changes = (torch.nonzero(host[1:] != host[:-1]).flatten() + 1).tolist()
        bounds = [0, *changes, step.num_tokens]
        values = host.tolist()
        spans = [(values[lo], lo, hi) for lo, hi in zip(bounds, bounds[1:]) if values[lo] >= 0]
        if len(spans) == 1 or num_rows >= _MIN_SPAN * len(spans):
            step.spans = spans
        step._grouping = (order, slots, self._device(), self.max_loras)

    def clear_step(self) -> None:
        """Back to the base model for every token."""
        self._step.segments = []
        self._step.spans = None
        self._step.rows = None
        self._step.padded = None
        self._step._grouping = None
        self._step.token_slots = None
        self._step.num_tokens = 0

    def _device(self) -> torch.device:
        for layer in self.layers.values():
            return layer.lora_a.device
        return torch.device("cpu")

    def _free_slot(self) -> Optional[int]:
        for slot, held in enumerate(self._slot_names):
            if held is None:
                return slot
        for name, slot in self._resident.items():  # least recently used first
            if name not in self._pins:
                return slot
        return None

    def _copy_in(self, name: str, slot: int) -> None:
        adapter = self.adapters[name]
        targets = self._pieces[name]
        with torch.no_grad():
            for target, layer in self.layers.items():
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
                layer.slot_ranks[slot] = 0
                layer._cast.clear()
                layer._native = None
                col = 0
                for path, piece in targets.get(target, []):
                    weights = adapter.modules[path]
                    r = weights.rank
                    layer.lora_a[slot, col : col + r].copy_(weights.lora_a)
                    b = layer.lora_b[slot, piece.start : piece.start + piece.rows, col : col + r]
                    b.copy_(weights.lora_b * weights.scale)
                    col += r
                layer.slot_ranks[slot] = col


def _is_wrappable(module: nn.Module) -> bool:
    """A linear y = x @ W.T (+ b) with in/out features: nn.Linear, or one of batchrun's packed or
    quantized twins (model/linear.py: PackedWeightLinear)."""
    from batchrun.model.linear import PackedWeightLinear

    return isinstance(module, (nn.Linear, PackedWeightLinear)) and not isinstance(module, LoraLinear)


class _Resolver:
    """PEFT module paths -> (wrapped module name, output rows) in the model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        # An HF model's LM head under whatever name (it runs on the logits rows, not the step's tokens)
        self.heads: set[int] = set()
        for module in self.modules.values():
            get_head = getattr(module, "get_output_embeddings", None)
            head = get_head() if callable(get_head) else None
            if isinstance(head, nn.Module):
                self.heads.add(id(head))

    def find(self, path: str) -> Optional[str]:
        """The model's module name for a PEFT path: the same name, the name without HF's leading
        `model.` (DecoderLM holds the layers at its top), or the one name ending with `.<path>`
        (a wrapper holding the HF model under an attribute)."""
        if path in self.modules:
            return path
        if path.startswith("model.") and path[len("model.") :] in self.modules:
            return path[len("model.") :]
        ends = [n for n in self.modules if n.endswith("." + path)]
        return ends[0] if len(ends) == 1 else None

    def resolve(self, adapter: str, path: str) -> tuple[str, int, Optional[int]]:
        """(wrapped module name, first output row, rows or None for all) or LoraError."""
        leaf = path.rsplit(".", 1)[-1]
        if leaf in _REFUSED_NAMES:
            raise LoraError(adapter, f"{path}: LoRA on embeddings and the LM head is not supported")
        if ".experts." in f".{path}.":
            raise LoraError(adapter, f"{path}: LoRA on mixture-of-experts expert linears is not supported")
        name = self.find(path)
        if name is not None:
            if id(self.modules[name]) in self.heads:
                raise LoraError(adapter, f"{path}: LoRA on embeddings and the LM head is not supported")
            self._check_not_moe(adapter, path, name)
            return name, 0, None
        parent_path, _, _ = path.rpartition(".")
        parent = self.find(parent_path) if parent_path else ""
        if parent is not None and leaf in _QKV + _GATE_UP:
            from batchrun.model.decoder import MLP, Attention

            owner = self.modules[parent]
            prefix = f"{parent}." if parent else ""
            if leaf in _QKV and isinstance(owner, Attention):
                sizes = {"q_proj": (0, owner.q_size), "k_proj": (owner.q_size, owner.kv_size)}
                sizes["v_proj"] = (owner.q_size + owner.kv_size, owner.kv_size)
                start, rows = sizes[leaf]
                return prefix + "qkv_proj", start, rows
            if leaf in _GATE_UP and isinstance(owner, MLP):
                inter = int(_features(owner.gate_up_proj)[1]) // 2
                return prefix + "gate_up_proj", (0 if leaf == "gate_proj" else inter), inter
            self._check_not_moe(adapter, path, parent)
        raise LoraError(adapter, f"{path}: the model has no such module")

    def _check_not_moe(self, adapter: str, path: str, name: str) -> None:
        from batchrun.model.moe import SparseMoeBlock

        parts = name.split(".")
        for i in range(len(parts)):
            if isinstance(self.modules.get(".".join(parts[:i])), SparseMoeBlock):
                raise LoraError(adapter, f"{path}: LoRA on mixture-of-experts layers is not supported")


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear."""
    in_features, out_features = module.in_features, module.out_features
    assert isinstance(in_features, int) and isinstance(out_features, int)
    return in_features, out_features


def attach_lora(model: nn.Module, adapters: dict[str, LoraAdapter], max_loras: int) -> LoraSlots:
    """Check every adapter against `model`, then wrap each targeted linear with a LoraLinear (see
    the module doc). The first mismatch raises LoraError naming the adapter and the module; nothing
    is wrapped then. Call after the model's linears got their backends (model/prepare.py)."""
    from batchrun.model.decoder import MLP

    if max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {max_loras}")
    if getattr(model, "tp", None) is not None and adapters:
        first = next(iter(adapters))
        raise LoraError(first, "LoRA adapters with tensor parallelism are not supported")
    resolver = _Resolver(model)
    kernels = getattr(model, "kernels", None)
    pieces: dict[str, dict[str, list[tuple[str, _Piece]]]] = {}
    ranks: dict[str, int] = {}  # wrapped module -> the largest r_total an adapter puts there
    unfused: dict[str, nn.Module] = {}  # MLP name -> the plain twin of its activation-fused gate/up
    for name, adapter in adapters.items():
        mine: dict[str, list[tuple[str, _Piece]]] = {}
        for path, weights in adapter.modules.items():
            target, start, rows = resolver.resolve(name, path)
            module = resolver.modules[target]
            if not _is_wrappable(module):
                raise LoraError(name, f"{path}: {type(module).__name__} is not a linear layer LoRA can wrap")
            in_features, out_features = _features(module)
            rows = out_features if rows is None else rows
            a, b = weights.lora_a, weights.lora_b
            if a.shape[1] != in_features or b.shape[0] != rows:
                raise LoraError(
                    name,
                    f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the module "
                    f"({in_features} in, {rows} out): expected ({weights.rank}, {in_features}) / "
                    f"({rows}, {weights.rank})",
                )
            parent_name = target.rpartition(".")[0]
            parent = resolver.modules[parent_name]
            if isinstance(parent, MLP) and parent.fused_act and parent_name not in unfused:
                plain = _unfused_gate_up(parent.gate_up_proj, kernels)
                if plain is None:
                    raise LoraError(
                        name,
                        f"{path}: its MLP applies the activation inside the gate/up projection "
                        f"({type(parent.gate_up_proj).__name__}), which has no unfused form here",
                    )
                unfused[parent_name] = plain
            mine.setdefault(target, []).append((path, _Piece(target, start, rows)))
        for target, items in mine.items():
            ranks[target] = max(ranks.get(target, 0), sum(adapter.modules[p].rank for p, _ in items))
        pieces[name] = mine

    # An MLP whose gate/up projection applies silu(gate) * up itself (model/prepare.py sets
    # MLP.fused_act) leaves a gate/up update no place to land, and hands its down projection
    # activations already quantized where W4A8 fuses: it takes the unfused twin over the same
    # weights and applies the activation again (bitwise the fused result: model/linear.py).
    for parent_name, plain in unfused.items():
        mlp = resolver.modules[parent_name]
        assert isinstance(mlp, MLP)
        mlp.gate_up_proj = plain
        mlp.fused_act = False
    step = _StepRows()
    layers: dict[str, LoraLinear] = {}
    for target in sorted(ranks):
        parent_name, _, attr = target.rpartition(".")
        parent = resolver.modules[parent_name]
        base = getattr(parent, attr)
        in_features, out_features = _features(base)
        lora_rows = getattr(kernels, "lora_rows", None)
        layer = LoraLinear(base, in_features, out_features, max_loras, ranks[target], lora_rows)
        layer.step = step
        setattr(parent, attr, layer)
        layers[target] = layer
    return LoraSlots(adapters, max_loras, layers, pieces, step)


def _unfused_gate_up(module: nn.Module, kernels: Any) -> Optional[nn.Module]:
    """The gate/up projection `module` (one that applies silu(gate) * up itself) without the
    activation, over the same weights; None for a kind this does not know."""
    from batchrun.kernels import cpu_linear as ck
    from batchrun.model.linear import (
        NativeLinear,
        NativeSiluMulLinear,
        RowSplitLinear,
        SiluMulAfter,
        UnpackedTilesLinear,
    )
    from batchrun.model.quant.layers import W4A8Linear, W4A8SiluMulLinear
    from batchrun.model.quant.weights import QuantizedWeight

    if isinstance(module, NativeSiluMulLinear):
        return NativeLinear(ck.pack_native_weight(module.weight()), module.plain_bias())
    if isinstance(module, RowSplitLinear) and isinstance(module.small, NativeSiluMulLinear):
        small = _unfused_gate_up(module.small, kernels)
        assert isinstance(small, NativeLinear)
        large: nn.Module
        if isinstance(module.large, SiluMulAfter):
            large = module.large.linear
        elif isinstance(module.large, UnpackedTilesLinear):
            large = UnpackedTilesLinear(small, module.large.buffer)
        else:
            return None
        return RowSplitLinear(small, large, module.split_rows)
    if isinstance(module, W4A8SiluMulLinear):
        qweight, scales, mins = module.int4_weight()  # HF's row order
        weight = QuantizedWeight("int4", qweight, scales, mins, module.in_features)
        bias = None if module.bias is None else module.bias[module._plain_order]
        return W4A8Linear(weight, bias, torch.bfloat16, kernels=kernels)
    return None
