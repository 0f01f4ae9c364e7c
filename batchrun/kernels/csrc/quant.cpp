// The elementwise work around W8A8's int8 GEMM (kernels/quant.py: w8a8_matmul), one pass each, and
// W4A8's activation quantization in groups (quantize_groups_int8).
//
// In torch, the per-token activation quantization before the GEMM and the int32 -> float epilogue
// after it take about six full passes over small tensors, and on a small CPU those cost as much
// as the int8 GEMM saves over bf16.
// Both functions reproduce the torch code's arithmetic exactly (same operations, same order, round
// half to even), so the outputs are bitwise equal to the torch path's (tested).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "quant_rows.h"
#include "vec_math.h"

namespace {

using batchrun::bf16_to_f32;
using batchrun::f32_to_bf16;
using batchrun::round_half_even;

template <bool BF16, bool SKIP, typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* skip, int8_t* q, float* scales,
                   const int64_t* gather_idx, int64_t n_gather, T* gathered, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; ++r)
        batchrun::quantize_row<BF16, SKIP>(x + r * x_stride, k, skip, q + r * k, scales + r, gather_idx, n_gather,
                                           gathered + r * n_gather);
}

}  // namespace

extern "C" {

// x: (m, k) float32 or bf16, rows `x_stride` elements apart. Per row: scale = max(absmax / 127,
// min_scale); q = round_half_even(x / scale) as int8 (|x / scale| <= 127 by construction).
// skip: (k,) uint8 or null: columns that are left out (W8A8's outlier channels, which run in float):
// they count as 0 for the scale and are written as 0. q: (m, k) int8 contiguous; scales: (m,) float32.
// gather_idx: (n_gather,) int64 column indices or null; gathered: (m, n_gather) in x's dtype,
// contiguous: x[:, gather_idx] (W8A8's float channels, for their float product).
int batchrun_quantize_per_token_int8(const void* x, int x_bf16, int64_t m, int64_t k, int64_t x_stride,
                                     const void* skip, void* q, void* scales, const void* gather_idx, int64_t n_gather,
                                     void* gathered, int num_threads) {
    const uint8_t* sk = static_cast<const uint8_t*>(skip);
    int8_t* qi = static_cast<int8_t*>(q);
    float* sc = static_cast<float*>(scales);
    const int64_t* gi = static_cast<const int64_t*>(gather_idx);
    if (!gi) n_gather = 0;
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    const float* xf = static_cast<const float*>(x);
    uint16_t* gb = static_cast<uint16_t*>(gathered);
    float* gf = static_cast<float*>(gathered);
    if (x_bf16 && sk) quantize_rows<true, true>(xb, m, k, x_stride, sk, qi, sc, gi, n_gather, gb, num_threads);
    else if (x_bf16) quantize_rows<true, false>(xb, m, k, x_stride, sk, qi, sc, gi, n_gather, gb, num_threads);
    else if (sk) quantize_rows<false, true>(xf, m, k, x_stride, sk, qi, sc, gi, n_gather, gf, num_threads);
    else quantize_rows<false, false>(xf, m, k, x_stride, sk, qi, sc, gi, n_gather, gf, num_threads);
    return 0;
}

// y = ((float(acc) * w_scales[n]) * x_scales[m]) rounded to y's dtype, then + bias[n] in y's dtype.
// acc: (m, n) int32 contiguous; w_scales: (n,) float32; x_scales: (m,) float32; bias: (n,) in y's
// dtype or null; y: (m, n) float32 or bf16 (y_bf16).
int batchrun_w8a8_epilogue(const void* acc, int64_t m, int64_t n, const void* w_scales, const void* x_scales,
                           const void* bias, void* y, int y_bf16, int num_threads) {
    const int32_t* a = static_cast<const int32_t*>(acc);
    const float* ws = static_cast<const float*>(w_scales);
    const float* xs = static_cast<const float*>(x_scales);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * n > 32768)
    for (int64_t r = 0; r < m; ++r) {
        const float sx = xs[r];
        const int32_t* ar = a + r * n;
        if (y_bf16) {
            uint16_t* yr = static_cast<uint16_t*>(y) + r * n;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = f32_to_bf16((static_cast<float>(ar[c]) * ws[c]) * sx);
            if (bias) {
                const uint16_t* b = static_cast<const uint16_t*>(bias);
                for (int64_t c = 0; c < n; ++c) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + bf16_to_f32(b[c]));
            }
        } else {
            float* yr = static_cast<float*>(y) + r * n;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) yr[c] = (static_cast<float>(ar[c]) * ws[c]) * sx;
            if (bias) {
                const float* b = static_cast<const float*>(bias);
                for (int64_t c = 0; c < n; ++c) yr[c] += b[c];
            }
        }
    }
    return 0;
}

// x: (m, k) float32 or bf16, rows `x_stride` elements apart, quantized in groups of `group`
// consecutive columns (k a multiple of it): per group, scale = max(absmax / 127, min_scale) and
// q = round_half_even(x / scale) as int8. q: (m, k) int8 contiguous; scales and sums: (m, k / group)
// float32 contiguous, sums = scale * (the group's integer sum of q) (W4A8's min term).
int batchrun_quantize_groups_int8(const void* x, int x_bf16, int64_t m, int64_t k, int64_t x_stride, int64_t group,
                                  void* q, void* scales, void* sums, int num_threads) {
    if (group <= 0 || group > 512 || k % group != 0) return -2;
    const float min_scale = 1e-10f;  // kernels/quant.py: MIN_SCALE
    const int64_t groups = k / group;
#if defined(__AVX512F__)
    if (group == 32) {  // W4A8's group: two vectors, the same arithmetic (div, round half to even)
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k > 65536)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t g = 0; g < groups; ++g) {
                __m512 a, b;
                if (x_bf16) {
                    const uint16_t* xr = static_cast<const uint16_t*>(x) + r * x_stride + g * 32;
                    a = batchrun::load_bf16x16(xr);
                    b = batchrun::load_bf16x16(xr + 16);
                } else {
                    const float* xr = static_cast<const float*>(x) + r * x_stride + g * 32;
                    a = _mm512_loadu_ps(xr);
                    b = _mm512_loadu_ps(xr + 16);
                }
                batchrun::quantize_group32(a, b, static_cast<int8_t*>(q) + r * k + g * 32,
                                           static_cast<float*>(scales) + r * groups + g,
                                           static_cast<float*>(sums) + r * groups + g);
            }
        return 0;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            float v[512];  // the group as float32 (group <= 512, checked above)
            const int64_t c0 = g * group;
            if (x_bf16) {
                const uint16_t* xr = static_cast<const uint16_t*>(x) + r * x_stride + c0;
#pragma omp simd
                for (int64_t i = 0; i < group; ++i) v[i] = bf16_to_f32(xr[i]);
            } else {
                const float* xr = static_cast<const float*>(x) + r * x_stride + c0;
#pragma omp simd
                for (int64_t i = 0; i < group; ++i) v[i] = xr[i];
            }
            float amax = 0.f;
            int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
            for (int64_t i = 0; i < group; ++i) {
                const float a = std::fabs(v[i]);
                amax = a > amax ? a : amax;
                nan |= v[i] != v[i];
            }
            float scale = amax / 127.0f;
            scale = scale < min_scale ? min_scale : scale;
            int8_t* __restrict qr = static_cast<int8_t*>(q) + r * k + c0;
            if (nan || std::isinf(scale)) {  // as torch: q = 0 (NaN cast to int8), a NaN sum, the scale NaN or inf
                std::memset(qr, 0, static_cast<size_t>(group));
                static_cast<float*>(scales)[r * groups + g] = nan ? std::nanf("") : scale;
                static_cast<float*>(sums)[r * groups + g] = std::nanf("");
                continue;
            }
            int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < group; ++i) {
                const int32_t qi = static_cast<int32_t>(round_half_even(v[i] / scale));
                qr[i] = static_cast<int8_t>(qi);
                sum += qi;
            }
            static_cast<float*>(scales)[r * groups + g] = scale;
            static_cast<float*>(sums)[r * groups + g] = scale * static_cast<float>(sum);
        }
    }
    return 0;
}

}  // extern "C"
