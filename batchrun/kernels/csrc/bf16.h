// bfloat16 <-> float32 for the native CPU kernels, with torch's rounding.
#pragma once

#include <cstdint>
#include <cstring>

namespace batchrun {

inline float bf16_to_f32(uint16_t h) {
    uint32_t x = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
}

}  // namespace batchrun
