"""The quantized linear and embedding layers (one per weight format), and `make_linear`, which
picks one for a QuantizedWeight. All are PackedWeightLinear (model/linear.py): a layer whose kernel
reads side copies of its buffers says so in `_refresh`.

Each layer takes its format's kernel from the kernel set it is built with (kernels/kernel_set.py:
KernelSet.linear_*; default: the set bound for the weight's device and the compute dtype), and
that kernel decides the layout the weight is held in: torch's packed int4 or the native W8A8/W4A8
tiles where a CPU kernel set packs for them and the shape fits, the canonical layout otherwise (the
Triton kernels' and the references'). `use_kernels` hands a layer its format's kernel again from a
set bound later (the tuned one start-up binds); nothing here asks which device a call runs on.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from batchrun.kernels import elementwise as ew
from batchrun.kernels import quant as qk
from batchrun.kernels.binding import default_kernels
from batchrun.kernels.cpu_linear import pack_native_weight, silu_pair_order, unpack_native_weight
from batchrun.kernels.cpu_native import on_host
from batchrun.kernels.kernel_set import KernelSet, LinearKernel
from batchrun.kernels.quant import w4a8 as w4
from batchrun.kernels.quant.act import INT_MM_MIN_ROWS, ActQuant, QuantizedRows
from batchrun.kernels.quant.linears import INT4_GROUP_SIZES
from batchrun.model.linear import PackedWeightLinear
from batchrun.model.quant.weights import QuantizedWeight

_FP8_ROWS = ActQuant(torch.float8_e4m3fn)  # Fp8Linear's input: e4m3 codes per token, no padding rows


def _kernels(weight: QuantizedWeight, compute_dtype: Optional[torch.dtype], kernels: Optional[KernelSet]) -> KernelSet:
    """`kernels`, or the set bound for the weight's device and the compute dtype (float32 without one)."""
    return kernels if kernels is not None else default_kernels(weight.qweight.device, compute_dtype or torch.float32)


class QuantLinear(PackedWeightLinear):
    """Base of the quantized linears: y = x @ W.T (+ bias) in x's dtype; W is held quantized."""

    bias: Optional[torch.Tensor]
    kernel: LinearKernel  # the format's kernel in the layer's kernel set

    def __init__(self, in_features: int, out_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        """This layer's format's kernel in `kernels`."""
        raise NotImplementedError

    def use_kernels(self, kernels: KernelSet) -> None:
        """Take this format's kernel from `kernels` (a set bound for the same target and options as
        the one the layer was built with, so the layout it holds is the kernel's)."""
        self.kernel = self.kernel_of(kernels)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """W8A16: int8 weights (per channel, or in groups for GGUF Q8_0), activations in the model dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor
    dense: Optional[torch.Tensor]

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: Optional[torch.dtype] = None,
        *,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        assert weight.format == "int8"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.kernel = self.kernel_of(_kernels(weight, compute_dtype, kernels))
        # From kernel.dense_min_rows rows, cuBLAS over the weight dequantized once (GPU kernel sets
        # bound with that option); else no copy.
        dense = None
        if self.kernel.dense_min_rows is not None and compute_dtype is not None:
            dense = weight.dequantize(compute_dtype)  # (N, K)
        self.register_buffer("dense", dense, persistent=False)
        self.register_buffer("qweight", weight.qweight)  # (N, K) int8
        self.register_buffer("scales", weight.scales)  # (N, num_groups) float32
        self.is_per_channel = weight.scales.shape[1] == 1
        self.format_key = "int8" if self.is_per_channel else f"int8/g{weight.group_size}"
        # torch's packed CPU kernel takes its per-channel scales in bf16.
        self._scales_bf16 = weight.scales[:, 0].to(torch.bfloat16) if self.is_per_channel else None

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        return kernels.linear_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        dense_min_rows = self.kernel.dense_min_rows
        if self.dense is not None and dense_min_rows is not None and x2.shape[0] >= dense_min_rows:
            y = torch.nn.functional.linear(x2, self.dense, self.bias)  # a prefill chunk: cuBLAS over the copy
        else:
            y = self.kernel.matmul(x2, self.qweight, self.scales, self.bias, self._scales_bf16)
        return y.reshape(*shape[:-1], self.out_features)


class W8A8Linear(QuantLinear):
    """int8 weights per channel and int8 activations per token, integer GEMM; `outliers`, if given,
    are input channels kept in float (their columns of `weight` are zero).

    Where the kernel set packs for the native kernel (bf16 on a CPU with the kernels on) and it
    takes the shape (kernels/quant/w8a8.py: w8a8_native_supported), the weight is held only in that
    kernel's tiles (and the float channels' weight in bf16 tiles), and every call runs it;
    otherwise the kernel's matmul over the plain weight (torch._int_mm and the epilogue, or the
    GPU's quantize + _int_mm + epilogue kernels)."""

    scales: torch.Tensor
    qweight: torch.Tensor
    packed_qweight: torch.Tensor
    packed_outlier_weight: Optional[torch.Tensor]
    outlier_index: torch.Tensor
    outlier_skip: torch.Tensor
    outlier_weight_t: torch.Tensor

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor] = None,
        outliers: Optional[qk.OutlierChannels] = None,
        compute_dtype: Optional[torch.dtype] = None,
        *,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        assert weight.format == "int8" and weight.scales.shape[1] == 1, "W8A8 needs per-channel int8"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.kernel = self.kernel_of(_kernels(weight, compute_dtype, kernels))
        num_float = 0 if outliers is None else outliers.index.numel()
        self.is_native = self.kernel.packed_matmul is not None and qk.w8a8_native_supported(
            weight.out_features, weight.in_features, num_float
        )
        self.register_buffer("scales", weight.scales)  # (N, 1) float32
        if self.is_native:
            self.register_buffer("packed_qweight", qk.pack_w8a8_weight(weight.qweight))  # (N, K) uint8 tiles
            packed_out = None
            if outliers is not None:  # (N, num_float) bf16 tiles; the (num_float, N) copy is not kept
                packed_out = pack_native_weight(outliers.weight_t.t().to(torch.bfloat16).contiguous())
                outliers = qk.OutlierChannels(
                    outliers.index, outliers.skip, outliers.weight_t.new_empty((0, weight.out_features))
                )
            self.register_buffer("packed_outlier_weight", packed_out)
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K) int8
        self.outliers = outliers
        if outliers is not None:  # buffers, so .to() and the weight-bytes count see them
            self.register_buffer("outlier_index", outliers.index)
            self.register_buffer("outlier_skip", outliers.skip)
            self.register_buffer("outlier_weight_t", outliers.weight_t)
        self.format_key = "w8a8" if outliers is None else f"w8a8/float{num_float}"
        self._refresh()

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        return kernels.linear_w8a8

    def _refresh(self) -> None:
        """Keep `outliers` pointing at the current buffers and, for the native kernel, rebuild the
        float32 copies it reads (per-channel scales, bias) and the check that its buffers are still
        the dtypes it reads (a later .to(dtype/device) may change them: then the reference path)."""
        if self.outliers is not None:
            self.outliers = qk.OutlierChannels(self.outlier_index, self.outlier_skip, self.outlier_weight_t)
        if self.is_native:
            self._scales_f32 = self.scales[:, 0].detach().float().contiguous()
            self._bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
            out = self.packed_outlier_weight
            self._kernel_ok = (
                self.packed_qweight.dtype == torch.uint8
                and on_host(self.packed_qweight, self.scales, out)
                and (out is None or out.dtype == torch.bfloat16)
            )

    def input_quant(self, x: torch.Tensor) -> Optional[ActQuant]:
        """How this layer's kernel quantizes x, for the RMSNorm before it to do in its own pass
        (model/decoder.py: RMSNorm.into); None where the kernel quantizes otherwise."""
        if not self.kernel.takes_quantized_rows:
            return None
        o = self.outliers
        return ActQuant(torch.int8, None if o is None else o.skip, INT_MM_MIN_ROWS)

    def forward(self, x: Union[torch.Tensor, QuantizedRows]) -> torch.Tensor:
        """x, or x already quantized as input_quant says (QuantizedRows: 2 kernels instead of 3)."""
        if self.is_native and not isinstance(x, QuantizedRows):
            if x.dtype == torch.bfloat16 and x.stride(-1) == 1 and self._kernel_ok:
                assert self.kernel.packed_matmul is not None  # set whenever is_native
                return self.kernel.packed_matmul(
                    x, self.packed_qweight, self._scales_f32, self._bias_f32, self.outliers, self.packed_outlier_weight
                )
            return self._reference(x)  # an odd input, or buffers moved since load
        return self.kernel.matmul(x, self.qweight, self.scales, self.bias, self.outliers)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's matmul over the unpacked weights (slow; only when the native kernel cannot run)."""
        outliers = self.outliers
        if outliers is not None:
            assert self.packed_outlier_weight is not None  # packed whenever there are outliers
            weight_t = unpack_native_weight(self.packed_outlier_weight).t().contiguous()
            outliers = qk.OutlierChannels(outliers.index, outliers.skip, weight_t)
        return self.kernel.matmul(x, qk.unpack_w8a8_weight(self.packed_qweight), self.scales, self.bias, outliers)


class Int4Linear(QuantLinear):
    """W4A16 in groups along K. Where the kernel set holds int4 in torch's packed CPU layout (bf16 on
    a CPU) and the group size is one that kernel takes, the weight is held only in that layout;
    otherwise in our canonical layout (the Triton kernel's and the reference's)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    dense: Optional[torch.Tensor]

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: torch.dtype = torch.float32,
        *,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        assert weight.format == "int4" and weight.mins is not None
        super().__init__(weight.in_features, weight.out_features, bias)
        self.kernel = self.kernel_of(_kernels(weight, compute_dtype, kernels))
        self.group_size = weight.group_size
        self.format_key = f"int4/g{self.group_size}"
        self.is_cpu_packed = self.kernel.packed_matmul is not None and self.group_size in INT4_GROUP_SIZES
        dense = None
        if self.kernel.dense_min_rows is not None:  # as Int8Linear's
            dense = weight.dequantize(compute_dtype)  # (N, K)
        self.register_buffer("dense", dense, persistent=False)
        if self.is_cpu_packed:
            assert self.kernel.pack is not None
            packed, scales_zeros = self.kernel.pack(weight.qweight, weight.scales, weight.mins)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", scales_zeros)  # (num_groups, N, 2) bf16
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K // 2) uint8
            self.register_buffer("scales", weight.scales)  # (N, num_groups) float16
            self.register_buffer("mins", weight.mins)  # (N, num_groups) float16

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        return kernels.linear_int4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        dense_min_rows = self.kernel.dense_min_rows
        if self.dense is not None and dense_min_rows is not None and x2.shape[0] >= dense_min_rows:
            y = torch.nn.functional.linear(x2, self.dense, self.bias)  # a prefill chunk: cuBLAS over the copy
        elif self.is_cpu_packed:
            assert self.kernel.packed_matmul is not None
            y = self.kernel.packed_matmul(x2, self.packed, self.group_size, self.scales_zeros, self.bias)
        else:
            y = self.kernel.matmul(x2, self.qweight, self.scales, self.mins, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


class W4A8Linear(QuantLinear):
    """int4 weights in groups of 32 (w = q * scale + min: GGUF's Q4_1 grid) and int8 activations
    quantized in groups of 32 on the fly, an exact integer dot product per group (llama.cpp's
    Q4_1 x Q8_1). Where the kernel set packs for the native kernel (bf16 on a CPU with AVX512-VNNI
    and AVX512-BF16 and the kernels on) the weight is held only in its nibble tiles
    (kernels/quant/w4a8.py: w4a8_matmul_native); elsewhere the reference (w4a8_matmul, which
    dequantizes the weight on every call: slow, for checks and float32 models)."""

    packed_qweight: torch.Tensor
    packed_scales: torch.Tensor
    packed_mins: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: Optional[torch.dtype] = None,
        *,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        assert weight.format == "int4" and weight.group_size == w4.W4A8_GROUP, "W4A8 needs int4 in groups of 32"
        assert weight.mins is not None
        super().__init__(weight.in_features, weight.out_features, bias)
        self.kernel = self.kernel_of(_kernels(weight, compute_dtype, kernels))
        self.format_key = f"w4a8/g{w4.W4A8_GROUP}"
        self.is_native = self.kernel.packed_matmul is not None and w4.w4a8_native_supported(
            weight.out_features, weight.in_features
        )
        if self.is_native:
            packed, w_scales, w_mins = w4.pack_w4a8_weight(weight.qweight, weight.scales, weight.mins)
            self.register_buffer("packed_qweight", packed)  # (N, K // 2) uint8 nibble tiles
            self.register_buffer("packed_scales", w_scales)  # (N, K // 32) float32, per tile
            self.register_buffer("packed_mins", w_mins)
        else:
            self.register_buffer("qweight", weight.qweight)  # (N, K // 2) uint8
            self.register_buffer("scales", weight.scales)  # (N, K // 32) float16
            self.register_buffer("mins", weight.mins)
        self._refresh()

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        return kernels.linear_w4a8

    def _refresh(self) -> None:
        """The float32 bias the kernel reads, and whether its buffers are still what it reads."""
        if self.is_native:
            self._bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
            self._kernel_ok = (
                all(
                    on_host(t) and t.is_contiguous()
                    for t in (self.packed_qweight, self.packed_scales, self.packed_mins)
                )
                and self.packed_qweight.dtype == torch.uint8
                and self.packed_scales.dtype == torch.float32
                and self.packed_mins.dtype == torch.float32
            )

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed (N, K // 2), scales, mins (N, K // 32) float16): our canonical int4 layout."""
        if self.is_native:
            return w4.unpack_w4a8_weight(self.packed_qweight, self.packed_scales, self.packed_mins)
        return self.qweight, self.scales, self.mins

    def _native_ok(self, x: torch.Tensor) -> bool:
        return self.is_native and self._kernel_ok and x.dtype == torch.bfloat16 and x.stride(-1) == 1

    def forward(self, x: Union[torch.Tensor, w4.GroupQuantized]) -> torch.Tensor:
        """x: activations, or activations already quantized in groups (W4A8SiluMulLinear's output)."""
        if isinstance(x, w4.GroupQuantized):
            native = self.is_native and self._kernel_ok and x.dtype == torch.bfloat16
        else:
            native = self._native_ok(x)
        if native:
            assert self.kernel.packed_matmul is not None  # set whenever is_native
            return self.kernel.packed_matmul(
                x, self.packed_qweight, self.packed_scales, self.packed_mins, self._bias_f32
            )
        qweight, scales, mins = self.int4_weight()
        return self.kernel.matmul(x, qweight, scales, mins, self.bias)


class W4A8SiluMulLinear(W4A8Linear):
    """A silu MLP's W4A8 gate/up projection that returns silu(gate) * up already quantized in groups
    of 32 for its down projection (kernels/quant/w4a8.py: w4a8_silu_quant_native: one pass, bitwise the
    projection, the activation and the quantization done apart). Its rows are held in silu pair
    order (kernels/cpu_linear.py: silu_pair_order); `int4_weight()` gives the plain order back.
    Where the kernel cannot run (another dtype, a strided input) it returns silu(gate) * up as a
    tensor, from the reference projection, and the down projection quantizes it itself."""

    _plain_order: torch.Tensor

    def __init__(
        self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None, *, kernels: Optional[KernelSet] = None
    ) -> None:
        order = silu_pair_order(weight.out_features // 2)
        assert weight.mins is not None
        permuted = QuantizedWeight(
            "int4", weight.qweight[order], weight.scales[order], weight.mins[order], weight.in_features
        )
        super().__init__(permuted, None if bias is None else bias[order], torch.bfloat16, kernels=kernels)
        assert self.is_native and self.kernel.fused_silu is not None, "W4A8SiluMulLinear needs the native kernel"
        self.register_buffer("_plain_order", torch.argsort(order), persistent=False)

    def int4_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qweight, scales, mins = super().int4_weight()
        o = self._plain_order
        return qweight[o], scales[o], mins[o]

    # Narrower input and wider output than W4A8Linear.forward by design: its output feeds only the
    # down projection, which takes either form.
    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, w4.GroupQuantized]:  # type: ignore[override]
        if self._native_ok(x):
            assert self.kernel.fused_silu is not None
            return self.kernel.fused_silu(x, self.packed_qweight, self.packed_scales, self.packed_mins, self._bias_f32)
        qweight, scales, mins = self.int4_weight()
        bias = None if self.bias is None else self.bias[self._plain_order]
        return ew.act_mul_native(self.kernel.matmul(x, qweight, scales, mins, bias), "silu")


class Fp8Linear(QuantLinear):
    """e4m3 weights per channel. On a GPU with fp8 tensor cores (compute capability 8.9+) W8A8-FP8:
    torch._scaled_mm, its activations quantized per token by one Triton kernel (2 kernels per
    linear: kernels/quant/triton_act.py: fp8_linear), or by the RMSNorm before it (`input_quant`:
    _scaled_mm alone); a dequantizing reference elsewhere. The kernel set's fp8 kernel says which."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: Optional[torch.dtype] = None,
        *,
        kernels: Optional[KernelSet] = None,
    ) -> None:
        assert weight.format == "fp8"
        super().__init__(weight.in_features, weight.out_features, bias)
        self.kernel = self.kernel_of(_kernels(weight, compute_dtype, kernels))
        self.register_buffer("qweight", weight.qweight)  # (N, K) float8_e4m3fn
        self.register_buffer("scales", weight.scales)  # (N, 1) float32
        self.format_key = "fp8"

    def kernel_of(self, kernels: KernelSet) -> LinearKernel:
        return kernels.linear_fp8

    def input_quant(self, x: torch.Tensor) -> Optional[ActQuant]:
        """How this layer's kernel quantizes x, for the RMSNorm before it to do in its own pass
        (model/decoder.py: RMSNorm.into); None where the kernel quantizes otherwise."""
        if self.kernel.takes_quantized_rows and x.dtype in (torch.bfloat16, torch.float16):
            return _FP8_ROWS
        return None

    def forward(self, x: Union[torch.Tensor, QuantizedRows]) -> torch.Tensor:
        """x, or x already quantized as input_quant says (QuantizedRows: torch._scaled_mm alone)."""
        return self.kernel.matmul(x, self.qweight, self.scales, self.bias)


class QuantEmbedding(nn.Module):
    """Token embedding held as int8 (or fp8) rows with a scale per row (per row or per group):
    a lookup dequantizes only the rows it reads."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        assert weight.format in ("int8", "fp8")
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        per_row = weight.scales.shape[1] == 1
        self.format_key = weight.format if per_row else f"{weight.format}/g{weight.group_size}"
        self.register_buffer("qweight", weight.qweight)  # (vocab, hidden)
        self.register_buffer("scales", weight.scales)  # (vocab, num_groups) float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[input_ids].float()  # (num_tokens, hidden)
        s = self.scales[input_ids]  # (num_tokens, num_groups)
        return (q.reshape(*s.shape, -1) * s[..., None]).reshape(q.shape).to(self.dtype)


def make_linear(
    weight: QuantizedWeight,
    mode: str,
    bias: Optional[torch.Tensor],
    compute_dtype: torch.dtype,
    outliers: Optional[qk.OutlierChannels] = None,
    *,
    kernels: Optional[KernelSet] = None,
) -> QuantLinear:
    """The layer of `mode` (engine.quantization) for `weight`, over `kernels`' kernel for its format
    (None: the set bound for the weight's device and `compute_dtype`)."""
    kernels = _kernels(weight, compute_dtype, kernels)
    if weight.format == "int4":
        if mode == "w4a8" and weight.group_size == w4.W4A8_GROUP:
            return W4A8Linear(weight, bias, compute_dtype, kernels=kernels)
        return Int4Linear(weight, bias, compute_dtype, kernels=kernels)
    if weight.format == "fp8":
        return Fp8Linear(weight, bias, compute_dtype, kernels=kernels)
    if mode == "w8a8" and weight.scales.shape[1] == 1:
        return W8A8Linear(weight, bias, outliers, compute_dtype, kernels=kernels)
    return Int8Linear(weight, bias, compute_dtype, kernels=kernels)
