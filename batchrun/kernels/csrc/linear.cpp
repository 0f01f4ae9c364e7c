// bf16 linear layers (y = x @ W.T + b) on AVX512-BF16 dot products, weights packed once at load
// (batchrun/kernels/cpu_linear.py: native_linear; the module: batchrun/model/linear.py: NativeLinear).
//
// Why not oneDNN: at a decode step's row counts every weight byte comes from DRAM once per step,
// and oneDNN's packed GEMM does not overlap that stream with its arithmetic. This kernel
// prefetches the next weight tile while it computes the current one (figures: docs/benchmarks.md).
//
// Layout: W (N, K) is packed as tiles of 32 output columns: [N / 32][K / 2][32][2], so one k-pair
// step of a tile is two 64-byte vectors of (k, k + 1) pairs, the operand of vdpbf16ps. A micro
// kernel keeps up to 12 rows x 32 columns of float32 accumulators in registers (24 zmm) and
// broadcasts each row's (k, k + 1) pair of x. Accumulation is float32 over k in order, bias added
// in float32, one round-to-nearest-even to bf16 at the end (F.linear's semantics; the sums are
// ordered differently from oneDNN's, so results can differ from it in the last bf16 bit).
//
// A silu MLP's gate/up projection runs the same micro kernel with silu(gate) * up applied in its
// store (silu_mul_pair), which removes the activation pass and its (M, 2N) intermediate.
//
// Plain C ABI (ctypes), OpenMP from torch's libgomp, like the other kernels here.
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "quant_rows.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#define BATCHRUN_LINEAR_BF16 1
#endif

namespace {

constexpr int64_t TILE_N = 32;  // output columns per weight tile
constexpr int MR = 12;  // rows per micro kernel: 12 x 2 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t ROW_CHUNK = 96;  // rows per work item when rows are split across threads too

#if defined(BATCHRUN_LINEAR_BF16)

// Each k step of a tile is 128 bytes of weights (32 columns x one bf16 pair or int8 quad), so the
// next tile (or null), the same size, is prefetched into L2 two cache lines per step.
inline void prefetch_step(const char* pf, int64_t step) {
    if (pf) {
        _mm_prefetch(pf + step * 128, _MM_HINT_T1);
        _mm_prefetch(pf + step * 128 + 64, _MM_HINT_T1);
    }
}

// Rows [0, R) of a tile's output, float32 sums for columns 0-15 (c0) and 16-31 (c1): plus bias
// (32 float32, or null), one rounding to bf16, stored.
template <int R>
inline void store_tile(const __m512* c0, const __m512* c1, const float* bias, uint16_t* y, int64_t ldy) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_loadu_ps(bias);
        b1 = _mm512_loadu_ps(bias + 16);
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c0[r], b0)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c1[r], b1)));
    }
}

// f(std::integral_constant<int, m>) for 1 <= m <= MR: the micro kernels' row count is a template
// argument (their accumulators live in registers).
template <typename F>
inline void with_rows(int64_t m, F&& f) {
    switch (m) {
#define BATCHRUN_ROWS(n) \
    case n: f(std::integral_constant<int, n>{}); break;
        BATCHRUN_ROWS(1) BATCHRUN_ROWS(2) BATCHRUN_ROWS(3) BATCHRUN_ROWS(4) BATCHRUN_ROWS(5) BATCHRUN_ROWS(6)
        BATCHRUN_ROWS(7) BATCHRUN_ROWS(8) BATCHRUN_ROWS(9) BATCHRUN_ROWS(10) BATCHRUN_ROWS(11) BATCHRUN_ROWS(12)
#undef BATCHRUN_ROWS
        default: break;
    }
}

// The work split the kernels share, inside one parallel region: `prologue()` runs first on every
// thread (it may hold an omp for, whose barrier ends it), then body(t, r0, rows, pf) for every block
// of up to MR rows of every weight tile t. Items are (tile, chunk of ROW_CHUNK rows), tile-major,
// in contiguous runs per thread; `pf`, for the first row block of a tile's last chunk, is the next
// tile when the same thread goes on to it (else null).
template <typename Prologue, typename Body>
void for_each_tile_block(int64_t m, int64_t tiles, int64_t tile_bytes, const char* weights, int num_threads,
                         Prologue&& prologue, Body&& body) {
    const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK, items = tiles * chunks;
#pragma omp parallel num_threads(num_threads)
    {
        prologue();
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = items * tid / nt, last = items * (tid + 1) / nt;
        for (int64_t item = first; item < last; ++item) {
            const int64_t t = item / chunks, r_begin = (item % chunks) * ROW_CHUNK;
            const int64_t r_end = r_begin + ROW_CHUNK < m ? r_begin + ROW_CHUNK : m;
            const char* pf = (item % chunks == chunks - 1 && t + 1 < tiles && item + 1 < last)
                                 ? weights + (t + 1) * tile_bytes : nullptr;
            for (int64_t r0 = r_begin; r0 < r_end; r0 += MR)
                body(t, r0, r_end - r0 < MR ? r_end - r0 : MR, r0 == r_begin ? pf : nullptr);
        }
    }
}

// Rows [0, R) of x times one weight tile: 32 columns of float32 sums per row, handed to
// store(c0, c1) (columns 0-15 and 16-31 of each row); `pf`: the next tile, or null.
template <int R, typename Store>
__attribute__((noinline)) void micro(const uint16_t* x, int64_t ldx, const uint32_t* tile, int64_t kp_count,
                                     const char* pf, Store&& store) {
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
        acc0[r] = _mm512_setzero_ps();
        acc1[r] = _mm512_setzero_ps();
    }
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
    for (int64_t kp = 0; kp < kp_count; ++kp) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + kp * TILE_N);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + kp * TILE_N + 16);
        prefetch_step(pf, kp);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][kp]));
            acc0[r] = _mm512_dpbf16_ps(acc0[r], xb, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], xb, w1);
        }
    }
    store(static_cast<const __m512*>(acc0), static_cast<const __m512*>(acc1));
}

// The gate/up pair store shared by silu_mul_pair and w4a8_silu_quant_pair: the gate tile's sums
// plus bias, rounded to bf16 as store_tile rounds them, wait in `gate` (L1); with the up tile's
// sums, `product` gives silu(gate) * up as batchrun_silu_mul_bf16 computes it, before its final
// rounding to bf16. `bias`: 64 float32 (gate's 32, then up's), or null.
struct SiluPair {
    __m512 gate[MR][2];
    __m512 bias[4];

    explicit SiluPair(const float* b) {
        for (int i = 0; i < 4; ++i) bias[i] = b ? _mm512_loadu_ps(b + 16 * i) : _mm512_setzero_ps();
    }

    // acc + b rounded to bf16 (as store_tile stores it), read back as float32.
    static __m512 projected(__m512 acc, __m512 b) {
        return batchrun::bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, b)));
    }

    void keep_gate(int r, __m512 c0, __m512 c1) {
        gate[r][0] = projected(c0, bias[0]);
        gate[r][1] = projected(c1, bias[1]);
    }

    // Columns 16 h .. 16 h + 15 of row r, from the up tile's sums `up` of those columns.
    __m512 product(int r, int h, __m512 up) const {
        return _mm512_mul_ps(batchrun::round_bf16_512(batchrun::silu512(gate[r][h])), projected(up, bias[2 + h]));
    }
};

// A gate/up projection with silu(gate) * up fused into its tile store (the activation pass and the
// (M, 2N) intermediate of the unfused pair disappear). The weight's rows are permuted at load so
// that tiles alternate gate and up columns of the same 32 outputs: tile 2t = gate columns
// 32t .. 32t + 31, tile 2t + 1 = the matching up columns; a work unit is that pair. For each block
// of rows the gate tile's sums go to a small float32 scratch (L1), then the up tile's store
// combines them. Gate and up are rounded to bf16 as the unfused projection's store rounds them,
// and silu and the product are computed exactly as batchrun_silu_mul_bf16 computes them, so the
// result is bitwise that of the two passes.
template <int R>
void silu_mul_pair(const uint16_t* x, int64_t ldx, const uint32_t* pair, int64_t kp_count, const float* bias,
                   uint16_t* y, int64_t ldy, const char* pf) {
    SiluPair sp(bias);
    micro<R>(x, ldx, pair, kp_count, pf, [&](const __m512* c0, const __m512* c1) {
        for (int r = 0; r < R; ++r) sp.keep_gate(r, c0[r], c1[r]);
    });
    micro<R>(x, ldx, pair + kp_count * TILE_N, kp_count, pf ? pf + kp_count * TILE_N * 4 : nullptr,
             [&](const __m512* c0, const __m512* c1) {
        for (int r = 0; r < R; ++r) {
            batchrun::store_bf16(y + r * ldy, sp.product(r, 0, c0[r]));
            batchrun::store_bf16(y + r * ldy + 16, sp.product(r, 1, c1[r]));
        }
    });
}

#if defined(__AVX512VNNI__)
#define BATCHRUN_W8A8 1

// W8A8: rows [0, R) of per-token int8 activations times one int8 weight tile (32 columns), then
// (acc * w_scale) * x_scale in float32, plus the float outlier channels (bf16 pairs, dot products
// into the same float32 registers), plus bias, one rounding to bf16. vpdpbusd multiplies unsigned
// by signed bytes, and only its signed operand can be a broadcast from memory: the weight is
// stored as w + 128 (unsigned) and x broadcast as it is, and 128 * (the row's sum of x) taken
// off again, so the int32 sum is exactly that of x * w.
// acc += a (unsigned bytes) . b (signed bytes), four products per int32 lane. Inline asm: GCC's
// register allocation around the _mm512_dpbusd_epi32 builtin spilled most of the 24 accumulators
// to the stack on every step (the bf16 builtin does not), which halved the kernel's speed.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

template <int R>
__attribute__((noinline)) void w8a8_micro(const int8_t* xq, int64_t ldq, const float* sx, const uint32_t* tile, int64_t kq_count,
                const int32_t* rowsum128, const float* sw, const uint16_t* xo, int64_t ldo, const uint32_t* otile,
                int64_t op_count, const float* bias, uint16_t* y, int64_t ldy, const char* pf) {
    __m512i acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
        acc0[r] = _mm512_setzero_si512();
        acc1[r] = _mm512_setzero_si512();
    }
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(xq + r * ldq);
    for (int64_t kq = 0; kq < kq_count; ++kq) {
        const __m512i w0 = _mm512_loadu_si512(tile + kq * TILE_N);
        const __m512i w1 = _mm512_loadu_si512(tile + kq * TILE_N + 16);
        prefetch_step(pf, kq);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            const __m512i xb = _mm512_set1_epi32(static_cast<int>(xr[r][kq]));
            acc0[r] = dpbusd(acc0[r], w0, xb);
            acc1[r] = dpbusd(acc1[r], w1, xb);
        }
    }
    const __m512 s0 = _mm512_loadu_ps(sw), s1 = _mm512_loadu_ps(sw + 16);
    __m512 f0[R], f1[R];
    for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(sx[r]);
        const __m512i c = _mm512_set1_epi32(rowsum128[r]);
        f0[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc0[r], c)), s0), xs);
        f1[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc1[r], c)), s1), xs);
    }
    for (int64_t op = 0; op < op_count; ++op) {
        const __m512bh o0 = (__m512bh)_mm512_loadu_si512(otile + op * TILE_N);
        const __m512bh o1 = (__m512bh)_mm512_loadu_si512(otile + op * TILE_N + 16);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(
                static_cast<int>(reinterpret_cast<const uint32_t*>(xo + r * ldo)[op]));
            f0[r] = _mm512_dpbf16_ps(f0[r], xb, o0);
            f1[r] = _mm512_dpbf16_ps(f1[r], xb, o1);
        }
    }
    store_tile<R>(f0, f1, bias, y, ldy);
}

// W4A8: int4 weights in groups of 32 along K (w = q * scale + min, q in [0, 15]) times int8
// activations quantized in groups of 32 along K (x = xq * x_scale), llama.cpp's Q4_1 x Q8_1
// scheme. Each group's integer dot product is exact (vpdpbusd: q is its unsigned operand as it is,
// xq the signed one), then added into float32 sums with both scales, and the min term added from
// the group's x_scale * sum(xq):
//   y[r, n] = sum_g (dot_g(q, xq) * x_scale[r, g]) * w_scale[n, g] + w_min[n, g] * x_sum[r, g].
// Tile layout: [N / 32][K / 4][64] bytes, a k-quad step of 32 columns in one 64-byte vector whose
// low nibbles are columns 0-15 and high nibbles columns 16-31 (each byte of either half: the 4 k of
// one column, as vpdpbusd reads them). The high nibbles are read in place, as 16 q (one AND, no
// shift), so columns 16-31's scales are stored divided by 16 (exact). Scales and mins: float32
// [N / 32][K / 32][32].
// Up to 6 rows per call: 12 int32 and 12 float32 accumulators, the two weight halves and the
// group's scales and mins fit the 32 registers.
constexpr int W4_MR = 6;
constexpr int64_t W4_GROUP = 32;

// The float32 sums of rows [0, R) go to store(f0, f1) (columns 0-15 and 16-31 of each row).
template <int R, typename Store>
__attribute__((noinline)) void w4a8_micro(const int8_t* xq, int64_t ldq, const float* xs, const float* xsum,
                                          int64_t ldg, const uint8_t* tile, int64_t groups, const float* ws,
                                          const float* wm, const char* pf, Store&& store) {
    __m512 f0[R], f1[R];
    for (int r = 0; r < R; ++r) {
        f0[r] = _mm512_setzero_ps();
        f1[r] = _mm512_setzero_ps();
    }
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
    constexpr int64_t steps = W4_GROUP / 4;
    for (int64_t g = 0; g < groups; ++g) {
        __m512i a0[R], a1[R];
        for (int r = 0; r < R; ++r) {
            a0[r] = _mm512_setzero_si512();
            a1[r] = _mm512_setzero_si512();
        }
        const uint8_t* tg = tile + g * steps * 64;
        for (int64_t s = 0; s < steps; ++s) {
            const __m512i v = _mm512_loadu_si512(tg + s * 64);
            const __m512i w0 = _mm512_and_si512(v, low);
            const __m512i w1 = _mm512_and_si512(v, high);  // 16 q: its scales are stored / 16
            if (pf) _mm_prefetch(pf + (g * steps + s) * 64, _MM_HINT_T1);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                std::memcpy(&quad, xq + r * ldq + g * W4_GROUP + s * 4, 4);
                const __m512i xb = _mm512_set1_epi32(quad);
                a0[r] = dpbusd(a0[r], w0, xb);
                a1[r] = dpbusd(a1[r], w1, xb);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(ws + g * TILE_N), d1 = _mm512_loadu_ps(ws + g * TILE_N + 16);
        const __m512 m0 = _mm512_loadu_ps(wm + g * TILE_N), m1 = _mm512_loadu_ps(wm + g * TILE_N + 16);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m512 sx = _mm512_set1_ps(xs[r * ldg + g]), sm = _mm512_set1_ps(xsum[r * ldg + g]);
            f0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0[r]), sx), d0, f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1[r]), sx), d1, f1[r]);
            f0[r] = _mm512_fmadd_ps(m0, sm, f0[r]);
            f1[r] = _mm512_fmadd_ps(m1, sm, f1[r]);
        }
    }
    store(static_cast<const __m512*>(f0), static_cast<const __m512*>(f1));
}

// A silu MLP's gate/up projection in W4A8 with silu(gate) * up and the down projection's input
// quantization (groups of 32) fused into its store: tiles alternate gate and up columns of the same
// 32 outputs (as in silu_mul_pair), and those 32 outputs of a row are exactly one group of the down
// projection's input. Gate and up are rounded to bf16 as the plain layer's store rounds them, the
// product as batchrun_silu_mul_bf16 computes it, and the group quantized as
// batchrun_quantize_groups_int8 quantizes it: bitwise the three passes, without the (M, 2N) and
// (M, N) bf16 intermediates. q: (M, N) int8 (row stride ldo), scales and sums: (M, N / 32).
template <int R>
void w4a8_silu_quant_pair(const int8_t* xq, int64_t ldq, const float* xs, const float* xsum, int64_t ldg,
                          const uint8_t* pair, int64_t groups, const float* ws, const float* wm, const float* bias,
                          int8_t* q, int64_t ldo, float* q_scales, float* q_sums, int64_t ld_out_groups,
                          const char* pf) {
    SiluPair sp(bias);
    const int64_t tile_bytes = groups * W4_GROUP / 4 * 64, tile_scales = groups * TILE_N;
    w4a8_micro<R>(xq, ldq, xs, xsum, ldg, pair, groups, ws, wm, pf, [&](const __m512* f0, const __m512* f1) {
        for (int r = 0; r < R; ++r) sp.keep_gate(r, f0[r], f1[r]);
    });
    w4a8_micro<R>(xq, ldq, xs, xsum, ldg, pair + tile_bytes, groups, ws + tile_scales, wm + tile_scales,
                  pf ? pf + tile_bytes : nullptr, [&](const __m512* f0, const __m512* f1) {
        for (int r = 0; r < R; ++r)  // the bf16 values batchrun_silu_mul_bf16 stores, quantized
            batchrun::quantize_group32(batchrun::round_bf16_512(sp.product(r, 0, f0[r])),
                                       batchrun::round_bf16_512(sp.product(r, 1, f1[r])), q + r * ldo,
                                       q_scales + r * ld_out_groups, q_sums + r * ld_out_groups);
    });
}

// The W4A8 kernels' activations: either quantized by the caller (xq, scales, sums), or bf16 rows
// quantized here in groups of 32 (quantize_group32, bitwise kernels/w4a8.py: quantize_groups_int8)
// by `quantize()`, which every thread of the kernel's parallel region calls first (its omp for
// ends in a barrier). The second saves a decode step's per-projection pass and its allocations.
struct W4A8Input {
    const int8_t* xq;
    const float* scales;
    const float* sums;
    int64_t ldq;
    const uint16_t* x = nullptr;  // bf16 rows to quantize, or null
    int64_t ldx = 0, m = 0, k = 0;
    std::unique_ptr<int8_t[]> q_buf;
    std::unique_ptr<float[]> s_buf, m_buf;

    W4A8Input(const void* xq_, const float* scales_, const float* sums_, int64_t ldq_, const void* x_, int64_t ldx_,
              int64_t m_, int64_t k_)
        : xq(static_cast<const int8_t*>(xq_)), scales(scales_), sums(sums_), ldq(ldq_),
          x(static_cast<const uint16_t*>(x_)), ldx(ldx_), m(m_), k(k_) {
        if (!x) return;
        const int64_t groups = k / W4_GROUP;
        q_buf.reset(new int8_t[static_cast<size_t>(m * k)]);
        s_buf.reset(new float[static_cast<size_t>(m * groups)]);
        m_buf.reset(new float[static_cast<size_t>(m * groups)]);
        xq = q_buf.get(), scales = s_buf.get(), sums = m_buf.get(), ldq = k;
    }

    void quantize() {
        if (!x) return;
        const int64_t groups = k / W4_GROUP;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t g = 0; g < groups; ++g) {
                const uint16_t* xr = x + r * ldx + g * W4_GROUP;
                batchrun::quantize_group32(batchrun::load_bf16x16(xr), batchrun::load_bf16x16(xr + 16),
                                           q_buf.get() + r * k + g * W4_GROUP, s_buf.get() + r * groups + g,
                                           m_buf.get() + r * groups + g);
            }
    }
};

#endif  // __AVX512VNNI__

#endif  // BATCHRUN_LINEAR_BF16

}  // namespace

extern "C" {

// 1 if batchrun_linear_bf16 serves an (N, K) weight on this build: AVX512-BF16, N a multiple of
// 32, K even.
int batchrun_linear_bf16_supported(int64_t n, int64_t k) {
#if defined(BATCHRUN_LINEAR_BF16)
    return n > 0 && k > 0 && n % TILE_N == 0 && k % 2 == 0 ? 1 : 0;
#else
    (void)n, (void)k;
    return 0;
#endif
}

// y (M, N) bf16, row stride ldy = x (M, K) bf16, row stride ldx, times the packed weight, plus
// bias (N float32, or null). Returns 0, or -2 for a shape this build does not serve.
int batchrun_linear_bf16(const void* x, int64_t m, int64_t k, int64_t ldx, const void* packed, int64_t n,
                         const float* bias, void* y, int64_t ldy, int num_threads) {
    if (!batchrun_linear_bf16_supported(n, k)) return -2;
#if defined(BATCHRUN_LINEAR_BF16)
    const int64_t kp_count = k / 2, tiles = n / TILE_N, tile_bytes = kp_count * TILE_N * 4;
    const auto* xp = static_cast<const uint16_t*>(x);
    auto* yp = static_cast<uint16_t*>(y);
    const auto* wp = static_cast<const char*>(packed);
    for_each_tile_block(m, tiles, tile_bytes, wp, num_threads, [] {},
                        [&](int64_t t, int64_t r0, int64_t rows, const char* pf) {
        with_rows(rows, [&](auto r) {
            constexpr int R = decltype(r)::value;
            const float* b = bias ? bias + t * TILE_N : nullptr;
            uint16_t* out = yp + r0 * ldy + t * TILE_N;
            micro<R>(xp + r0 * ldx, ldx, reinterpret_cast<const uint32_t*>(wp + t * tile_bytes), kp_count, pf,
                     [&](const __m512* c0, const __m512* c1) { store_tile<R>(c0, c1, b, out, ldy); });
        });
    });
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -2;
#endif
}

// y (M, N) bf16 = silu(x W_gate^T + b_gate) * (x W_up^T + b_up), from a (2N, K) gate/up weight
// packed with its tiles alternating gate and up (see silu_mul_pair) and its bias (2N float32 in
// the same permuted order, or null). Returns 0, or -2 for a shape this build does not serve.
int batchrun_linear_silu_mul_bf16(const void* x, int64_t m, int64_t k, int64_t ldx, const void* packed, int64_t n,
                                  const float* bias, void* y, int64_t ldy, int num_threads) {
    if (!batchrun_linear_bf16_supported(2 * n, k) || n % TILE_N != 0) return -2;
#if defined(BATCHRUN_LINEAR_BF16)
    const int64_t kp_count = k / 2, pairs = n / TILE_N, pair_bytes = 2 * kp_count * TILE_N * 4;
    const auto* xp = static_cast<const uint16_t*>(x);
    auto* yp = static_cast<uint16_t*>(y);
    const auto* wp = static_cast<const char*>(packed);
    for_each_tile_block(m, pairs, pair_bytes, wp, num_threads, [] {},
                        [&](int64_t t, int64_t r0, int64_t rows, const char* pf) {
        with_rows(rows, [&](auto r) {
            silu_mul_pair<decltype(r)::value>(xp + r0 * ldx, ldx, reinterpret_cast<const uint32_t*>(wp + t * pair_bytes),
                                              kp_count, bias ? bias + t * 2 * TILE_N : nullptr,
                                              yp + r0 * ldy + t * TILE_N, ldy, pf);
        });
    });
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -2;
#endif
}


// 1 if batchrun_w8a8_linear serves an (N, K) int8 weight with n_out float channels on this build:
// AVX512-VNNI and BF16, N a multiple of 32, K a multiple of 4, n_out even.
int batchrun_w8a8_linear_supported(int64_t n, int64_t k, int64_t n_out) {
#if defined(BATCHRUN_W8A8)
    return n > 0 && k > 0 && n % TILE_N == 0 && k % 4 == 0 && n_out >= 0 && n_out % 2 == 0 ? 1 : 0;
#else
    (void)n, (void)k, (void)n_out;
    return 0;
#endif
}

// y (M, N) bf16 = ((xq @ Wq.T) * w_scales) * x_scales + xo @ Wo.T + bias, where
// xq: (M, K) int8 (row stride ldq), x_scales: (M,) float32, packed: Wq + 128 as uint8 tiles
// [N / 32][K / 4][32][4] (the unsigned operand of vpdpbusd), w_scales: (N,) float32,
// xo: (M, n_out) bf16 (row stride ldo) the float channels' activations, or null with n_out = 0,
// packed_out: Wo (N, n_out) in batchrun_linear_bf16's tiles, bias: (N,) float32 or null. Or, with
// x (M, K) bf16 (row stride ldx) non-null, xq, x_scales and xo are made here from x as
// batchrun_quantize_per_token_int8 makes them (skip: (K,) uint8 or null, the float channels' mask;
// gather_idx: their n_out int64 column indices), and the xq, x_scales, xo arguments are ignored.
int batchrun_w8a8_linear(const void* xq, int64_t m, int64_t k, int64_t ldq, const float* x_scales, const void* x,
                         int64_t ldx, const void* skip, const void* gather_idx, const void* packed,
                         const float* w_scales, int64_t n, const void* xo, int64_t n_out,
                         int64_t ldo, const void* packed_out, const float* bias, void* y, int64_t ldy,
                         int num_threads) {
    if (!batchrun_w8a8_linear_supported(n, k, n_out)) return -2;
#if defined(BATCHRUN_W8A8)
    const int64_t kq_count = k / 4, op_count = n_out / 2, tiles = n / TILE_N;
    const int64_t tile_bytes = kq_count * TILE_N * 4, otile_bytes = op_count * TILE_N * 4;
    // With x (bf16 rows, ldx apart) the kernel quantizes it itself (quant_rows.h, bitwise the
    // standalone pass), and gathers the float channels, in its prologue.
    std::unique_ptr<int8_t[]> q_buf;
    std::unique_ptr<float[]> s_buf;
    std::unique_ptr<uint16_t[]> o_buf;
    if (x) {
        q_buf.reset(new int8_t[static_cast<size_t>(m * k)]);
        s_buf.reset(new float[static_cast<size_t>(m)]);
        if (n_out) o_buf.reset(new uint16_t[static_cast<size_t>(m * n_out)]);
        xq = q_buf.get(), ldq = k, x_scales = s_buf.get(), xo = o_buf.get(), ldo = n_out;
    }
    const auto* xqp = static_cast<const int8_t*>(xq);
    const auto* xop = static_cast<const uint16_t*>(xo);
    const auto* xb = static_cast<const uint16_t*>(x);
    const auto* sk = static_cast<const uint8_t*>(skip);
    const auto* gi = static_cast<const int64_t*>(gather_idx);
    auto* yp = static_cast<uint16_t*>(y);
    const auto* wp = static_cast<const char*>(packed);
    const auto* op = static_cast<const char*>(packed_out);
    std::vector<int32_t> rowsum128(static_cast<size_t>(m));  // 128 * sum_k xq[r, k]
    const auto row_sums = [&] {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) {
            if (xb) {
                int8_t* qr = q_buf.get() + r * k;
                uint16_t* orow = n_out ? o_buf.get() + r * n_out : nullptr;
                rowsum128[r] = 128 * (sk ? batchrun::quantize_row<true, true>(xb + r * ldx, k, sk, qr, s_buf.get() + r,
                                                                              gi, n_out, orow)
                                         : batchrun::quantize_row<true, false>(xb + r * ldx, k, sk, qr,
                                                                               s_buf.get() + r, gi, n_out, orow));
                continue;
            }
            const int8_t* xr = xqp + r * ldq;
            int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < k; ++i) sum += xr[i];
            rowsum128[r] = 128 * sum;
        }  // the implicit barrier: every row's sum is in before any tile uses it
    };
    for_each_tile_block(m, tiles, tile_bytes, wp, num_threads, row_sums,
                        [&](int64_t t, int64_t r0, int64_t rows, const char* pf) {
        with_rows(rows, [&](auto r) {
            w8a8_micro<decltype(r)::value>(
                xqp + r0 * ldq, ldq, x_scales + r0, reinterpret_cast<const uint32_t*>(wp + t * tile_bytes), kq_count,
                rowsum128.data() + r0, w_scales + t * TILE_N, op_count ? xop + r0 * ldo : nullptr, ldo,
                op_count ? reinterpret_cast<const uint32_t*>(op + t * otile_bytes) : nullptr, op_count,
                bias ? bias + t * TILE_N : nullptr, yp + r0 * ldy + t * TILE_N, ldy, pf);
        });
    });
    return 0;
#else
    (void)xq, (void)m, (void)ldq, (void)x_scales, (void)x, (void)ldx, (void)skip, (void)gather_idx, (void)packed;
    (void)w_scales, (void)xo, (void)ldo, (void)packed_out, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -2;
#endif
}

// 1 if batchrun_w4a8_linear serves an (N, K) int4 weight on this build: AVX512-VNNI and BF16, N a
// multiple of 32, K of 32 (the group).
int batchrun_w4a8_linear_supported(int64_t n, int64_t k) {
#if defined(BATCHRUN_W8A8)
    return n > 0 && k > 0 && n % TILE_N == 0 && k % W4_GROUP == 0 ? 1 : 0;
#else
    (void)n, (void)k;
    return 0;
#endif
}

// y (M, N) bf16 = W4A8 (see w4a8_micro) + bias, where xq: (M, K) int8 (row stride ldq), x_scales
// and x_sums: (M, K / 32) float32 contiguous (a group's scale, and scale * sum of its xq), or, with
// x (M, K) bf16 (row stride ldx) non-null, x quantized here in their place (see W4A8Input), packed:
// the nibble tiles, w_scales and w_mins: float32 [N / 32][K / 32][32], bias: (N,) float32 or null.
int batchrun_w4a8_linear(const void* xq, int64_t m, int64_t k, int64_t ldq, const float* x_scales,
                         const float* x_sums, const void* x, int64_t ldx, const void* packed, const float* w_scales,
                         const float* w_mins, int64_t n, const float* bias, void* y, int64_t ldy, int num_threads) {
    if (!batchrun_w4a8_linear_supported(n, k)) return -2;
#if defined(BATCHRUN_W8A8)
    const int64_t groups = k / W4_GROUP, tiles = n / TILE_N, tile_bytes = k / 4 * 64;
    W4A8Input in(xq, x_scales, x_sums, ldq, x, ldx, m, k);
    const int8_t* xqp = in.xq;
    ldq = in.ldq, x_scales = in.scales, x_sums = in.sums;
    auto* yp = static_cast<uint16_t*>(y);
    const auto* wp = static_cast<const char*>(packed);
    for_each_tile_block(m, tiles, tile_bytes, wp, num_threads, [&] { in.quantize(); },
                        [&](int64_t t, int64_t r0, int64_t rows, const char* pf) {
        for (int64_t h = 0; h < rows; h += W4_MR) {
            const int64_t r = r0 + h;
            with_rows(rows - h < W4_MR ? rows - h : W4_MR, [&](auto rr) {
                constexpr int R = decltype(rr)::value;
                const float* b = bias ? bias + t * TILE_N : nullptr;
                uint16_t* out = yp + r * ldy + t * TILE_N;
                w4a8_micro<R>(xqp + r * ldq, ldq, x_scales + r * groups, x_sums + r * groups, groups,
                              reinterpret_cast<const uint8_t*>(wp + t * tile_bytes), groups,
                              w_scales + t * groups * TILE_N, w_mins + t * groups * TILE_N, h == 0 ? pf : nullptr,
                              [&](const __m512* f0, const __m512* f1) { store_tile<R>(f0, f1, b, out, ldy); });
            });
        }
    });
    return 0;
#else
    (void)xq, (void)m, (void)ldq, (void)x_scales, (void)x_sums, (void)x, (void)ldx, (void)packed, (void)w_scales;
    (void)w_mins, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -2;
#endif
}

// The fused silu MLP input in W4A8 (see w4a8_silu_quant_pair): x as for batchrun_w4a8_linear, the
// (2N, K) gate/up weight packed with its rows in silu pair order (its scales, mins and bias, 2N
// float32 or null, in the same order); out: q (M, N) int8 contiguous, q_scales and q_sums
// (M, N / 32) float32 contiguous, the down projection's quantized input.
int batchrun_w4a8_silu_quant(const void* xq, int64_t m, int64_t k, int64_t ldq, const float* x_scales,
                             const float* x_sums, const void* x, int64_t ldx, const void* packed,
                             const float* w_scales, const float* w_mins, int64_t n, const float* bias, void* q,
                             void* q_scales, void* q_sums, int num_threads) {
    if (!batchrun_w4a8_linear_supported(2 * n, k) || n % TILE_N != 0) return -2;
#if defined(BATCHRUN_W8A8)
    const int64_t groups = k / W4_GROUP, pairs = n / TILE_N, pair_bytes = 2 * (k / 4 * 64);
    const int64_t out_groups = n / W4_GROUP;
    W4A8Input in(xq, x_scales, x_sums, ldq, x, ldx, m, k);
    const int8_t* xqp = in.xq;
    ldq = in.ldq, x_scales = in.scales, x_sums = in.sums;
    const auto* wp = static_cast<const char*>(packed);
    auto* qp = static_cast<int8_t*>(q);
    auto* qs = static_cast<float*>(q_scales);
    auto* qm = static_cast<float*>(q_sums);
    for_each_tile_block(m, pairs, pair_bytes, wp, num_threads, [&] { in.quantize(); },
                        [&](int64_t t, int64_t r0, int64_t rows, const char* pf) {
        for (int64_t h = 0; h < rows; h += W4_MR) {
            const int64_t r = r0 + h;
            with_rows(rows - h < W4_MR ? rows - h : W4_MR, [&](auto rr) {
                w4a8_silu_quant_pair<decltype(rr)::value>(
                    xqp + r * ldq, ldq, x_scales + r * groups, x_sums + r * groups, groups,
                    reinterpret_cast<const uint8_t*>(wp + t * pair_bytes), groups, w_scales + t * 2 * groups * TILE_N,
                    w_mins + t * 2 * groups * TILE_N, bias ? bias + t * 2 * TILE_N : nullptr, qp + r * n + t * TILE_N,
                    n, qs + r * out_groups + t, qm + r * out_groups + t, out_groups, h == 0 ? pf : nullptr);
            });
        }
    });
    return 0;
#else
    (void)xq, (void)m, (void)ldq, (void)x_scales, (void)x_sums, (void)x, (void)ldx, (void)packed, (void)w_scales;
    (void)w_mins, (void)bias, (void)q, (void)q_scales, (void)q_sums, (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
