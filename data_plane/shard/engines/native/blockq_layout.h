/* What blockq.c (int8 activations) and blockq_exact.c (float activations) share: the weight tiles'
 * layout (blockq.c's header comment describes it), exact fp16 scales, and the row stores (+ residual,
 * then the output dtype) every path ends with. */
#ifndef SWITCHBOARD_BLOCKQ_LAYOUT_H
#define SWITCHBOARD_BLOCKQ_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "activations.h"

#define NT 16
#define QK 32
#define FMT_Q4 0
#define FMT_Q8 1
#define FMT_Q6 2
#define ISA_SCALAR 0
#define ISA_AVX2 1
#define ISA_VNNI 2

static inline int block_bytes(int fmt) { return fmt == FMT_Q4 ? 256 + 64 : fmt == FMT_Q8 ? 512 + 32 : 384 + 64; }

/* Where a block's 16 fp16 scales start (Q4's 16 mins follow them; Q6's 16 scales of elements 16..31). */
static inline int scales_at(int fmt) { return fmt == FMT_Q4 ? 256 : fmt == FMT_Q8 ? 512 : 384; }

/* Weight (column j, element 4 g + i of the block at p) as the integer the dot products use: Q4's q
 * (0..15), Q8's and Q6's signed q. */
static inline int weight_at(int fmt, const uint8_t *p, int j, int g, int i) {
    if (fmt == FMT_Q8) return (int)p[64 * g + 4 * j + i] - 128;
    uint8_t byte = p[64 * (g & 3) + 4 * j + i];
    int lo = g < 4 ? (byte & 0xf) : (byte >> 4);
    if (fmt == FMT_Q4) return lo;
    int hi = (p[256 + 64 * (g >> 2) + 4 * j + i] >> (2 * (g & 3))) & 3;
    return (lo | (hi << 4)) - 32;
}

static inline float f16_to_f32(uint16_t h) { /* exact, as F16C's vcvtph2ps */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* acc (16 columns of one row) written to y: + residual, then the output dtype. */
static inline void store_row(const float *acc, int r, int n0, int n, const void *res, void *y, int y_bf16) {
    for (int j = 0; j < NT; j++) {
        size_t at = (size_t)r * n + n0 + j;
        float v = acc[j];
        if (res) v += load_act(res, y_bf16, at);
        store_act(y, y_bf16, at, v);
    }
}

#if defined(__x86_64__)

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* 8 float32 lanes -> y at `at` (+ res), as store_row does it: bf16 by round to nearest even, NaN quieted. */
AVX2_TARGET static inline void avx2_store8(__m256 v, size_t at, const void *res, void *y, int y_bf16) {
    if (y_bf16) {
        if (res) {
            __m256i r16 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)res + at)));
            v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(r16, 16)));
        }
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
        __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        __m256i b = _mm256_blendv_epi8(rounded, quiet, nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)y + at), packed);
    } else {
        if (res) v = _mm256_add_ps(v, _mm256_loadu_ps((const float *)res + at));
        _mm256_storeu_ps((float *)y + at, v);
    }
}

VNNI_TARGET static inline void vnni_store16(__m512 v, size_t at, const void *res, void *y, int y_bf16) {
    if (y_bf16) {
        if (res) {
            __m512i r16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)res + at)));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(r16, 16)));
        }
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        __m512i b = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), _mm512_cvtepi32_epi16(b));
    } else {
        if (res) v = _mm512_add_ps(v, _mm512_loadu_ps((const float *)res + at));
        _mm512_storeu_ps((float *)y + at, v);
    }
}

#endif

#endif
