// The Gumbel race of batchrun/kernels/sampling.py on the CPU: one token per row of logits (float32
// or bf16), greedy rows an exact argmax, sampled rows argmax over the kept tokens of
// s - log E, with s = logits / temperature and E the exponential variate hashed from (seed,
// position, token id). kernels/sampling.py documents the hash and the variate; race_hash.py holds
// the constants repeated here.
//
// Every value is the reference's float32 arithmetic op by op: the same hash bits, u, series, the
// same correctly rounded division by the temperature, and no fused multiply-add (contraction is
// off for this file, whatever -ffp-contract the build passes). `log` is the correctly rounded one
// (the double log rounded to float32): torch's CPU log (SLEEF) and the GPU's may differ from it in
// the last bit, which changes a token only where two race keys are that close.
//
// The race needs few logs. A token's key is at most s + n ln2, where 2^-n <= u < 2^(1-n) is read
// off u's exponent (E >= u, so -log E <= -log u <= n ln2). One vectorized pass computes that bound
// for every token (from s approximated by x * (1 / t), with slack for every rounding on the way)
// and the exact key is computed only where the bound reaches the best key so far; the winner is
// usually among the few tokens whose u is tiny or whose logit is near the top, so a row costs about
// one hash per token. The skipped tokens' keys are provably below the best, so the winner, and the
// first index among equal keys, are the reference's.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"

namespace {

// kernels/race_hash.py
constexpr uint32_t MIX_A = 0x7FEB352Du;
constexpr uint32_t MIX_B = 0x5BD1E995u;
constexpr uint32_t C_SEED = 0x85EBCA6Bu;
constexpr uint32_t C_POS = 0x27D4EB2Fu;
constexpr float THIRD = 0.3333333432674407958984375f;  // float32(1 / 3)
constexpr float SMALL_U = 0.0078125f;                   // 2^-7
constexpr float INF = std::numeric_limits<float>::infinity();
constexpr int64_t BLOCK = 256;  // tokens whose bounds one vectorized pass computes

inline uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= MIX_A;
    x ^= x >> 15;
    x *= MIX_B;
    return x ^ (x >> 16);
}

inline uint32_t float_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

inline float bits_float(uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}

inline float log_cr(float x) { return static_cast<float>(std::log(static_cast<double>(x))); }

// u in (0, 1] from a token's hash: ((h >> 1) + 0.5) * 2^-31, each op rounded to float32.
inline float uniform_of(uint32_t h) { return (static_cast<float>(static_cast<int32_t>(h >> 1)) + 0.5f) * 0x1p-31f; }

// The race key of a kept token with scaled logit s: s - log E (E = inf, at u == 1, loses).
inline float race_key(float s, uint32_t h) {
    const float u = uniform_of(h);
    float e;
    if (u < SMALL_U) {  // u * (1 + u * (0.5 + u / 3)), rounded op by op
        e = u * THIRD;
        e = e + 0.5f;
        e = e * u;
        e = e + 1.0f;
        e = e * u;
    } else {
        e = -log_cr(1.0f - u);
    }
    return s - log_cr(e);
}

inline uint32_t row_key(int64_t seed, int64_t position) {
    const uint32_t lo = static_cast<uint32_t>(static_cast<uint64_t>(seed));
    const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
    const uint32_t key = mix(mix(hi ^ C_SEED) ^ lo);
    return mix(key ^ mix(static_cast<uint32_t>(position) ^ C_POS));
}

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) {
    return p[i];
}
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) {
    return batchrun::bf16_to_f32(p[i]);
}

// torch.argmax of a row: the first index of the maximum, or of the first NaN.
template <typename T>
int64_t argmax_row(const T* x, int64_t vocab) {
    float best = -INF;
    int64_t best_idx = 0;
    for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t n = vocab - start < BLOCK ? vocab - start : BLOCK;
        float m = -INF;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < n; ++j) {
            const float v = load(x, start + j);
            m = v > m ? v : m;
            nan |= v != v;
        }
        if (nan) {
            for (int64_t j = 0; j < n; ++j) {
                const float v = load(x, start + j);
                if (v != v) return start + j;
            }
        }
        if (m > best) {
            best = m;
            for (int64_t j = 0; j < n; ++j) {
                if (load(x, start + j) == m) {
                    best_idx = start + j;
                    break;
                }
            }
        }
    }
    return best_idx;
}

// An upper bound of s = x / t from sa = x * (1 / t), which is within 2^-21 of it relatively.
inline float upper_s(float sa) { return sa + std::fabs(sa) * 0x1p-18f; }

// An upper bound of the key of a token with s <= s_hi whose u >= 2^-n: -log E <= -log u <= n ln2,
// plus slack for the rounding of log and of the key's subtraction (kept by the sums here too).
inline float upper_key(float s_hi, int32_t n) {
    constexpr float LN2_UP = 0.693147242069244384765625f;  // float32 ln2 rounded up
    const float b = s_hi + (static_cast<float>(n) * LN2_UP + 0x1p-16f);
    return b + std::fabs(b) * 0x1p-18f;
}

// A sampled row's token. words: mix(token ^ C_TOKEN) per token (the hash's per-token half);
// keys_out: every token's key (-inf where masked), or null.
template <typename T>
int64_t race_row(const T* x, int64_t vocab, const uint32_t* words, uint32_t key, float t, float threshold,
                 float* keys_out) {
    if (keys_out != nullptr) {  // every key, in order, for the tests: the same arithmetic unpruned
        for (int64_t j = 0; j < vocab; ++j) {
            const float s = load(x, j) / t;
            keys_out[j] = s < threshold ? -INF : race_key(s, mix(key ^ words[j]));
        }
    }
    const float inv_t = 1.0f / t;
    if (!(inv_t < INF)) {  // a subnormal temperature: no bound, every key computed
        float best = -INF;
        int64_t best_idx = 0, nan_key = -1;
        for (int64_t i = 0; i < vocab; ++i) {
            const float xv = load(x, i);
            if (xv != xv) return i;
            const float s = xv / t;
            const float k = s < threshold ? -INF : race_key(s, mix(key ^ words[i]));
            if (k > best) {
                best = k;
                best_idx = i;
            } else if (k != k && nan_key < 0) {
                nan_key = i;
            }
        }
        return nan_key >= 0 ? nan_key : best_idx;
    }
    float best = -INF;
    int64_t best_idx = 0;   // torch.argmax of an all -inf row: 0
    int64_t nan_key = -1;   // the first NaN key (s = +inf with E = inf), which argmax takes
    float bound[BLOCK];
    for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t n = vocab - start < BLOCK ? vocab - start : BLOCK;
        // The block at once: its largest s bounds every key in it (u >= 2^-32).
        float peak = -INF;
        int nan = 0;
#pragma omp simd reduction(max : peak) reduction(| : nan)
        for (int64_t j = 0; j < n; ++j) {
            const float xv = load(x, start + j);
            peak = xv > peak ? xv : peak;
            nan |= xv != xv;
        }
        const float peak_hi = upper_s(peak * inv_t);
        if (!nan && (peak_hi < threshold || upper_key(peak_hi, 32) < best)) continue;
        float most = -INF;
#pragma omp simd reduction(max : most)
        for (int64_t j = 0; j < n; ++j) {
            const float xv = load(x, start + j);
            const float s_hi = upper_s(xv * inv_t);
            const float u = uniform_of(mix(key ^ words[start + j]));
            const int32_t e = static_cast<int32_t>((float_bits(u) >> 23) & 0xFF) - 127;  // u >= 2^e
            // -inf logits and tokens certainly below the threshold never win (-inf, selected by
            // bits: GCC does not vectorize the loop with a ?: here).
            const uint32_t never = 0u - static_cast<uint32_t>((xv == -INF) | (s_hi < threshold));
            const float b = bits_float((float_bits(upper_key(s_hi, -e)) & ~never) | (float_bits(-INF) & never));
            bound[j] = b;
            most = b > most ? b : most;
        }
        if (!nan && most < best) continue;
        for (int64_t j = 0; j < n; ++j) {
            if (bound[j] < best || bound[j] == -INF) continue;  // NaN bounds (a NaN logit) are looked at
            const int64_t i = start + j;
            const float xv = load(x, i);
            if (xv != xv) return i;  // a row with a NaN takes its first NaN, as argmax of the row
            const float s = xv / t;
            if (s < threshold) continue;
            const float k = race_key(s, mix(key ^ words[i]));
            if (k > best) {
                best = k;
                best_idx = i;
            } else if (k != k && nan_key < 0) {
                nan_key = i;
            }
        }
    }
    return nan_key >= 0 ? nan_key : best_idx;
}

template <typename T>
void sample_rows(const T* logits, int64_t num_rows, int64_t vocab, int64_t stride_row, const int64_t* rows,
                 const float* threshold, const uint32_t* words, int64_t* out, float* keys_out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; ++r) {
        const T* x = logits + r * stride_row;
        const float t = bits_float(static_cast<uint32_t>(rows[2 * num_rows + r]));
        float* keys = keys_out != nullptr ? keys_out + r * vocab : nullptr;
        if (t == 0.0f) {
            out[r] = argmax_row(x, vocab);
            if (keys != nullptr) {
                for (int64_t j = 0; j < vocab; ++j) keys[j] = load(x, j);
            }
            continue;
        }
        const float thr = threshold != nullptr ? threshold[r] : -INF;
        out[r] = race_row(x, vocab, words, row_key(rows[r], rows[num_rows + r]), t, thr, keys);
    }
}

}  // namespace

extern "C" {

// logits (num_rows, vocab) with row stride stride_row, float32 (dtype 0) or bf16 (1); rows (3,
// num_rows) int64: seed, position, temperature float32 bits (0: greedy); threshold (num_rows,)
// float32 or null; words (vocab,) uint32: mix(token ^ C_TOKEN) (kernels/sampling.py: _token_words);
// out (num_rows,) int64; keys_out (num_rows, vocab) float32 or null.
int batchrun_gumbel_sample(const void* logits, int dtype, int64_t num_rows, int64_t vocab, int64_t stride_row,
                           const int64_t* rows, const float* threshold, const uint32_t* words, int64_t* out,
                           float* keys_out, int num_threads) {
    if (vocab <= 0 || vocab > (int64_t{1} << 32)) return -2;
    if (dtype == 0) {
        sample_rows(static_cast<const float*>(logits), num_rows, vocab, stride_row, rows, threshold, words, out,
                    keys_out, num_threads);
    } else if (dtype == 1) {
        sample_rows(static_cast<const uint16_t*>(logits), num_rows, vocab, stride_row, rows, threshold, words, out,
                    keys_out, num_threads);
    } else {
        return -1;
    }
    return 0;
}

}  // extern "C"
