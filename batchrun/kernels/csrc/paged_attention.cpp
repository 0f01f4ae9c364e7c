// CPU decode attention straight over the paged KV cache (batchrun/kernels/cpu_attention.py).
//
// The torch path (kernels/attention.py: gather_blocks + _decode_attend) copies every decoding
// sequence's whole context out of the cache (index_select) and then runs batched matmuls over the
// copy, in every layer of every step: for 32 sequences of ~400 tokens that is most of a decode
// step's time on a 2-core machine. Decode attention is memory-bound (one query per sequence), so
// this kernel reads each K and V row once, where it lies, through the block table: one work item
// per (sequence, KV head) computes the scores of the query heads that share that KV head (GQA),
// a float32 softmax and the weighted sum of V. Accumulation is float32; bf16 is widened on load.
// An int8 cache (engine.kv_cache_dtype: int8, one float32 scale per slot and head) is read as it
// is stored, at half the bytes of bf16: K's scale multiplies each score, V's each probability.
//
// Plain C ABI (called through ctypes, which releases the GIL), built by kernels/cpu_native.py with
// the system compiler; OpenMP resolves to the libgomp torch already loaded, so the kernel shares
// torch's thread pool instead of competing with it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "vec_math.h"

namespace {

// The cache's element type (the C entry's kv_dtype code).
enum Kv : int { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };
inline int64_t kv_bytes(int kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

// An int8 cache's scales: element (block, offset, kv_head) at block * block + offset * offset +
// kv_head * head; null for a float cache.
struct Scales {
    const float* k = nullptr;
    const float* v = nullptr;
    int64_t block = 0, offset = 0, head = 0;
    float at(const float* s, const int64_t* table, int64_t pos, int64_t block_size, int64_t h) const {
        return s[table[pos / block_size] * block + (pos % block_size) * offset + h * head];
    }
};

using batchrun::bf16_to_f32;
using batchrun::f32_to_bf16;

// Soft-caps (if softcap > 0) and exponentiates n scores in place, minus their max; returns their
// sum (the softmax denominator). Vectorized on AVX-512: with ~400 keys and 9 heads per sequence a
// scalar std::exp per score was most of a decode step's attention time.
inline float softmax_in_place(float* s, int64_t n, float softcap) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (softcap > 0.f)
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, batchrun::softcap512(_mm512_loadu_ps(s + i), softcap));
#endif
    if (softcap > 0.f)
        for (; i < n; ++i) s[i] = std::tanh(s[i] / softcap) * softcap;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
    float sum = 0.f;
    i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = batchrun::exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
    }
    return sum;
}

// One K or V row widened to float32 (an int8 row as its integers: the caller applies the scale).
template <int D>
inline void load_row(const void* base, int64_t offset, int kv, int64_t dyn_d, float* dst) {
    const int64_t d_len = D > 0 ? D : dyn_d;
    if (kv == KV_I8) {
        const int8_t* src = static_cast<const int8_t*>(base) + offset;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) dst[d] = static_cast<float>(src[d]);
    } else if (kv == KV_BF16) {
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) dst[d] = bf16_to_f32(src[d]);
    } else {
        const float* src = static_cast<const float*>(base) + offset;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) dst[d] = src[d];
    }
}

// Calls f(position, element offset of its row) for positions start..seq_len-1, block by block
// (no division per row). Blocks lie anywhere in the cache, so the hardware prefetcher cannot
// guess the next one: its rows are prefetched while the current block is processed (without this
// the kernel waits on memory latency, at a fraction of the bandwidth).
// Prefetches the rows of one block (of one KV head) at `base`; locality as __builtin_prefetch's.
template <int Locality = 3>
inline void prefetch_block(const char* base, int64_t block_size, int64_t row_stride_bytes, int64_t row_bytes) {
    for (int64_t r = 0; r < block_size; ++r)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + r * row_stride_bytes + b, 0, Locality);
}

template <typename F>
inline void for_each_row(const void* cache, int64_t elem_bytes, int64_t row_bytes, int64_t start, int64_t seq_len,
                         int64_t block_size, const int64_t* table, int64_t stride_block, int64_t stride_offset,
                         int64_t head_offset, F&& f) {
    const char* bytes = static_cast<const char*>(cache);
    const int64_t last_blk = (seq_len - 1) / block_size;
    for (int64_t blk = start / block_size, j = start; j < seq_len; ++blk) {
        if (blk + 1 <= last_blk)
            prefetch_block(bytes + (table[blk + 1] * stride_block + head_offset) * elem_bytes, block_size,
                           stride_offset * elem_bytes, row_bytes);
        const int64_t end = std::min(seq_len, (blk + 1) * block_size);
        int64_t off = table[blk] * stride_block + head_offset + (j - blk * block_size) * stride_offset;
        for (; j < end; ++j, off += stride_offset) f(j, off);
    }
}

template <int D>
void decode_one(int64_t b, int64_t h, const void* q, bool q_bf16, int64_t num_heads, int64_t dyn_d,
                const void* k_cache, const void* v_cache, int kv, const Scales& sc, int64_t num_kv_heads,
                int64_t stride_block, int64_t stride_offset, int64_t stride_head, int64_t block_size,
                const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens, float scale,
                float softcap, int64_t window, void* out, std::vector<float>& scratch) {
    const int64_t head_dim = D > 0 ? D : dyn_d;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t seq_len = seq_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
    const int64_t n = seq_len - start;
    // scratch: queries (group x head_dim), accumulators (group x head_dim), one row, scores (group x n)
    scratch.resize(static_cast<size_t>(3 * group * head_dim + head_dim + group * std::max<int64_t>(n, 1)));
    float* qf = scratch.data();
    float* acc = qf + group * head_dim;
    float* row = acc + group * head_dim;
    float* scores = row + head_dim;
    for (int64_t g = 0; g < group; ++g)
        load_row<D>(q, (b * num_heads + h * group + g) * head_dim, q_bf16, head_dim, qf + g * head_dim);
    const int64_t* table = block_tables + b * table_stride;
    const int64_t elem_bytes = kv_bytes(kv);

    for_each_row(k_cache, elem_bytes, elem_bytes * head_dim, start, seq_len, block_size, table, stride_block,
                 stride_offset, h * stride_head, [&](int64_t j, int64_t off) {
        load_row<D>(k_cache, off, kv, head_dim, row);
        const float row_scale = kv == KV_I8 ? sc.at(sc.k, table, j, block_size, h) * scale : scale;
        for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf + g * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
            scores[g * n + (j - start)] = s * row_scale;
        }
    });
    float denom[64];  // group <= 64 (checked by the caller)
    for (int64_t g = 0; g < group; ++g) denom[g] = softmax_in_place(scores + g * n, n, softcap);
    std::fill(acc, acc + group * head_dim, 0.f);
    for_each_row(v_cache, elem_bytes, elem_bytes * head_dim, start, seq_len, block_size, table, stride_block,
                 stride_offset, h * stride_head, [&](int64_t j, int64_t off) {
        load_row<D>(v_cache, off, kv, head_dim, row);
        const float row_scale = kv == KV_I8 ? sc.at(sc.v, table, j, block_size, h) : 1.f;
        for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * n + (j - start)] * row_scale;
            float* ag = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
    });
    for (int64_t g = 0; g < group; ++g) {
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        const int64_t o = (b * num_heads + h * group + g) * head_dim;
        if (q_bf16) {
            uint16_t* dst = static_cast<uint16_t*>(out) + o;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = f32_to_bf16(acc[g * head_dim + d] * inv);
        } else {
            float* dst = static_cast<float*>(out) + o;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[g * head_dim + d] * inv;
        }
    }
}

#if defined(__AVX512F__)
// The AVX-512 path for head_dim = 16 * DC and GQA group G known at compile time: K and V rows are
// widened to float32 registers once and used by all G query heads; the G x 16 dot products of a
// tile of 16 positions are reduced to 16 scores by one transposing add tree (instead of a
// horizontal sum per score); V accumulates in registers.

inline __m512 load16(const void* base, int64_t offset, int kv) {
    if (kv == KV_BF16) return batchrun::load_bf16x16(static_cast<const uint16_t*>(base) + offset);
    if (kv == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + offset))));
    return _mm512_loadu_ps(static_cast<const float*>(base) + offset);
}

// out[i] = sum of the 16 lanes of v[i], for i < 16.
inline __m512 sum16x16(__m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i(0+2), v2i+1(0+2), v2i(1+3), v2i+1(1+3)]
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of rows 4i .. 4i+3
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int DC, int G>
void decode_one_avx512(int64_t b, int64_t h, const void* q, bool q_bf16, int64_t num_heads, const void* k_cache,
                       const void* v_cache, int kv, const Scales& sc, int64_t stride_block, int64_t stride_offset,
                       int64_t stride_head, int64_t block_size, const int64_t* block_tables, int64_t table_stride,
                       const int64_t* seq_lens, float scale, float softcap, int64_t window, void* out,
                       std::vector<float>& scratch) {
    constexpr int64_t D = 16 * DC;
    const int64_t seq_len = seq_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
    const int64_t n = seq_len - start;
    const int64_t n16 = (n + 15) / 16 * 16;
    scratch.resize(static_cast<size_t>(G * n16));
    float* scores = scratch.data();  // (G, n16)
    __m512 qv[G][DC];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c)
            qv[g][c] = _mm512_mul_ps(load16(q, (b * num_heads + h * G + g) * D + 16 * c, q_bf16), _mm512_set1_ps(scale));
    const int64_t* table = block_tables + b * table_stride;
    const int64_t elem_bytes = kv_bytes(kv);
    const int64_t head_offset = h * stride_head;

    // Scores, 16 positions at a time (a tile never crosses a block: block_size % 16 == 0).
    for (int64_t j = start; j < seq_len;) {
        const int64_t blk = j / block_size;
        const int64_t tile_end = std::min({seq_len, (blk + 1) * block_size, (j / 16 + 1) * 16});
        if (j % block_size == 0 || j == start) {  // entering a block: prefetch the next one's rows
            const int64_t nb = (blk + 1) * block_size < seq_len ? table[blk + 1] : -1;
            if (nb >= 0) {  // V too, into L2: the V pass below reads it after this K pass
                const int64_t at = (nb * stride_block + head_offset) * elem_bytes;
                prefetch_block(static_cast<const char*>(k_cache) + at, block_size, stride_offset * elem_bytes,
                               D * elem_bytes);
                prefetch_block<2>(static_cast<const char*>(v_cache) + at, block_size, stride_offset * elem_bytes,
                                  D * elem_bytes);
            }
        }
        const int64_t base = table[blk] * stride_block + head_offset;
        __m512 part[G][16];
        const int64_t t0 = j & ~int64_t(15);  // tile start position (may precede `start`)
        alignas(64) float row_scale[16];  // int8: K's scale of each position
        for (int r = 0; r < 16; ++r) {
            const int64_t pos = t0 + r;
            if (pos < j || pos >= tile_end) {
                for (int g = 0; g < G; ++g) part[g][r] = _mm512_setzero_ps();
                row_scale[r] = 0.f;
                continue;
            }
            if (kv == KV_I8) row_scale[r] = sc.at(sc.k, table, pos, block_size, h);
            const int64_t off = base + (pos - blk * block_size) * stride_offset;
            __m512 acc[G];
            for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
            for (int c = 0; c < DC; ++c) {
                const __m512 kvec = load16(k_cache, off + 16 * c, kv);
                for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(qv[g][c], kvec, acc[g]);
            }
            for (int g = 0; g < G; ++g) part[g][r] = acc[g];
        }
        for (int g = 0; g < G; ++g) {
            alignas(64) float tile[16];
            __m512 sums = sum16x16(part[g]);
            if (kv == KV_I8) sums = _mm512_mul_ps(sums, _mm512_load_ps(row_scale));
            _mm512_store_ps(tile, sums);
            for (int64_t pos = j; pos < tile_end; ++pos) scores[g * n16 + (pos - start)] = tile[pos - t0];
        }
        j = tile_end;
    }
    float denom[G];
    for (int g = 0; g < G; ++g) denom[g] = softmax_in_place(scores + g * n16, n, softcap);
    __m512 acc[G][DC];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
    for_each_row(v_cache, 0, 0, start, seq_len, block_size, table, stride_block, stride_offset, head_offset,
                 [&](int64_t j, int64_t off) {
        const float vs = kv == KV_I8 ? sc.at(sc.v, table, j, block_size, h) : 1.f;  // int8: V's scale
        __m512 p[G];
        for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[g * n16 + (j - start)] * vs);
        for (int c = 0; c < DC; ++c) {
            const __m512 vv = load16(v_cache, off + 16 * c, kv);
            for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], vv, acc[g][c]);
        }
    });
    for (int g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(denom[g] > 0.f ? 1.f / denom[g] : 0.f);
        const int64_t o = (b * num_heads + h * G + g) * D;
        for (int c = 0; c < DC; ++c) {
            const __m512 r = _mm512_mul_ps(acc[g][c], inv);
            if (q_bf16) {
                alignas(64) float tmp[16];
                _mm512_store_ps(tmp, r);
                uint16_t* dst = static_cast<uint16_t*>(out) + o + 16 * c;
                for (int i = 0; i < 16; ++i) dst[i] = f32_to_bf16(tmp[i]);
            } else {
                _mm512_storeu_ps(static_cast<float*>(out) + o + 16 * c, r);
            }
        }
    }
}

// Calls the AVX-512 instance for (head_dim, group) if there is one; false if not.
inline bool decode_avx512(int64_t head_dim, int64_t group, int64_t block_size, int64_t b, int64_t h, const void* q,
                          bool q_bf16, int64_t num_heads, const void* k_cache, const void* v_cache, int kv,
                          const Scales& sc, int64_t stride_block, int64_t stride_offset, int64_t stride_head,
                          const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens, float scale,
                          float softcap, int64_t window, void* out, std::vector<float>& scratch) {
    if (block_size % 16 != 0) return false;
#define BATCHRUN_CASE(DC, G)                                                                                     \
    if (head_dim == 16 * DC && group == G) {                                                                     \
        decode_one_avx512<DC, G>(b, h, q, q_bf16, num_heads, k_cache, v_cache, kv, sc, stride_block,              \
                                 stride_offset, stride_head, block_size, block_tables, table_stride, seq_lens, scale, \
                                 softcap, window, out, scratch);                                                 \
        return true;                                                                                             \
    }
#define BATCHRUN_GROUPS(DC) \
    BATCHRUN_CASE(DC, 1) BATCHRUN_CASE(DC, 2) BATCHRUN_CASE(DC, 3) BATCHRUN_CASE(DC, 4) \
    BATCHRUN_CASE(DC, 5) BATCHRUN_CASE(DC, 6) BATCHRUN_CASE(DC, 7) BATCHRUN_CASE(DC, 8)
    BATCHRUN_GROUPS(4)
    BATCHRUN_GROUPS(8)
#undef BATCHRUN_GROUPS
#undef BATCHRUN_CASE
    return false;
}
#endif  // __AVX512F__

}  // namespace

extern "C" {

// q, out: (num_seqs, num_heads, head_dim) contiguous, float32 or bf16 (q_bf16).
// k_cache, v_cache: element (block, offset, kv_head, d) at block * stride_block +
//   offset * stride_offset + kv_head * stride_head + d; kv_dtype 0 float32, 1 bf16, 2 int8.
// k_scale, v_scale: int8 only (else null), float32 element (block, offset, kv_head) at
//   block * scale_stride_block + offset * scale_stride_offset + kv_head * scale_stride_head.
// block_tables: (num_seqs, table_stride) int64; seq_lens: (num_seqs,) int64, the query's own
//   position included. window > 0: only the last `window` keys; softcap > 0: tanh soft-capping.
// Returns 0, -1 when num_heads is not a multiple of num_kv_heads, -2 for an int8 cache without scales.
int batchrun_paged_decode_attention(const void* q, int q_bf16, int64_t num_seqs, int64_t num_heads,
                                    int64_t head_dim, const void* k_cache, const void* v_cache, int kv_dtype,
                                    int64_t num_kv_heads, int64_t stride_block, int64_t stride_offset,
                                    int64_t stride_head, const float* k_scale, const float* v_scale,
                                    int64_t scale_stride_block, int64_t scale_stride_offset,
                                    int64_t scale_stride_head, int64_t block_size, const int64_t* block_tables,
                                    int64_t table_stride, const int64_t* seq_lens, float scale, float softcap,
                                    int64_t window, void* out, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64) return -1;
    if (kv_dtype == KV_I8 && (k_scale == nullptr || v_scale == nullptr)) return -2;
    const Scales sc{k_scale, v_scale, scale_stride_block, scale_stride_offset, scale_stride_head};
    const int kv = kv_dtype;
    const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
#if defined(__AVX512F__)
            if (decode_avx512(head_dim, num_heads / num_kv_heads, block_size, b, h, q, q_bf16 != 0, num_heads, k_cache,
                              v_cache, kv, sc, stride_block, stride_offset, stride_head, block_tables,
                              table_stride, seq_lens, scale, softcap, window, out, scratch))
                continue;
#endif
#define BATCHRUN_DECODE(DIM)                                                                              \
    decode_one<DIM>(b, h, q, q_bf16 != 0, num_heads, head_dim, k_cache, v_cache, kv, sc, num_kv_heads,     \
                    stride_block, stride_offset, stride_head, block_size, block_tables, table_stride,      \
                    seq_lens, scale, softcap, window, out, scratch)
            if (head_dim == 64) BATCHRUN_DECODE(64);
            else if (head_dim == 128) BATCHRUN_DECODE(128);
            else BATCHRUN_DECODE(0);
#undef BATCHRUN_DECODE
        }
    }
    return 0;
}

}  // extern "C"
