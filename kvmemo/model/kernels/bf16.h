/* bf16 <-> fp32 for the C kernels: shared by layer_ops.c, skinny_linear.c, greedy_head.c and the
 * decode attention kernel (attention/kernels/paged_decode.c). */
#ifndef KVMEMO_BF16_H
#define KVMEMO_BF16_H

#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's cast does; a NaN stays a (quiet) NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
