"""Quantized formats and the matmuls over them, one module per concern (see docs/quantization.md):

- formats: the int8, int4 and fp8 weight codecs;
- weight_only: W8A16, W4A16 and fp8-weight matmuls (torch references, torch's packed CPU kernels);
- w8a8: per-token int8 activations, the int32 GEMM and its native kernel;
- w4a8: int8 activations in groups of 32 times int4 weights, and its native kernels;
- kv: the int8/fp8 KV cache;
- triton_gemm: the Triton dequantize-GEMMs for the GPU (imported only where Triton runs);
- triton_act: the GPU's per-token activation quantization and W8A8 epilogue kernels (likewise).

The names of the first five are re-exported here, so `from batchrun.kernels import quant as qk` reaches them.
"""

from batchrun.kernels.quant.formats import (
    FP8_E4M3_MAX,
    INT8_MAX,
    MIN_SCALE,
    activation_scale,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from batchrun.kernels.quant.kv import (
    KV_CACHE_DTYPES,
    QuantizedKVCache,
    dequantize_kv,
    kv_bytes_per_token_head,
    quantize_kv,
)
from batchrun.kernels.quant.w4a8 import (
    W4A8_GROUP,
    GroupQuantized,
    pack_w4a8_weight,
    quantize_groups_int8,
    unpack_w4a8_weight,
    w4a8_matmul,
    w4a8_matmul_native,
    w4a8_native_supported,
    w4a8_silu_quant_native,
)
from batchrun.kernels.quant.w8a8 import (
    OutlierChannels,
    native_rows,
    pack_w8a8_weight,
    quantize_per_token_int8,
    quantize_with_outliers,
    unpack_w8a8_weight,
    w8a8_matmul,
    w8a8_matmul_native,
    w8a8_native_supported,
)
from batchrun.kernels.quant.weight_only import (
    fp8_scaled_matmul,
    fp8_weight_matmul,
    int4_matmul_cpu,
    int4_pack_for_cpu,
    int4_weight_matmul,
    int8_weight_matmul,
    int8_weight_matmul_cpu,
    quantize_per_token_fp8,
)

__all__ = [
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "MIN_SCALE",
    "activation_scale",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "pack_int4",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "unpack_int4",
    "KV_CACHE_DTYPES",
    "QuantizedKVCache",
    "dequantize_kv",
    "kv_bytes_per_token_head",
    "quantize_kv",
    "W4A8_GROUP",
    "GroupQuantized",
    "pack_w4a8_weight",
    "quantize_groups_int8",
    "unpack_w4a8_weight",
    "w4a8_matmul",
    "w4a8_matmul_native",
    "w4a8_native_supported",
    "w4a8_silu_quant_native",
    "OutlierChannels",
    "native_rows",
    "pack_w8a8_weight",
    "quantize_per_token_int8",
    "quantize_with_outliers",
    "unpack_w8a8_weight",
    "w8a8_matmul",
    "w8a8_matmul_native",
    "w8a8_native_supported",
    "fp8_scaled_matmul",
    "fp8_weight_matmul",
    "int4_matmul_cpu",
    "int4_pack_for_cpu",
    "int4_weight_matmul",
    "int8_weight_matmul",
    "int8_weight_matmul_cpu",
    "quantize_per_token_fp8",
]
