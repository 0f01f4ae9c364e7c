// Vector math shared by the native CPU kernels (AVX-512 builds only).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace batchrun {

// 16 bf16 values widened to float32 lanes (exact: a bf16 is the top half of a float32).
inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __m512 load_bf16x16(const uint16_t* p) { return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// e^x for float32 lanes, about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor
// polynomial in r, then scaled by 2^n. Lanes below -87.3 give 0 (as exp underflows to).
inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~under), p, n);
}

// 2^x for float32 lanes: n = round(x), 2^(x - n) by the Taylor polynomial of degree Deg in
// (x - n) (|x - n| <= 1/2), scaled by 2^n (0 far below, inf far above). Relative error about
// 4e-5 at degree 4 (for values rounded to bf16 next, whose half step is 2e-3) and 6e-9 at 7.
template <int Deg>
inline __m512 exp2_512(__m512 x) {
    static_assert(Deg >= 4 && Deg <= 7, "degree 4 to 7");
    // ln2^k / k!
    constexpr float c[8] = {1.f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f, 0.00133335581f,
                            1.54035304e-4f, 1.52527338e-5f};
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[Deg]);
    for (int k = Deg - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
    return _mm512_scalef_ps(p, n);
}

// softcap * tanh(s / softcap), with tanh(y) = 1 - 2 / (e^{2y} + 1).
inline __m512 softcap512(__m512 s, float softcap) {
    const __m512 e = exp512(_mm512_mul_ps(s, _mm512_set1_ps(2.f / softcap)));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
    return _mm512_mul_ps(t, _mm512_set1_ps(softcap));
}

// v rounded to bf16 (nearest even; NaN -> 0x7fc0, as bf16.h), kept in float32 lanes.
inline __m512 round_bf16_512(__m512 v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb),
                                 _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

inline void store_bf16(uint16_t* p, __m512 v) {
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// silu(g) = g / (1 + e^-g) as torch computes it for bf16 (in float32, rounded to bf16); e^-g
// overflows to inf below g = -88.72, where torch's quotient is -0 (and NaN at g = -inf).
inline __m512 silu512(__m512 g) {
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), batchrun::exp512(neg)));
    const __mmask16 over = _mm512_cmp_ps_mask(neg, _mm512_set1_ps(88.72f), _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(neg, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const __mmask16 inf = _mm512_cmp_ps_mask(neg, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(_mm512_mask_mov_ps(s, over, _mm512_set1_ps(-0.f)), inf, _mm512_set1_ps(NAN));
}

// One group of 32 float32 values (a, b) quantized to int8 as kernels/quant.py:
// quantize_groups_int8 does it: scale = max(absmax / 127, 1e-10), q = round half to even of x / scale,
// sum = scale * the integer sum of q. A group holding a NaN gets what torch gives: a NaN scale and
// sum, and q = 0 (max would drop the NaN and the int conversion of NaN is INT_MIN); one holding an
// infinity an infinite scale, q = 0 and a NaN sum.
inline void quantize_group32(__m512 a, __m512 b, int8_t* q, float* scale_out, float* sum_out) {
    if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
        *scale_out = *sum_out = std::nanf("");
        return;
    }
    float scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.0f;
    scale = scale < 1e-10f ? 1e-10f : scale;  // kernels/quant.py: MIN_SCALE
    if (std::isinf(scale)) {  // an infinite value: torch gives q = 0 (inf / inf is NaN, the rest 0) and sum 0 * inf
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
        *scale_out = scale;
        *sum_out = std::nanf("");
        return;
    }
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv));  // MXCSR: nearest, ties to even
    const __m512i qb = _mm512_cvtps_epi32(_mm512_div_ps(b, sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    *scale_out = scale;
    *sum_out = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}

}  // namespace batchrun

#endif  // __AVX512F__
