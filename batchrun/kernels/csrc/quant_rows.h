// Per-token int8 quantization of one row, shared by the standalone pass (quant.cpp:
// batchrun_quantize_per_token_int8) and the W8A8 kernel, which quantizes its own input
// (linear.cpp: batchrun_w8a8_linear). Bitwise the torch code of kernels/quant.py:
// quantize_per_token_int8 (same operations, same order, round half to even).
#pragma once

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace batchrun {

// Round to nearest, ties to even, for |v| < 2^22 (here |v| <= 127): adding and subtracting
// 1.5 * 2^23 leaves the rounded value in the default rounding mode. Inlined and vectorized, where
// std::nearbyint is a library call per element.
inline float round_half_even(float v) {
    const float magic = 12582912.0f;  // the flags never include -ffast-math, which would fold this away
    return (v + magic) - magic;
}

template <bool BF16, typename T>
inline float widen(T v) {
    if constexpr (BF16) return bf16_to_f32(v);
    else return v;
}

// Element i of a row as float32; with SKIP, 0 where skip[i] != 0 (like the torch path's
// masked_fill(skip, 0)), selected branch-free so the loops below still vectorize.
template <bool BF16, bool SKIP, typename T>
inline float element(const T* __restrict xr, const uint8_t* __restrict skip, int64_t i) {
    const float v = widen<BF16>(xr[i]);
    if constexpr (SKIP) return skip[i] ? 0.f : v;
    else return v;
}

// Row xr (k values): scale = max(absmax / 127, min_scale), q = round_half_even(x / scale) as int8,
// skipped columns counted and written as 0; the gather_idx columns copied to gathered (W8A8's float
// channels, while the row is in cache). Returns the integer sum of q (W8A8's 128 * sum correction).
template <bool BF16, bool SKIP, typename T>
inline int32_t quantize_row(const T* __restrict xr, int64_t k, const uint8_t* skip, int8_t* __restrict qr,
                            float* scale_out, const int64_t* gather_idx, int64_t n_gather, T* gathered) {
    const float min_scale = 1e-10f;  // kernels/quant.py: MIN_SCALE
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) {
        const float a = std::fabs(element<BF16, SKIP>(xr, skip, i));
        amax = a > amax ? a : amax;
    }
    float scale = amax / 127.0f;
    scale = scale < min_scale ? min_scale : scale;
    *scale_out = scale;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < k; ++i) {
        const int8_t v = static_cast<int8_t>(static_cast<int32_t>(round_half_even(element<BF16, SKIP>(xr, skip, i) / scale)));
        qr[i] = v;
        sum += v;
    }
    for (int64_t j = 0; j < n_gather; ++j) gathered[j] = xr[gather_idx[j]];
    return sum;
}

}  // namespace batchrun
