// bf16 linear layers (y = x @ W.T + b) on AVX512-BF16 dot products, weights packed once at load
// (batchrun/kernels/cpu_linear.py: NativeLinear).
//
// Why not oneDNN: at a decode step's row counts every weight byte comes from DRAM once per step,
// and oneDNN's packed GEMM does not overlap that stream with its arithmetic: SmolLM2's 120
// projections at 32 rows took 13.7 ms cold against 9.2 ms with the weights in cache. This kernel
// prefetches the next weight tile while it computes the current one and runs the 120 projections
// in 9.7 ms (5.1 vs 6.8 ms at 1 row, and within noise of oneDNN at 512 rows).
//
// Layout: W (N, K) is packed as tiles of 32 output columns: [N / 32][K / 2][32][2], so one k-pair
// step of a tile is two 64-byte vectors of (k, k + 1) pairs, the operand of vdpbf16ps. A micro
// kernel keeps up to 12 rows x 32 columns of float32 accumulators in registers (24 zmm) and
// broadcasts each row's (k, k + 1) pair of x. Accumulation is float32 over k in order, bias added
// in float32, one round-to-nearest-even to bf16 at the end (F.linear's semantics; the sums are
// ordered differently from oneDNN's, so results can differ from it in the last bf16 bit).
//
// Plain C ABI (ctypes), OpenMP from torch's libgomp, like the other kernels here.
#include <cstdint>
#include <cstring>

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

// Rows [0, R) of x times one weight tile -> 32 columns of y. `pf` (or null): bytes of the next
// tile to prefetch into L2 while this one computes, spread evenly over the k steps.
template <int R>
void micro(const uint16_t* x, int64_t ldx, const uint32_t* tile, int64_t kp_count, const float* bias, uint16_t* y,
           int64_t ldy, const char* pf, int64_t pf_bytes) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
    const int64_t pf_per_step = pf ? ((pf_bytes / kp_count + 63) & ~int64_t(63)) : 0;
    for (int64_t kp = 0; kp < kp_count; ++kp) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + kp * TILE_N);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + kp * TILE_N + 16);
        for (int64_t b = 0; b < pf_per_step; b += 64) _mm_prefetch(pf + kp * pf_per_step + b, _MM_HINT_T1);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][kp]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_loadu_ps(bias);
        b1 = _mm512_loadu_ps(bias + 16);
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1)));
    }
}

void rows(int64_t m, const uint16_t* x, int64_t ldx, const uint32_t* tile, int64_t kp_count, const float* bias,
          uint16_t* y, int64_t ldy, const char* pf, int64_t pf_bytes) {
    switch (m) {
#define BATCHRUN_ROWS(n) \
    case n: micro<n>(x, ldx, tile, kp_count, bias, y, ldy, pf, pf_bytes); break;
        BATCHRUN_ROWS(1) BATCHRUN_ROWS(2) BATCHRUN_ROWS(3) BATCHRUN_ROWS(4) BATCHRUN_ROWS(5) BATCHRUN_ROWS(6)
        BATCHRUN_ROWS(7) BATCHRUN_ROWS(8) BATCHRUN_ROWS(9) BATCHRUN_ROWS(10) BATCHRUN_ROWS(11) BATCHRUN_ROWS(12)
#undef BATCHRUN_ROWS
        default: break;
    }
}

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
    const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t items = tiles * chunks;  // tile-major: a thread's items run along its tiles
    const auto* xp = static_cast<const uint16_t*>(x);
    auto* yp = static_cast<uint16_t*>(y);
    const auto* wp = static_cast<const char*>(packed);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = items * tid / nt, last = items * (tid + 1) / nt;
        for (int64_t item = first; item < last; ++item) {
            const int64_t t = item / chunks, r_begin = (item % chunks) * ROW_CHUNK;
            const int64_t r_end = r_begin + ROW_CHUNK < m ? r_begin + ROW_CHUNK : m;
            const auto* tile = reinterpret_cast<const uint32_t*>(wp + t * tile_bytes);
            // The next tile this thread will need, fetched while the first rows of this one run.
            const char* pf = (item % chunks == chunks - 1 && t + 1 < tiles && item + 1 < last)
                                 ? wp + (t + 1) * tile_bytes : nullptr;
            for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
                const int64_t rows_here = r_end - r0 < MR ? r_end - r0 : MR;
                rows(rows_here, xp + r0 * ldx, ldx, tile, kp_count, bias ? bias + t * TILE_N : nullptr,
                     yp + r0 * ldy + t * TILE_N, ldy, r0 == r_begin ? pf : nullptr, tile_bytes);
            }
        }
    }
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
