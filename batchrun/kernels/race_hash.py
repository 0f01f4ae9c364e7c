"""The constants of the Gumbel race's counter hash and exponential variates (kernels/sampling.py
documents the draw), shared by the torch implementation and the Triton kernel."""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF
MIX_A = 0x7FEB352D  # both multipliers < 2**31: an int64 product of a 32-bit word never overflows
MIX_B = 0x5BD1E995
C_SEED = 0x85EBCA6B
C_POS = 0x27D4EB2F
C_TOKEN = 0x165667B1
THIRD = float(np.float32(1.0 / 3.0))  # the float32 constant both implementations multiply by
SMALL_U = 2.0**-7  # below it E comes from the series, above it from -log(1 - u)
