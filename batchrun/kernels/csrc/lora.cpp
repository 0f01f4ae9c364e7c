// Per-token LoRA updates beside a linear layer's base GEMM, one call per wrapped linear per step
// (batchrun/kernels/lora.py; batchrun/model/lora.py: LoraLinear calls it where a step's adapter
// tokens are spread over slots, as a decode step's rows are):
//
//   y[t, :] += B_s @ (A_s @ x[t, :])   for every token t whose slot s = token_slots[t] >= 0
//
// In torch this is a gather, two batched matmuls and an index_add per linear, whose per-op
// overhead outweighs the little arithmetic of a decode step's rows. Here the tokens are
// sorted by slot (a counting sort), cut into chunks of up to CHUNK tokens of one slot, and each
// chunk reads its slot's weights once for all its tokens: first low = A_s @ x (per chunk), then
// the update per (chunk, block of outputs), added into y in place. Weights are float32 (scale
// folded into B, zero padded to R); x and y float32 or bf16; everything is accumulated in float32
// and a bf16 y is rounded once, after the add.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "vec_math.h"

namespace {

using batchrun::bf16_to_f32;
using batchrun::f32_to_bf16;

constexpr int64_t CHUNK = 8;         // tokens of one slot sharing one read of the slot's weights
constexpr int64_t OUT_BLOCK = 256;   // outputs per work item of the second product
constexpr int64_t LANES = 16;        // one AVX-512 vector of float32: the accumulators' width
constexpr int64_t MAX_R_TILE = 64;   // ranks staged per pass of the second product

struct Chunk {
    int64_t slot;
    int64_t first;  // into the slot-sorted token order
    int64_t count;
};

// x row t as float32 into dst (k floats).
inline void load_row(const void* x, int dtype, int64_t t, int64_t stride, int64_t k, float* __restrict dst) {
    if (dtype == 0) {
        std::memcpy(dst, static_cast<const float*>(x) + t * stride, k * sizeof(float));
    } else {
        const uint16_t* src = static_cast<const uint16_t*>(x) + t * stride;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) dst[i] = bf16_to_f32(src[i]);
    }
}


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BATCHRUN_LORA_AVX512 1
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// low[(first + j) * R + r] = A_s[r] . xs[j] for j < count, r < r_used: tiles of 2 ranks x CHUNK
// tokens (16 accumulators: 10 loads per 16 FMAs), reduced across lanes once per tile.
inline void first_product_avx512(const float* __restrict a_s, const float* __restrict xs, int64_t in_f,
                                 int64_t r_used, int64_t count, int64_t first, int64_t R, float* __restrict low) {
    for (int64_t r = 0; r < r_used; r += 2) {
        const float* a0 = a_s + r * in_f;
        const float* a1 = r + 1 < r_used ? a0 + in_f : a0;  // an odd last rank: its pair computed twice
        __m512 acc0[CHUNK], acc1[CHUNK];
#pragma GCC unroll 8
        for (int64_t j = 0; j < CHUNK; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < in_f; k0 += LANES) {
            const __mmask16 m = tail_mask(in_f - k0);
            const __m512 va0 = _mm512_maskz_loadu_ps(m, a0 + k0);
            const __m512 va1 = _mm512_maskz_loadu_ps(m, a1 + k0);
#pragma GCC unroll 8
            for (int64_t j = 0; j < CHUNK; ++j) {
                const __m512 vx = _mm512_maskz_loadu_ps(m, xs + j * in_f + k0);
                acc0[j] = _mm512_fmadd_ps(va0, vx, acc0[j]);
                acc1[j] = _mm512_fmadd_ps(va1, vx, acc1[j]);
            }
        }
        // reduced over a constant count first: an accumulator indexed by the variable `count`
        // would be kept in memory through the loop above
        float sums[2][CHUNK];
#pragma GCC unroll 8
        for (int64_t j = 0; j < CHUNK; ++j) {
            sums[0][j] = _mm512_reduce_add_ps(acc0[j]);
            sums[1][j] = _mm512_reduce_add_ps(acc1[j]);
        }
        for (int64_t j = 0; j < count; ++j) {
            low[(first + j) * R + r] = sums[0][j];
            if (r + 1 < r_used) low[(first + j) * R + r + 1] = sums[1][j];
        }
    }
}

// y[order[first + j], o0 : o0 + n] += lows[j, :r_used] @ bt_s[:r_used, 0 : n] for j < count, in
// tiles of 32 outputs x CHUNK tokens (16 accumulators: 2 loads and 8 broadcasts per 16 FMAs),
// added straight into y (a bf16 y rounded once).
inline void second_product_avx512(const float (*lows)[MAX_R_TILE], int64_t rn, const float* __restrict bt_s,
                                  int64_t out_f, int64_t n, int64_t o1, __m512 (*out)[2]) {
    const __mmask16 m0 = tail_mask(n - o1), m1 = tail_mask(n - o1 - LANES);
    const bool two = n - o1 > LANES;
    __m512 acc[CHUNK][2];  // locals, so that they live in registers through the loop
#pragma GCC unroll 8
    for (int64_t j = 0; j < CHUNK; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rn; ++r) {
        const float* brow = bt_s + r * out_f + o1;
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, brow);
        const __m512 b1 = two ? _mm512_maskz_loadu_ps(m1, brow + LANES) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int64_t j = 0; j < CHUNK; ++j) {
            const __m512 l = _mm512_set1_ps(lows[j][r]);
            acc[j][0] = _mm512_fmadd_ps(l, b0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(l, b1, acc[j][1]);
        }
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < CHUNK; ++j) {
        out[j][0] = acc[j][0];
        out[j][1] = acc[j][1];
    }
}

inline void add_row_avx512(void* y, int dtype, int64_t t, int64_t y_stride, int64_t o, int64_t left, const __m512* acc) {
    for (int h = 0; h < 2 && left > h * LANES; ++h) {
        const __mmask16 m = tail_mask(left - h * LANES);
        const int64_t at = t * y_stride + o + h * LANES;
        if (dtype == 0) {
            float* yr = static_cast<float*>(y) + at;
            _mm512_mask_storeu_ps(yr, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), acc[h]));
        } else {
            uint16_t* yr = static_cast<uint16_t*>(y) + at;
            const __m512 v = _mm512_add_ps(batchrun::bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, yr)), acc[h]);
            const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(batchrun::round_bf16_512(v)), 16);
            _mm256_mask_storeu_epi16(yr, m, _mm512_cvtepi32_epi16(r));
        }
    }
}
#endif

}  // namespace

extern "C" {

// x: (T, in_f) rows x_stride apart, y: (T, out_f) rows y_stride apart, both float32 (dtype 0) or
// bf16 (dtype 1), unit last stride; a: (S, R, in_f) and bt: (S, R, out_f) float32 contiguous
// (bt[s] = B_s^T, scale folded in); token_slots: (T,) int64, negative = no update; ranks: (S,)
// int64, the rows of a[s] / bt[s] in use (0: the slot adds nothing). y is updated in place.
int batchrun_lora_rows(const void* x, int dtype, int64_t num_tokens, int64_t in_f, int64_t x_stride, void* y,
                       int64_t y_stride, int64_t out_f, const void* a, const void* bt, int64_t num_slots, int64_t R,
                       const void* token_slots, const void* ranks, int num_threads) {
    if (dtype != 0 && dtype != 1) return -1;
    const int64_t* slots = static_cast<const int64_t*>(token_slots);
    const int64_t* rank = static_cast<const int64_t*>(ranks);
    const float* A = static_cast<const float*>(a);
    const float* BT = static_cast<const float*>(bt);
    // counting sort of the tokens by slot (slots out of range or of rank 0 are skipped)
    std::vector<int64_t> start(num_slots + 1, 0);
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t s = slots[t];
        if (s >= 0 && s < num_slots && rank[s] > 0) ++start[s + 1];
    }
    for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
    const int64_t rows = start[num_slots];
    if (rows == 0) return 0;
    std::vector<int64_t> order(rows);
    {
        std::vector<int64_t> next(start.begin(), start.end() - 1);
        for (int64_t t = 0; t < num_tokens; ++t) {
            int64_t s = slots[t];
            if (s >= 0 && s < num_slots && rank[s] > 0) order[next[s]++] = t;
        }
    }
    std::vector<Chunk> chunks;
    for (int64_t s = 0; s < num_slots; ++s)
        for (int64_t i = start[s]; i < start[s + 1]; i += CHUNK) chunks.push_back({s, i, std::min(CHUNK, start[s + 1] - i)});
    const int64_t num_chunks = static_cast<int64_t>(chunks.size());
    std::vector<float> low(rows * R);  // (rows, R) in the sorted order
    const int64_t out_blocks = (out_f + OUT_BLOCK - 1) / OUT_BLOCK;
    const int64_t work = num_chunks * out_blocks;
    const bool parallel = rows * R * (in_f + out_f) > 65536;

#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        // a chunk's x rows as float32, rows past its count zero (every loop below runs CHUNK
        // tokens, so their accumulators stay in registers)
        std::vector<float> xs(CHUNK * in_f, 0.0f);
        // low[i, :r] = A_s[:r] @ x[order[i]]
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; ++c) {
            const Chunk ch = chunks[c];
            const int64_t r_used = rank[ch.slot];
            for (int64_t j = 0; j < CHUNK; ++j) {
                if (j < ch.count)
                    load_row(x, dtype, order[ch.first + j], x_stride, in_f, &xs[j * in_f]);
                else
                    std::memset(&xs[j * in_f], 0, in_f * sizeof(float));
            }
            const float* a_s = A + ch.slot * R * in_f;
#ifdef BATCHRUN_LORA_AVX512
            first_product_avx512(a_s, xs.data(), in_f, r_used, ch.count, ch.first, R, low.data());
            continue;
#endif
            const int64_t k_vec = in_f / LANES * LANES;
            for (int64_t r = 0; r < r_used; ++r) {
                const float* __restrict arow = a_s + r * in_f;
                float acc[CHUNK][LANES] = {};
                for (int64_t k0 = 0; k0 < k_vec; k0 += LANES)
                    for (int64_t j = 0; j < CHUNK; ++j)
#pragma omp simd
                        for (int64_t l = 0; l < LANES; ++l) acc[j][l] += arow[k0 + l] * xs[j * in_f + k0 + l];
                for (int64_t j = 0; j < ch.count; ++j) {
                    float sum = 0.0f;
                    for (int64_t l = 0; l < LANES; ++l) sum += acc[j][l];
                    for (int64_t k = k_vec; k < in_f; ++k) sum += arow[k] * xs[j * in_f + k];
                    low[(ch.first + j) * R + r] = sum;
                }
            }
        }
        // y[order[i], block] += low[i, :r] @ bt_s[:r, block]
        float acc[CHUNK][OUT_BLOCK];
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; ++w) {
            const Chunk ch = chunks[w / out_blocks];
            const int64_t o0 = (w % out_blocks) * OUT_BLOCK;
            const int64_t n = std::min(OUT_BLOCK, out_f - o0);
            const int64_t r_used = rank[ch.slot];
            const float* bt_s = BT + ch.slot * R * out_f + o0;
            float lows[CHUNK][MAX_R_TILE];
#ifdef BATCHRUN_LORA_AVX512
            if (r_used <= MAX_R_TILE) {
                for (int64_t j = 0; j < CHUNK; ++j)
                    for (int64_t r = 0; r < r_used; ++r) lows[j][r] = j < ch.count ? low[(ch.first + j) * R + r] : 0.0f;
                for (int64_t o1 = 0; o1 < n; o1 += 2 * LANES) {
                    __m512 part[CHUNK][2];
                    second_product_avx512(lows, r_used, bt_s, out_f, n, o1, part);
                    for (int64_t j = 0; j < ch.count; ++j)
                        add_row_avx512(y, dtype, order[ch.first + j], y_stride, o0 + o1, n - o1, part[j]);
                }
                continue;
            }
#endif
            const int64_t n_vec = n / LANES * LANES;
            for (int64_t o1 = 0; o1 < n; o1 += LANES) {
                float part[CHUNK][LANES] = {};
                const bool full = o1 < n_vec;
                for (int64_t r0 = 0; r0 < r_used; r0 += MAX_R_TILE) {
                    const int64_t rn = std::min(MAX_R_TILE, r_used - r0);
                    for (int64_t j = 0; j < CHUNK; ++j)
                        for (int64_t r = 0; r < rn; ++r)
                            lows[j][r] = j < ch.count ? low[(ch.first + j) * R + r0 + r] : 0.0f;
                    for (int64_t r = 0; r < rn; ++r) {
                        const float* __restrict brow = bt_s + (r0 + r) * out_f + o1;
                        if (full) {
                            for (int64_t j = 0; j < CHUNK; ++j) {
                                const float l = lows[j][r];
#pragma omp simd
                                for (int64_t q = 0; q < LANES; ++q) part[j][q] += l * brow[q];
                            }
                        } else {
                            for (int64_t j = 0; j < CHUNK; ++j)
                                for (int64_t q = 0; q < n - o1; ++q) part[j][q] += lows[j][r] * brow[q];
                        }
                    }
                }
                const int64_t m = std::min(LANES, n - o1);
                for (int64_t j = 0; j < ch.count; ++j)
                    for (int64_t q = 0; q < m; ++q) acc[j][o1 + q] = part[j][q];
            }
            for (int64_t j = 0; j < ch.count; ++j) {
                float* __restrict accj = acc[j];
                const int64_t t = order[ch.first + j];
                if (dtype == 0) {
                    float* __restrict yr = static_cast<float*>(y) + t * y_stride + o0;
#pragma omp simd
                    for (int64_t o = 0; o < n; ++o) yr[o] += accj[o];
                } else {
                    uint16_t* __restrict yr = static_cast<uint16_t*>(y) + t * y_stride + o0;
#pragma omp simd
                    for (int64_t o = 0; o < n; ++o) yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + accj[o]);
                }
            }
        }
    }
    return 0;
}

}  // extern "C"
