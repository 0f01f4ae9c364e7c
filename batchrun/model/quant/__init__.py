"""Quantized weights for the decoder, one module per concern (see docs/quantization.md):

- weights: `QuantizedWeight`, one matrix in a format of kernels/quant/formats.py;
- layers: the quantized linear and embedding layers and `make_linear`;
- smoothquant: W8A8's calibration (input ranges, SmoothQuant, the channels kept in float);
- surgery: quantizing a loaded decoder's projections and embeddings (`ProjectionQuantizer`).

Which layer each projection gets, and the MLP fusion, is decided by model/prepare.py: prepare_linears.
"""

from batchrun.kernels.quant.linears import CPU_INT8PACK_MAX_ROWS, INT4_GROUP_SIZES
from batchrun.model.quant.layers import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    QuantLinear,
    W4A8Linear,
    W4A8SiluMulLinear,
    W8A8Linear,
    make_linear,
)
from batchrun.model.quant.smoothquant import (
    PROJECTION_NAMES,
    calibration_token_ids,
    collect_input_absmax,
    projections,
    smooth_activations,
    split_outlier_channels,
)
from batchrun.model.quant.surgery import FUSED_PROJECTIONS, QUANT_MODES, ProjectionQuantizer, QuantizationSummary
from batchrun.model.quant.weights import QuantizedWeight, effective_group_size, quantize_weight, to_device

__all__ = [
    "CPU_INT8PACK_MAX_ROWS",
    "INT4_GROUP_SIZES",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantEmbedding",
    "QuantLinear",
    "W4A8Linear",
    "W4A8SiluMulLinear",
    "W8A8Linear",
    "make_linear",
    "PROJECTION_NAMES",
    "calibration_token_ids",
    "collect_input_absmax",
    "projections",
    "smooth_activations",
    "split_outlier_channels",
    "FUSED_PROJECTIONS",
    "QUANT_MODES",
    "ProjectionQuantizer",
    "QuantizationSummary",
    "QuantizedWeight",
    "effective_group_size",
    "quantize_weight",
    "to_device",
]
