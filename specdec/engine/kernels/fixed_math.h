/* Float functions of our own for the kernels (specdec/engine/kernels): plain float operations
 * the compiler vectorizes, so every build and vector width gives the same bits
 * (-ffp-contract=off), which libm's scalar calls would not promise, and at a tenth of their cost. */
#ifndef SPECDEC_FIXED_MATH_H
#define SPECDEC_FIXED_MATH_H

#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (softmax weights after the max is subtracted), within 2 ulp: Cody-Waite range
 * reduction and Cephes' expf polynomial. Plain float operations only, so every build and every
 * vector width gives the same bits (-ffp-contract=off). x < -87 (and -inf) gives 0. */
static inline __attribute__((always_inline)) float exp_fixed(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds half to even */
    const float zero_below = x; /* e^x < 2^-125: 0 (a masked column's -inf too) */
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 0] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return zero_below < -87.0f ? 0.0f : p * two_n;
}

/* x * sigmoid(x), from exp_fixed of -|x| (sigmoid(x) = 1 / (1 + e^-x), or e^x / (1 + e^x) below 0). */
static inline __attribute__((always_inline)) float silu_fixed(float x) {
    const float e = exp_fixed(x < 0.0f ? x : -x);
    const float sigmoid = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
    return x * sigmoid;
}

/* tanh from exp_fixed of -2|u| (tanh(u) = (1 - e^-2|u|) / (1 + e^-2|u|), sign restored), and GELU's tanh form
 * (Gemma's gate): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). */
static inline __attribute__((always_inline)) float tanh_fixed(float u) {
    const float a = u < 0.0f ? -u : u;
    const float e = exp_fixed(-2.0f * a);
    const float t = (1.0f - e) / (1.0f + e);
    return u < 0.0f ? -t : t;
}

static inline __attribute__((always_inline)) float gelu_tanh_fixed(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanh_fixed(inner));
}

#endif
