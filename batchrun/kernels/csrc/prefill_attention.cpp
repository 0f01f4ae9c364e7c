// CPU prefill attention straight over the paged KV cache (batchrun/kernels/cpu_attention.py).
//
// The torch path (kernels/attention.py) runs one SDPA call per prefilling sequence; when part of
// the prompt is already cached (a shared system prompt, the previous chunk of a chunked prefill) it
// first copies the whole context out of the cache and builds a boolean mask, which sends SDPA to
// its slow masked path. On the summarize workload that was a quarter of all operator time on a
// 2-core machine (~50 GFLOP/s). This kernel reads K and V where they lie, through the block table,
// and computes causal attention flash-style (online softmax, float32 state):
//
// - One work item per (sequence, KV head, chunk of QCHUNK query positions); its rows are the chunk's
//   positions times the G query heads that share the KV head (GQA), so every K/V tile is prepared
//   once for G * QCHUNK query rows. Items run largest first under OpenMP's dynamic schedule (later
//   chunks see more keys).
// - Keys go 64 at a time, in four 16-key sub-tiles (a sub-tile never crosses a cache block:
//   block_size % 16 == 0); each row's online-softmax bookkeeping is paid once per 64 keys.
// - bf16: both products run on AVX512-BF16 dot-product instructions (vdpbf16ps: pairs of bf16
//   products summed into float32 lanes). The K tile is transposed into 16-key lanes of (d, d+1)
//   pairs in registers (16 x 16 transposes of 32-bit elements; a gather for head_dim 16); the V tile is interleaved into (key, key+1) pairs per d; probabilities are
//   rounded to bf16 for the second product, as torch's own CPU flash attention does.
// - float32: the same loop with FMAs over a transposed float32 K tile.
//
// Only head_dim 16, 32, 64, 128 and 256 on an AVX-512 build (bf16 also needs AVX512-BF16); everything else is
// refused (batchrun_prefill_attention_supported) and takes the torch path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "vec_math.h"

namespace {

constexpr int64_t QCHUNK = 32;  // query positions per work item
constexpr int KT = 4;  // 16-key sub-tiles per step
constexpr int NR = 4;  // rows per micro-kernel call

#if defined(__AVX512F__)
using batchrun::exp2_512;
using batchrun::softcap512;

struct Shape {
    int64_t num_heads, num_kv_heads, block_size, stride_block, stride_offset, stride_head;
    float scale, softcap;
    int64_t window;
    // Key steps start on multiples of 16 * KT from position 0 (a fixed grid) instead of at the
    // item's first visible key: under a sliding window a row's steps (and so its online-softmax
    // order) then do not depend on which chunk of query positions it came in with.
    bool fixed_key_grid;
    // An int8 cache's float32 scales, element (block, offset, kv_head) at block * scale_block +
    // offset * scale_offset + kv_head * scale_head; null for a float cache.
    const float* k_scale;
    const float* v_scale;
    int64_t scale_block, scale_offset, scale_head;
};

// out[c] lane j = r[j] lane c: a 16 x 16 transpose of 32-bit elements (r is clobbered).
inline void transpose16x16(__m512i r[16], __m512i out[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {  // per 128-bit block b: (r2i, r2i+1) at columns 4b, 4b+1 / 4b+2, 4b+3
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + e], block b: rows 4i .. 4i + 3 at column 4b + e
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {  // gather the four row quads of column 4b + e
        const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
        out[e] = _mm512_shuffle_i32x4(a, c, 0x88);
        out[8 + e] = _mm512_shuffle_i32x4(a, c, 0xdd);
        out[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
        out[12 + e] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

// One step's keys: KT sub-tiles of 16 keys (a sub-tile never crosses a cache block: block_size % 16
// == 0), K and V prepared for the products (see the top of the file). A step covers 16 * KT keys so
// that each row's softmax bookkeeping (max, rescale, accumulator load and store) is paid once per
// 16 * KT keys instead of once per 16: with 16-key steps it cost as much as the products.
// 16 int8 at p widened to float32 lanes.
inline __m512 i8x16_to_f32(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Where one sub-tile's keys lie: element offset `off` of its first row, the rows `stride`
// elements apart, `valid` of them; for an int8 cache also its first row's K and V scales, the
// rows' scales `scale_stride` floats apart.
struct SubTile {
    int64_t off, stride;
    int valid;
    const float* k_scale = nullptr;
    const float* v_scale = nullptr;
    int64_t scale_stride = 0;
};

template <int DC, bool BF16>
struct Tile {
    static constexpr int D = 16 * DC;
    // bf16: k[t][p] lane j = the (2p, 2p+1) bf16 pair of key 16t + j's row;
    //       v[jp][c] lane i = (V[2jp][16c+i], V[2jp+1][16c+i]) over the step's keys.
    // float32: kf[t][d] lane j = K[16t + j][d]; vf[j][c] = V[j][16c .. 16c+15].
    alignas(64) __m512i k[BF16 ? KT : 1][BF16 ? D / 2 : 1];
    alignas(64) __m512i v[BF16 ? 8 * KT : 1][DC];
    alignas(64) __m512 kf[BF16 ? 1 : KT][BF16 ? 1 : D];
    alignas(64) __m512 vf[BF16 ? 1 : 16 * KT][DC];
    // bf16 over an int8 cache: K and V hold the integers (exact in bf16); each key's K scale then
    // multiplies its scores (ks) and its V scale its probabilities (vs). float32 dequantizes on load.
    bool scaled;
    alignas(64) float ks[KT][16], vs[KT][16];

    // Sub-tile t of a float cache of the tile's dtype, or of an int8 cache (int8). Rows past
    // `valid` are zero (V must be: a zero probability times a garbage bf16 could be NaN).
    void load(int t, const void* k_cache, const void* v_cache, const SubTile& st, bool int8) {
        const int valid = st.valid;
        const int64_t stride_offset = st.stride, off = st.off;
        alignas(64) float kscale[16] = {}, vscale[16] = {};
        if (int8)
            for (int j = 0; j < valid; ++j) {
                kscale[j] = st.k_scale[j * st.scale_stride];
                vscale[j] = st.v_scale[j * st.scale_stride];
            }
        // Row j's 16 elements from d0 as float32 lanes (float or int8 cache), or row j's 16
        // (d, d+1) bf16 pairs from d0 (bf16 or int8 cache), zero past `valid`.
        auto row16f = [&](const void* base, int j, int d0) {
            if (j >= valid) return _mm512_setzero_ps();
            if (int8) return i8x16_to_f32(static_cast<const int8_t*>(base) + off + j * stride_offset + d0);
            return _mm512_loadu_ps(static_cast<const float*>(base) + off + j * stride_offset + d0);
        };
        auto row16pairs = [&](const void* base, int j, int d0) {
            if (j >= valid) return _mm512_setzero_si512();
            if (int8) {
                const int8_t* p = static_cast<const int8_t*>(base) + off + j * stride_offset + d0;
                return (__m512i)_mm512_cvtne2ps_pbh(i8x16_to_f32(p + 16), i8x16_to_f32(p));
            }
            return _mm512_loadu_si512(static_cast<const uint16_t*>(base) + off + j * stride_offset + d0);
        };
        // Row j's 16 V elements from d0 as bf16 in the low halves of 32-bit lanes.
        auto v16 = [&](int j, int d0) {
            if (j >= valid) return _mm512_setzero_si512();
            if (int8)
                return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                    i8x16_to_f32(static_cast<const int8_t*>(v_cache) + off + j * stride_offset + d0)));
            return _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(v_cache) + off + j * stride_offset + d0)));
        };
        scaled = BF16 && int8;  // (the tile lives in raw scratch memory: no constructor ran)
        if constexpr (BF16) {
            if (int8) {
                _mm512_store_ps(ks[t], _mm512_load_ps(kscale));
                _mm512_store_ps(vs[t], _mm512_load_ps(vscale));
            }
            if constexpr (D >= 32) {  // 16 pairs of each row at a time, transposed in registers
                for (int b = 0; b < D / 32; ++b) {
                    __m512i r[16];
                    for (int j = 0; j < 16; ++j) r[j] = row16pairs(k_cache, j, 32 * b);
                    transpose16x16(r, k[t] + 16 * b);
                }
            } else {  // head_dim 16: eight pairs per row, gathered
                // An int8 sub-tile is widened to bf16 rows in a scratch first, gathered from there.
                alignas(64) uint16_t widened[16 * 16];
                const uint16_t* src = static_cast<const uint16_t*>(k_cache) + off;
                int64_t src_stride = stride_offset;
                if (int8) {
                    for (int j = 0; j < 16; ++j)
                        _mm256_store_si256(reinterpret_cast<__m256i*>(widened + 16 * j),
                                           j < valid ? (__m256i)_mm512_cvtneps_pbh(i8x16_to_f32(
                                                           static_cast<const int8_t*>(k_cache) + off + j * stride_offset))
                                                     : _mm256_setzero_si256());
                    src = widened;
                    src_stride = 16;
                }
                // Element offsets of the rows in units of 4 bytes (a pair): stride_offset is even
                // for every bf16 layout with head_dim >= 2 (checked by the caller).
                const __mmask16 m = valid >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
                const __m512i pair_rows = _mm512_srli_epi32(_mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(static_cast<int>(src_stride))), 1);
                const int32_t* kbase = reinterpret_cast<const int32_t*>(src);
                for (int p = 0; p < D / 2; ++p)
                    k[t][p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, pair_rows, kbase + p, 4);
            }
            for (int jp = 0; jp < 8; ++jp)
                for (int c = 0; c < DC; ++c)
                    v[8 * t + jp][c] = _mm512_or_si512(v16(2 * jp, 16 * c), _mm512_slli_epi32(v16(2 * jp + 1, 16 * c), 16));
        } else {
            const __m512 ksv = _mm512_load_ps(kscale);
            for (int b = 0; b < D / 16; ++b) {  // 16 dims of each row at a time, transposed in registers
                __m512i r[16];
                for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(row16f(k_cache, j, 16 * b));
                __m512* dst = kf[t] + 16 * b;
                transpose16x16(r, reinterpret_cast<__m512i*>(dst));
                if (int8)
                    for (int c = 0; c < 16; ++c) dst[c] = _mm512_mul_ps(dst[c], ksv);  // lanes are keys
            }
            for (int j = 0; j < 16; ++j)
                for (int c = 0; c < DC; ++c) {
                    const __m512 row = row16f(v_cache, j, 16 * c);
                    vf[16 * t + j][c] = int8 ? _mm512_mul_ps(row, _mm512_set1_ps(vscale[j])) : row;
                }
        }
    }
};

// Rows r0 .. r0 + NR - 1 of a work item against one step's keys (k0 .. k0 + 16 * KT - 1, the first
// `valid` of them present): scores, online-softmax update, and the probability-weighted V added to
// the rows' float32 accumulators. A row that sees none of the step's keys (causal, or outside the
// window) gets all-zero probabilities and keeps its state.
template <int DC, bool BF16, int NR>
inline void rows_x_tile(const Tile<DC, BF16>& tile, int64_t r0, int64_t pos0, int64_t G, int64_t k0, __m512i key,
                        int valid, const Shape& s, const float* qs, float* acc, float* mx, float* sum) {
    constexpr int D = 16 * DC;
    __m512 sc[NR][KT];
    __mmask16 ok[NR][KT];
    for (int i = 0; i < NR; ++i) {
        const int64_t pos = pos0 + (r0 + i) / G;
        for (int t = 0; t < KT; ++t) {
            sc[i][t] = _mm512_setzero_ps();
            const __m512i kt = _mm512_add_epi32(key, _mm512_set1_epi32(16 * t));
            ok[i][t] = _mm512_cmp_epi32_mask(kt, _mm512_set1_epi32(static_cast<int>(pos)), _MM_CMPINT_LE);
            if (s.window > 0)
                ok[i][t] &= _mm512_cmp_epi32_mask(kt, _mm512_set1_epi32(static_cast<int>(pos - s.window)), _MM_CMPINT_GT);
        }
    }
    const int nt = (valid + 15) / 16;  // sub-tiles holding keys
    if constexpr (BF16) {
        const uint32_t* qp = reinterpret_cast<const uint32_t*>(qs) + r0 * (D / 2);
        for (int p = 0; p < D / 2; ++p) {
            __m512bh qb[NR];
            for (int i = 0; i < NR; ++i) qb[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * (D / 2) + p]));
            for (int t = 0; t < KT; ++t) {
                if (t >= nt) break;
                const __m512bh kp = (__m512bh)tile.k[t][p];
                for (int i = 0; i < NR; ++i) sc[i][t] = _mm512_dpbf16_ps(sc[i][t], qb[i], kp);
            }
        }
    } else {
        const float* qr = qs + r0 * D;
        for (int d = 0; d < D; ++d) {
            __m512 qd[NR];
            for (int i = 0; i < NR; ++i) qd[i] = _mm512_set1_ps(qr[i * D + d]);
            for (int t = 0; t < KT; ++t) {
                if (t >= nt) break;
                const __m512 kd = tile.kf[t][d];
                for (int i = 0; i < NR; ++i) sc[i][t] = _mm512_fmadd_ps(qd[i], kd, sc[i][t]);
            }
        }
    }
    // bf16: the rows' probabilities as (key, key + 1) pairs; float32: the probabilities.
    alignas(64) uint32_t pairs[BF16 ? NR : 1][8 * KT];
    alignas(64) float pf[BF16 ? 1 : NR][16 * KT];
    float alpha[NR];
    // Scores in log2 units (times log2 e), so that each probability is one exp2 of a difference;
    // the running max `mx` is kept in the same units. bf16 rounds the probabilities to 8 bits, so
    // a degree-4 exp2 suffices there; float32 takes degree 7.
    constexpr float LOG2E = 1.44269504088896341f;
    const __m512 to_log2 = _mm512_set1_ps(s.softcap > 0.f ? s.scale : s.scale * LOG2E);
    for (int i = 0; i < NR; ++i) {
        const int64_t r = r0 + i;
        __m512 si[KT];
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < nt; ++t) {
            const __m512 raw = tile.scaled ? _mm512_mul_ps(sc[i][t], _mm512_load_ps(tile.ks[t])) : sc[i][t];
            si[t] = _mm512_mul_ps(raw, to_log2);
            if (s.softcap > 0.f) si[t] = _mm512_mul_ps(softcap512(si[t], s.softcap), _mm512_set1_ps(LOG2E));
            mv = _mm512_mask_max_ps(mv, ok[i][t], mv, si[t]);
        }
        const float m_new = std::max(mx[r], _mm512_reduce_max_ps(mv));
        // m_new == -inf: the row has seen no key yet (outside the window): it keeps zero state.
        alpha[i] = m_new == -INFINITY || mx[r] == -INFINITY ? 0.f : std::exp2(mx[r] - m_new);
        mx[r] = m_new;
        const __m512 mn = _mm512_set1_ps(m_new == -INFINITY ? 0.f : m_new);
        __m512 row_sum = _mm512_mul_ps(_mm512_loadu_ps(sum + 16 * r), _mm512_set1_ps(alpha[i]));
        for (int t = 0; t < nt; ++t) {
            const __m512 d = _mm512_sub_ps(si[t], mn);
            const __m512 p = _mm512_maskz_mov_ps(ok[i][t], BF16 ? exp2_512<4>(d) : exp2_512<7>(d));
            if constexpr (BF16) {
                // The row's sum takes the bf16-rounded probabilities that the product uses, so the
                // normalisation matches the numerator.
                // Over an int8 cache the product takes p times V's scale (tile.vs), the sum p alone.
                const __m256i pb = (__m256i)_mm512_cvtneps_pbh(p);
                row_sum = _mm512_add_ps(row_sum, batchrun::bf16x16_to_f32(pb));
                const __m256i pv = tile.scaled ? (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(p, _mm512_load_ps(tile.vs[t]))) : pb;
                _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i] + 8 * t), pv);
            } else {
                row_sum = _mm512_add_ps(row_sum, p);
                _mm512_store_ps(pf[i] + 16 * t, p);
            }
        }
        _mm512_storeu_ps(sum + 16 * r, row_sum);
    }
    __m512 av[NR][DC];
    for (int i = 0; i < NR; ++i)
        for (int c = 0; c < DC; ++c)
            av[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + 16 * c), _mm512_set1_ps(alpha[i]));
    if constexpr (BF16) {
        for (int jp = 0; 2 * jp < valid; ++jp) {
            __m512bh pb[NR];
            for (int i = 0; i < NR; ++i) pb[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i][jp]));
            for (int c = 0; c < DC; ++c) {
                const __m512bh vv = (__m512bh)tile.v[jp][c];
                for (int i = 0; i < NR; ++i) av[i][c] = _mm512_dpbf16_ps(av[i][c], pb[i], vv);
            }
        }
    } else {
        for (int j = 0; j < valid; ++j) {
            __m512 pj[NR];
            for (int i = 0; i < NR; ++i) pj[i] = _mm512_set1_ps(pf[i][j]);
            for (int c = 0; c < DC; ++c) {
                const __m512 vv = tile.vf[j][c];
                for (int i = 0; i < NR; ++i) av[i][c] = _mm512_fmadd_ps(pj[i], vv, av[i][c]);
            }
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + (r0 + i) * D + 16 * c, av[i][c]);
}

// Attention of query positions [pos0, pos0 + nq) of one sequence, the G query heads of KV head h,
// over keys [0, pos] of each (within the window), read through `table`.
template <int DC, bool BF16>
void prefill_item(const void* q, int64_t q_row0, int64_t pos0, int64_t nq, int64_t h, const Shape& s,
                  const void* k_cache, const void* v_cache, const int64_t* table, void* out,
                  std::vector<float>& scratch) {
    constexpr int D = 16 * DC;
    const int64_t G = s.num_heads / s.num_kv_heads;
    const int64_t R = nq * G;  // row r: position pos0 + r / G, head h * G + r % G
    // scratch: float32 accumulators (R x D), running max (R) and sum (R x 16 lanes, reduced at the
    // end instead of once per tile), queries (R x D: bf16 pairs as uint32 words, or float32), and
    // a Tile (aligned inside).
    const size_t tile_floats = sizeof(Tile<DC, BF16>) / sizeof(float) + 16;
    scratch.resize(static_cast<size_t>(R * D + R + 16 * R + R * D) + tile_floats);
    float* acc = scratch.data();
    float* mx = acc + R * D;
    float* sum = mx + R;
    float* qs = sum + 16 * R;
    auto* tile = reinterpret_cast<Tile<DC, BF16>*>(
        (reinterpret_cast<uintptr_t>(qs + R * D) + 63) & ~uintptr_t(63));
    std::fill(acc, acc + R * D, 0.f);
    std::fill(mx, mx + R, -INFINITY);
    std::fill(sum, sum + 16 * R, 0.f);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t src = ((q_row0 + r / G) * s.num_heads + h * G + r % G) * D;
        if constexpr (BF16) std::memcpy(qs + r * (D / 2), static_cast<const uint16_t*>(q) + src, D * 2);
        else std::memcpy(qs + r * D, static_cast<const float*>(q) + src, D * 4);
    }
    const int64_t last = pos0 + nq - 1;
    const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) : 0;
    const int64_t key_align = s.fixed_key_grid ? 16 * KT : 16;
    const int64_t head_offset = h * s.stride_head;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

    for (int64_t k0 = first_key / key_align * key_align; k0 <= last; k0 += 16 * KT) {
        const int valid = static_cast<int>(std::min<int64_t>(16 * KT, last + 1 - k0));
        for (int t = 0; 16 * t < valid; ++t) {
            const int64_t k = k0 + 16 * t, blk = k / s.block_size;
            SubTile st{table[blk] * s.stride_block + head_offset + (k - blk * s.block_size) * s.stride_offset,
                       s.stride_offset, std::min(16, valid - 16 * t)};
            if (s.k_scale) {
                const int64_t at = table[blk] * s.scale_block + h * s.scale_head + (k - blk * s.block_size) * s.scale_offset;
                st.k_scale = s.k_scale + at;
                st.v_scale = s.v_scale + at;
                st.scale_stride = s.scale_offset;
            }
            tile->load(t, k_cache, v_cache, st, s.k_scale != nullptr);
        }
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0)));
        // Rows are in position order: those before the step's first key see none of it. NR rows
        // at a time share each K and V register load (one row at a time was load-bound).
        int64_t r = std::max<int64_t>(0, k0 - pos0) * G;
        for (; r + NR <= R; r += NR) rows_x_tile<DC, BF16, NR>(*tile, r, pos0, G, k0, key, valid, s, qs, acc, mx, sum);
        for (; r < R; ++r) rows_x_tile<DC, BF16, 1>(*tile, r, pos0, G, k0, key, valid, s, qs, acc, mx, sum);
    }
    for (int64_t r = 0; r < R; ++r) {
        const float total = _mm512_reduce_add_ps(_mm512_loadu_ps(sum + 16 * r));
        const float inv = total > 0.f ? 1.f / total : 0.f;
        const int64_t dst = ((q_row0 + r / G) * s.num_heads + h * G + r % G) * D;
        for (int c = 0; c < DC; ++c) {
            const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), _mm512_set1_ps(inv));
            if constexpr (BF16) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + dst + 16 * c),
                                    (__m256i)_mm512_cvtneps_pbh(o));
            } else {
                _mm512_storeu_ps(static_cast<float*>(out) + dst + 16 * c, o);
            }
        }
    }
}

#endif  // __AVX512F__

bool supported(int64_t head_dim, int bf16, int64_t block_size, int64_t stride_offset, int kv_dtype) {
#if defined(__AVX512F__)
    if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
    if (block_size % 16 != 0) return false;
    // A float cache must be of q's dtype, and the head_dim-16 gather takes int32 pair offsets; an
    // int8 cache is widened row by row.
    if (kv_dtype != 2 && (kv_dtype != bf16 || stride_offset % 2 != 0 || stride_offset * 15 > INT32_MAX / 2))
        return false;
    if (bf16) {
#if defined(__AVX512BF16__)
        return true;
#else
        return false;
#endif
    }
    return true;
#else
    (void)head_dim, (void)bf16, (void)block_size, (void)stride_offset, (void)kv_dtype;
    return false;
#endif
}

}  // namespace

extern "C" {

// 1 if batchrun_paged_prefill_attention serves this shape on this build, else 0. kv_dtype: the
// cache's element code (0 float32, 1 bf16, 2 int8); a float cache must be of q's dtype.
int batchrun_prefill_attention_supported(int64_t head_dim, int bf16, int64_t block_size, int64_t stride_offset,
                                         int kv_dtype) {
    return supported(head_dim, bf16, block_size, stride_offset, kv_dtype) ? 1 : 0;
}

// Causal attention of each sequence's query rows over its cached context (keys already written).
// q, out: (num_tokens, num_heads, head_dim) contiguous, float32 or bf16 (bf16); sequence i owns
//   rows q_starts[i] .. q_starts[i] + q_lens[i] - 1, the last q_lens[i] of its seq_lens[i] positions.
// k_cache, v_cache: element (block, offset, kv_head, d) at block * stride_block +
//   offset * stride_offset + kv_head * stride_head + d; kv_dtype 0 float32 or 1 bf16 (q's dtype),
//   or 2 int8 with k_scale, v_scale: float32 element (block, offset, kv_head) at
//   block * scale_stride_block + offset * scale_stride_offset + kv_head * scale_stride_head.
// block_tables: (num_seqs, table_stride) int64. window > 0: only keys j > i - window; softcap > 0:
//   tanh soft-capping. fixed_key_grid != 0: key steps on a grid from position 0 (Shape), so each
//   row's result is the same however the sequence's queries are chunked. Returns 0, -1 for a bad head count, -2 for a shape this build does not serve.
int batchrun_paged_prefill_attention(const void* q, int bf16, int64_t num_seqs, int64_t num_heads, int64_t head_dim,
                                     const void* k_cache, const void* v_cache, int kv_dtype, int64_t num_kv_heads,
                                     int64_t stride_block, int64_t stride_offset, int64_t stride_head,
                                     const float* k_scale, const float* v_scale, int64_t scale_stride_block,
                                     int64_t scale_stride_offset, int64_t scale_stride_head, int64_t block_size, const int64_t* block_tables, int64_t table_stride,
                                     const int64_t* q_starts, const int64_t* q_lens, const int64_t* seq_lens,
                                     float scale, float softcap, int64_t window, int fixed_key_grid, void* out,
                                     int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (!supported(head_dim, bf16, block_size, stride_offset, kv_dtype)) return -2;
    if (kv_dtype == 2 && (k_scale == nullptr || v_scale == nullptr)) return -2;
#if defined(__AVX512F__)
    // Work items, largest first: (sequence, chunk) pairs by descending last position, times KV heads.
    std::vector<std::pair<int64_t, int64_t>> chunks;  // (sequence, first query index within it)
    for (int64_t i = 0; i < num_seqs; ++i)
        for (int64_t c = 0; c < q_lens[i]; c += QCHUNK) chunks.emplace_back(i, c);
    std::sort(chunks.begin(), chunks.end(), [&](const auto& a, const auto& b) {
        return seq_lens[a.first] - q_lens[a.first] + a.second > seq_lens[b.first] - q_lens[b.first] + b.second;
    });
    const bool int8 = kv_dtype == 2;
    const Shape s{num_heads, num_kv_heads, block_size, stride_block, stride_offset, stride_head, scale, softcap, window,
                  fixed_key_grid != 0, int8 ? k_scale : nullptr, int8 ? v_scale : nullptr, scale_stride_block, scale_stride_offset,
                  scale_stride_head};
    const int64_t items = static_cast<int64_t>(chunks.size()) * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const auto [i, c] = chunks[item / num_kv_heads];
            const int64_t h = item % num_kv_heads;
            const int64_t nq = std::min(QCHUNK, q_lens[i] - c);
            const int64_t pos0 = seq_lens[i] - q_lens[i] + c;
            const int64_t* table = block_tables + i * table_stride;
            const int64_t row0 = q_starts[i] + c;
#define BATCHRUN_ITEM(DC, BF)                                                                                   \
    prefill_item<DC, BF>(q, row0, pos0, nq, h, s, k_cache, v_cache, table, out, scratch)
#define BATCHRUN_DIMS(BF)                                 \
    switch (head_dim) {                                   \
        case 16: BATCHRUN_ITEM(1, BF); break;             \
        case 32: BATCHRUN_ITEM(2, BF); break;             \
        case 64: BATCHRUN_ITEM(4, BF); break;             \
        case 128: BATCHRUN_ITEM(8, BF); break;            \
        default: BATCHRUN_ITEM(16, BF); break;            \
    }
            if (bf16) {
#if defined(__AVX512BF16__)
                BATCHRUN_DIMS(true)
#endif
            } else {
                BATCHRUN_DIMS(false)
            }
#undef BATCHRUN_DIMS
#undef BATCHRUN_ITEM
        }
    }
    return 0;
#else
    return -2;
#endif
}

}  // extern "C"
