/* Decode and verify attention over the slot KV cache, with the rotary embedding and the KV write fused:
 * one call a layer where the torch path takes ~15 small ops (rope, two index_copy_, views, SDPA).
 *
 * Built into the same library as blockq.c (data_plane/shard/engines/blockq.py) and called through
 * data_plane/shard/engines/attention.py's `Native` for LlamaRunner's batched passes (decode steps and speculative verify passes) when its weights are
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
    for (int p = 0; p < span; p++) {
        size_t at = base + (size_t)p * d;
        if (bf16) {
            const uint16_t *kk = (const uint16_t *)kc + at;
#pragma omp simd
            for (int j = 0; j < d; j++) kr[j] = bf16_to_f32(kk[j]);
        } else {
            memcpy(kr, (const float *)kc + at, sizeof(float) * (size_t)d);
        }
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
        size_t at = base + (size_t)p * d;
        if (bf16) {
            const uint16_t *vv = (const uint16_t *)vc + at;
#pragma omp simd
            for (int j = 0; j < d; j++) kr[j] = bf16_to_f32(vv[j]);
        } else {
            memcpy(kr, (const float *)vc + at, sizeof(float) * (size_t)d);
        }
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
