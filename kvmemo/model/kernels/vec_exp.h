/* e^x as a function the compiler vectorizes: shared by the C kernels that apply SiLU and by
 * the sampling kernel (engine/kernels/sampling.c). */
#ifndef KVMEMO_VEC_EXP_H
#define KVMEMO_VEC_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x, as Cephes' expf (n ln2 + r, a degree-6 polynomial in r, times 2^n;
 * about 1 ulp), written so that the compiler vectorizes the loop it sits in (libm's expf is a
 * call per element, which keeps the loop scalar). */
#pragma omp declare simd
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); /* not fminf: it stops vectorizing */
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#endif
