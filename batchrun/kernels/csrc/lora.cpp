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
