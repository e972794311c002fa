/* Activation loads and stores in the engine's dtype (bf16 as uint16, or float32), shared by blockq.c and
 * attend.c: bf16 rounds to nearest even as torch's .to(bfloat16), a NaN stays a (quiet) NaN. */
#ifndef SWITCHBOARD_ACTIVATIONS_H
#define SWITCHBOARD_ACTIVATIONS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element `at` of an activation tensor as float32. */
static inline float load_act(const void *p, int bf16, size_t at) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* Write float32 `v` as element `at` of an activation tensor. */
static inline void store_act(void *p, int bf16, size_t at, float v) {
    if (bf16)
        ((uint16_t *)p)[at] = f32_to_bf16(v);
    else
        ((float *)p)[at] = v;
}

#endif
