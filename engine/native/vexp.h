/* A vectorisable exp for the native kernels (decode.c, inspect.c). */
#ifndef LLMI_VEXP_H
#define LLMI_VEXP_H
#include <math.h>

/* e^x for x <= 0 (a score minus its row's max), within 2 ulp of expf (Cephes' polynomial); written so the
 * compiler vectorises it (expf itself is a scalar call). Below -87.3 it gives 2^-126 instead of a denormal. */
static inline float exp_le0(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    union { int i; float f; } scale = { .i = ((int)n + 127) << 23 };
    return e * scale.f;
}

#endif
