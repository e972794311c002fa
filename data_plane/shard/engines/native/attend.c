/* Decode and verify attention over the slot KV cache, with the rotary embedding and the KV write fused:
 * one call a layer where the torch path takes ~15 small ops (rope, two index_copy_, views, SDPA).
 *
 * Built into the same library as blockq.c (data_plane/shard/engines/blockq.py) and called through
 * data_plane/shard/engines/attention.py's `Native` for LlamaRunner's batched passes (decode steps and speculative verify passes; in float32 every pass, prompts too) when its weights are
 * served by blockq. Rows are independent: a row's output depends on its own query and its slot's cache
 * only (never on the other rows of the pass), so the output is the same alone and in any batch.
 *
 * qkv   [rows, (H + 2 KVH) * D]   the projection's output (q heads, then k heads, then v heads)
 * cos, sin_signed [max_len, D]     rotary tables (sin_signed: -sin on the first half, as the runner's)
 * slot, pos [rows]                 each row's cache slot and position; its keys are positions 0..pos
 * kc, vc [slots, KVH, max_len, D]  the caches, written at (slot, head, pos) for every row first
 * out   [rows, H * D]
 * Everything in the activation dtype (bf16 as uint16, or float32); arithmetic in float32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activations.h"

/* x[j] * cos[j] + x[(j + D/2) % D] * sin_signed[j]: rotate_half as the runner computes it (a roll). */
static void rope(const void *qkv, size_t base, const void *cos, const void *sin_s, size_t trow, int d, int bf16,
                 float *out) {
    int h = d / 2;
    for (int j = 0; j < d; j++) {
        float x = load_act(qkv, bf16, base + j), r = load_act(qkv, bf16, base + (j + h) % d);
        out[j] = x * load_act(cos, bf16, trow + j) + r * load_act(sin_s, bf16, trow + j);
    }
}

/* e^x for x <= 0 (scores less their max), vectorizable (no libm call): 2^(x log2 e) split into a
 * rounded integer power (the exponent bits) and 2^f, |f| <= 1/2, by a degree-6 polynomial; relative
 * error ~2e-7. Below -87, e^x is taken as e^-87 (~1.6e-38: nothing next to the max's 1). */
__attribute__((target_clones("avx512f", "avx2", "default")))
static float softmax_weights(float *w, int span) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int p = 0; p < span; p++) {
        float x = w[p] < -87.f ? -87.f : w[p];
        float t = x * 1.44269504f;
        float fi = (t + 12582912.f) - 12582912.f;
        float f = t - fi;
        float y = 1.f + f * (0.69314718f + f * (0.24022650f + f * (0.05550411f + f * (0.00961813f
                  + f * (0.00133336f + f * 0.00015404f)))));
        int32_t bits = ((int32_t)fi + 127) << 23;
        float scale;
        memcpy(&scale, &bits, 4);
        w[p] = y * scale;
        sum += w[p];
    }
    return sum;
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* 16 consecutive activations (bf16 as uint16, or float32) as float32 lanes. */
static inline v16f widen16(const void *src, int bf16, size_t at) {
    v16f f;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)src + at, sizeof h);
        v16i i = __builtin_convertvector(h, v16i) << 16;
        memcpy(&f, &i, sizeof f);
    } else {
        memcpy(&f, (const float *)src + at, sizeof f);
    }
    return f;
}

/* Sum each of 16 vectors' lanes at once: lane p of the result is the sum of a[p]'s 16 lanes. Four
 * levels of pairing (halves, quarters, ...) where one horizontal sum a vector took its own shuffles:
 * a 64-wide dot product is 4 multiply-adds, and its horizontal sum was the larger part of its cost. */
static inline v16f sum_lanes16(v16f *a) {
    static const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const v16i lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const v16i hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const v16i lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const v16i hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo8) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo2) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi2);
    return __builtin_shuffle(e[0], e[1], lo1) + __builtin_shuffle(e[0], e[1], hi1);
}

/* Row `at` of a cache (d activations, bf16 as uint16 or float32) as float32, into `dst`. */
static inline void widen_row(float *dst, const void *src, int bf16, size_t at, int d) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)src + at;
#pragma omp simd
        for (int j = 0; j < d; j++) dst[j] = bf16_to_f32(h[j]);
    } else {
        memcpy(dst, (const float *)src + at, sizeof(float) * (size_t)d);
    }
}

/* One (row, KV head) task: the `group` query heads that share this KV head attend over its
 * positions 0..span-1 together, so each key and value row is read and widened to float32 once for the
 * group (SmolLM2: 3 query heads a KV head), and the loops inline into one vectorized body (a
 * function call a position cost more than its 64 multiply-adds). Per query head the arithmetic is
 * what it was one head at a time: the same dot products, softmax and accumulation order.
 * w: [group][span] scratch; out_h: where query head h's output goes is out + h * d. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attend_group(const float *q, const void *kc, const void *vc, int bf16, size_t base, int span,
                         int group, int d, float scale, float *w, void *out, size_t out_at) {
    float kr[512], acc[8][512], inv[8];
    int p0 = 0;
    if (d % 16 == 0) { /* 16 positions at a time: their keys widened once, 16 dot products summed at once */
        int chunks = d / 16;
        v16f kt[16 * 32], qv[32];
        for (; p0 + 16 <= span; p0 += 16) {
            for (int p = 0; p < 16; p++)
                for (int c = 0; c < chunks; c++) kt[p * chunks + c] = widen16(kc, bf16, base + (size_t)(p0 + p) * d + 16 * c);
            for (int h = 0; h < group; h++) {
                v16f a[16];
                memcpy(qv, q + (size_t)h * d, sizeof(float) * (size_t)d);
                for (int p = 0; p < 16; p++) {
                    v16f s = qv[0] * kt[p * chunks];
                    for (int c = 1; c < chunks; c++) s += qv[c] * kt[p * chunks + c];
                    a[p] = s;
                }
                v16f sums = sum_lanes16(a);
                for (int p = 0; p < 16; p++) w[(size_t)h * span + p0 + p] = sums[p] * scale;
            }
        }
    }
    for (int p = p0; p < span; p++) { /* the rest one position at a time */
        widen_row(kr, kc, bf16, base + (size_t)p * d, d);
        for (int h = 0; h < group; h++) {
            const float *qh = q + (size_t)h * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int j = 0; j < d; j++) s += qh[j] * kr[j];
            w[(size_t)h * span + p] = s * scale;
        }
    }
    for (int h = 0; h < group; h++) {
        float *wh = w + (size_t)h * span, mx = -INFINITY;
        for (int p = 0; p < span; p++) mx = wh[p] > mx ? wh[p] : mx;
        for (int p = 0; p < span; p++) wh[p] -= mx;
        inv[h] = softmax_weights(wh, span);
        for (int j = 0; j < d; j++) acc[h][j] = 0.f;
    }
    for (int p = 0; p < span; p++) {
        widen_row(kr, vc, bf16, base + (size_t)p * d, d);
        for (int h = 0; h < group; h++) {
            float pw = w[(size_t)h * span + p] / inv[h];
#pragma omp simd
            for (int j = 0; j < d; j++) acc[h][j] += pw * kr[j];
        }
    }
    for (int h = 0; h < group; h++)
        for (int j = 0; j < d; j++) store_act(out, bf16, out_at + (size_t)h * d + j, acc[h][j]);
}

int sb_attend(void *qkv, int rows, int heads, int kv_heads, int d, const void *cos, const void *sin_s,
              const int64_t *slot, const int64_t *pos, void *kc, void *vc, int max_len, void *out, float scale,
              int bf16, int threads) {
    if (d > 512 || heads % kv_heads || heads / kv_heads > 8) return -1;
    int width = (heads + 2 * kv_heads) * d, group = heads / kv_heads;
    for (int r = 0; r < rows; r++)
        if (pos[r] < 0 || pos[r] >= max_len) return -1;
    float *q = (float *)malloc(sizeof(float) * (size_t)rows * heads * d);
    if (!q) return -1;
    (void)threads;
    /* Phase 1: rope the queries (kept in float32) and keys; write keys and values at (slot, head, pos). */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        size_t row = (size_t)r * width, trow = (size_t)pos[r] * d;
        float kr[512];
        for (int h = 0; h < heads; h++)
            rope(qkv, row + (size_t)h * d, cos, sin_s, trow, d, bf16, q + ((size_t)r * heads + h) * d);
        for (int g = 0; g < kv_heads; g++) {
            size_t at = (((size_t)slot[r] * kv_heads + g) * max_len + (size_t)pos[r]) * d;
            rope(qkv, row + (size_t)(heads + g) * d, cos, sin_s, trow, d, bf16, kr);
            for (int j = 0; j < d; j++) {
                store_act(kc, bf16, at + j, kr[j]);
                store_act(vc, bf16, at + j, load_act(qkv, bf16, row + (size_t)(heads + kv_heads + g) * d + j));
            }
        }
    }
    /* Phase 2: each (row, KV head) task: its query heads attend over the slot's positions 0..pos
     * (the keys just written included). */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int t = 0; t < rows * kv_heads; t++) {
        int r = t / kv_heads, g = t % kv_heads, span = (int)pos[r] + 1;
        float *w = (float *)malloc(sizeof(float) * (size_t)span * group);
        if (!w) continue; /* out of memory: these heads' output stays as it was */
        attend_group(q + ((size_t)r * heads + (size_t)g * group) * d, kc, vc, bf16,
                     ((size_t)slot[r] * kv_heads + g) * max_len * d, span, group, d, scale, w, out,
                     (size_t)r * heads * d + (size_t)g * group * d);
        free(w);
    }
    free(q);
    return 0;
}
