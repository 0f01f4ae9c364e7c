// The elementwise work between the bf16 GEMMs of a decoder layer, one pass each
// (batchrun/kernels/fused.py; batchrun/model/decoder.py calls it):
//
// - RMSNorm, optionally after adding the sublayer output into the residual stream;
// - rotary position embedding, in place on the q or k heads (which may be a strided view of the
//   fused qkv projection's output);
// - silu(gate) * up over the fused gate/up projection's output;
// - the step's K and V rows copied into their paged-cache slots (torch: a cast and an index_copy_
//   per tensor, per layer).
//
// In torch these are 2 to 5 separate passes each (a cast, the op, a cast back, a multiply...), and
// on a 2-core CPU they took about a sixth of a summarize run's operator time. Every function keeps
// the torch code's bf16 roundings where torch has them (each op's result is rounded to bf16 before
// the next op reads it), so rotary and the residual add are bitwise equal to torch and RMSNorm and
// silu differ only where a float32 sum order or exp's last bit tips a bf16 rounding (tested).
// bf16 only: the float32 path stays on torch ops, bitwise the arithmetic of the HF oracle.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "vec_math.h"

namespace {

using batchrun::bf16_to_f32;
using batchrun::f32_to_bf16;

// Rounds like torch's bf16 ops: a float32 result rounded to bf16, read back as float32.
inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// One row of RMSNorm in float32 as torch.nn.functional.rms_norm computes it on x.float(), then
// HF's weight multiply: bf16(w * bf16(x * rrms)); Gemma: bf16((x * rrms) * (1 + w)) in float32.
void rms_norm_row(const uint16_t* __restrict x, const uint16_t* __restrict w, int64_t k, float eps, bool gemma,
                  uint16_t* __restrict out) {
    float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < k; ++i) {
        const float v = bf16_to_f32(x[i]);
        sum_sq += v * v;
    }
    const float rrms = 1.f / std::sqrt(sum_sq / static_cast<float>(k) + eps);
    if (gemma) {
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) out[i] = f32_to_bf16((bf16_to_f32(x[i]) * rrms) * (1.f + bf16_to_f32(w[i])));
    } else {
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * rrms));
    }
}

#if defined(__AVX512F__)
using batchrun::load_bf16x16;
using batchrun::round_bf16_512;
using batchrun::silu512;
using batchrun::store_bf16;
#endif

void silu_mul_row(const uint16_t* __restrict gate, const uint16_t* __restrict up, int64_t n, uint16_t* __restrict out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 s = round_bf16_512(silu512(load_bf16x16(gate + i)));
        store_bf16(out + i, _mm512_mul_ps(s, load_bf16x16(up + i)));
    }
#endif
    for (; i < n; ++i) {
        const float g = bf16_to_f32(gate[i]);
        out[i] = f32_to_bf16(round_bf16(g / (1.f + std::exp(-g))) * bf16_to_f32(up[i]));
    }
}

// One head of rotary embedding in place: x * cos + rotate_half(x) * sin with rotate_half(x) =
// cat(-x2, x1), each product and the sum rounded to bf16 as torch's three ops round them.
void rotary_head(uint16_t* __restrict x, const uint16_t* __restrict cos, const uint16_t* __restrict sin, int64_t d) {
    const int64_t half = d / 2;
    float v[512];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) v[i] = bf16_to_f32(x[i]);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i)
        x[i] = f32_to_bf16(round_bf16(v[i] * bf16_to_f32(cos[i])) + round_bf16(-v[i + half] * bf16_to_f32(sin[i])));
#pragma omp simd
    for (int64_t i = half; i < d; ++i)
        x[i] = f32_to_bf16(round_bf16(v[i] * bf16_to_f32(cos[i])) + round_bf16(v[i - half] * bf16_to_f32(sin[i])));
}

}  // namespace

extern "C" {

// x: (m, k) bf16, rows x_stride apart; residual: (m, k) bf16 contiguous or null: when given,
// residual = bf16(residual + x) first (in place) and the norm is taken of the new residual; w: (k,)
// bf16; out: (m, k) bf16 contiguous.
int batchrun_rms_norm_bf16(const void* x, int64_t m, int64_t k, int64_t x_stride, void* residual, const void* w,
                           float eps, int gemma, void* out, int num_threads) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    uint16_t* rb = static_cast<uint16_t*>(residual);
    const uint16_t* wb = static_cast<const uint16_t*>(w);
    uint16_t* ob = static_cast<uint16_t*>(out);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k > 32768)
    for (int64_t r = 0; r < m; ++r) {
        const uint16_t* src = xb + r * x_stride;
        if (rb) {
            uint16_t* __restrict res = rb + r * k;
#pragma omp simd
            for (int64_t i = 0; i < k; ++i) res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(src[i]));
            src = res;
        }
        rms_norm_row(src, wb, k, eps, gemma != 0, ob + r * k);
    }
    return 0;
}

// x: (m, num_heads, head_dim) bf16 with strides (row_stride, head_dim, 1), rotated in place;
// cos, sin: (m, head_dim) bf16 contiguous. head_dim even and at most 512, else -2.
int batchrun_rotary_bf16(void* x, int64_t m, int64_t num_heads, int64_t head_dim, int64_t row_stride, const void* cos,
                         const void* sin, int num_threads) {
    if (head_dim % 2 != 0 || head_dim > 512) return -2;
    uint16_t* xb = static_cast<uint16_t*>(x);
    const uint16_t* cb = static_cast<const uint16_t*>(cos);
    const uint16_t* sb = static_cast<const uint16_t*>(sin);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * num_heads * head_dim > 32768)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t h = 0; h < num_heads; ++h)
            rotary_head(xb + r * row_stride + h * head_dim, cb + r * head_dim, sb + r * head_dim, head_dim);
    return 0;
}

// gate_up: (m, 2n) bf16, rows gu_stride apart, gate in the first n columns; out: (m, n) bf16
// contiguous = bf16(bf16(silu(gate)) * up).
int batchrun_silu_mul_bf16(const void* gate_up, int64_t m, int64_t n, int64_t gu_stride, void* out, int num_threads) {
    const uint16_t* g = static_cast<const uint16_t*>(gate_up);
    uint16_t* o = static_cast<uint16_t*>(out);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * n > 32768)
    for (int64_t r = 0; r < m; ++r) silu_mul_row(g + r * gu_stride, g + r * gu_stride + n, n, o + r * n);
    return 0;
}

// k, v: (num_tokens, num_kv_heads, head_dim) of elem_size-byte elements with strides
// (k_row, k_head, 1) and (v_row, v_head, 1); slots: (num_tokens,) int64, negative = skip; caches:
// (num_blocks, block_size, num_kv_heads, head_dim) of the same dtype with strides (c0, c1, c2, 1),
// the same for K and V. Row t goes to block slots[t] / block_size, offset slots[t] % block_size.
int batchrun_write_kv_cache(const void* k, const void* v, int64_t elem_size, int64_t num_tokens, int64_t num_kv_heads,
                            int64_t head_dim, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head,
                            const int64_t* slots, void* k_cache, void* v_cache, int64_t block_size, int64_t c0,
                            int64_t c1, int64_t c2, int num_threads) {
    const char* kb = static_cast<const char*>(k);
    const char* vb = static_cast<const char*>(v);
    char* kc = static_cast<char*>(k_cache);
    char* vc = static_cast<char*>(v_cache);
    const size_t row_bytes = static_cast<size_t>(head_dim * elem_size);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * num_kv_heads * head_dim > 65536)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t base = (slot / block_size) * c0 + (slot % block_size) * c1;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            std::memcpy(kc + (base + h * c2) * elem_size, kb + (t * k_row + h * k_head) * elem_size, row_bytes);
            std::memcpy(vc + (base + h * c2) * elem_size, vb + (t * v_row + h * v_head) * elem_size, row_bytes);
        }
    }
    return 0;
}

// The same copy into an int8 cache (engine.kv_cache_dtype: int8), quantizing each (token, head)
// row on the way as kernels/quant/kv.py: quantize_kv does: scale = max(amax * fl32(1 / 127), 1e-10) in
// float32 (a product with the reciprocal, the operation the GPU kernels and torch compute alike),
// q = round-half-even(clamp(x / scale, -127, 127)) (bitwise its result). k, v: bf16 (elem_size 2) or
// float32 (4); k_scale, v_scale: float32 (num_blocks, block_size, num_kv_heads) with strides
// (s0, s1, s2).
int batchrun_write_kv_cache_int8(const void* k, const void* v, int64_t elem_size, int64_t num_tokens,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t k_row, int64_t k_head, int64_t v_row,
                                 int64_t v_head, const int64_t* slots, void* k_cache, void* v_cache, float* k_scale,
                                 float* v_scale, int64_t block_size, int64_t c0, int64_t c1, int64_t c2, int64_t s0,
                                 int64_t s1, int64_t s2, int num_threads) {
    if (head_dim > 1024 || (elem_size != 2 && elem_size != 4)) return -2;
    auto quantize_row = [&](const void* src, int64_t at, int8_t* dst, float* scale_out) {
        float x[1024];
        if (elem_size == 2) {
            const uint16_t* p = static_cast<const uint16_t*>(src) + at;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) x[d] = bf16_to_f32(p[d]);
        } else {
            std::memcpy(x, static_cast<const float*>(src) + at, head_dim * sizeof(float));
        }
        float amax = 0.f;
        int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
        for (int64_t d = 0; d < head_dim; ++d) {
            amax = std::max(amax, std::fabs(x[d]));
            nan |= x[d] != x[d];
        }
        // A NaN row: torch's amax, scale and quotients are NaN, and NaN -> int8 stores 0.
        const float scale = nan ? NAN : std::max(amax * (1.f / 127.f), 1e-10f);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
            const float v = x[d] / scale;
            dst[d] = v != v ? int8_t(0) : static_cast<int8_t>(std::nearbyint(std::min(std::max(v, -127.f), 127.f)));
        }
        *scale_out = scale;
    };
    int8_t* kc = static_cast<int8_t*>(k_cache);
    int8_t* vc = static_cast<int8_t*>(v_cache);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens * num_kv_heads * head_dim > 65536)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t blk = slot / block_size, off = slot % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t at = blk * c0 + off * c1 + h * c2, sat = blk * s0 + off * s1 + h * s2;
            quantize_row(k, t * k_row + h * k_head, kc + at, k_scale + sat);
            quantize_row(v, t * v_row + h * v_head, vc + at, v_scale + sat);
        }
    }
    return 0;
}

}  // extern "C"
