/* Block-quantized GEMM with float32 activations: the exact mode (`--dtype float32 --quantization int4`).
 * The same weight tiles as blockq.c (blockq_layout.h), but the activations are not rounded to int8: each
 * weight's integer becomes a float (exactly: at most 8 significant bits) and meets the float32 activation
 * in a float32 fused multiply-add. Against float32 dense on the GGUF's own weights (its Q4_1 / Q8_0 blocks
 * dequantized) only the order of float32 additions differs, as between two float32 GEMMs.
 *
 * Per (row, column, block of 32): eight chains, one per quad g (elements 4g..4g+3, in order, the first a
 * product), summed as ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)); then
 *   Q4 (w = q d + m):  acc = fma(dot, d, acc); acc = fma(m, sum(x of the block), acc)
 *   Q8 (w = q d):      acc = fma(dot, d, acc)
 *   Q6 (a d per 16):   acc = fma(lo, d0, acc); acc = fma(hi, d1, acc)   (lo: quads 0..3, hi: 4..7)
 * Eight independent chains keep two FMA ports busy at one row (a decode step at one stream).
 *
 * No shift per weight: a weight's integer is masked in place in its 32-bit lane (Q4: q << 8i, the high
 * nibbles shifted down once a quad; Q8: q << 24, signed), converted, and met by the activation pre-scaled by the
 * inverse power of two (exact: scaling by 2^-e changes only the exponent), so the product is q * x.
 *
 * As blockq.c: every path (AVX-512, AVX2, portable C) does the same float operations in the same order
 * (explicit fmaf, -ffp-contract=off), so a row's output does not depend on the CPU path, the thread count
 * or the other rows of the batch (float32's batch invariance). Built and loaded by blockq.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "blockq_layout.h"

/* Rows ready for the float path: x (RMS-normed when asked) with element 4g+i of each block scaled by
 * 2^-shift(fmt, g, i), and each block's plain sum (Q4's min term). */
typedef struct {
    float *x;
    float *sum;
} FRows;

/* The power of two a weight's integer carries in its lane (see the header comment). */
static inline int shift_of(int fmt, int g, int i) {
    (void)g;
    if (fmt == FMT_Q4) return 8 * i;
    return fmt == FMT_Q8 ? 24 : 0;
}

/* Column j's weight (element 4g+i of the block at p) as the integer its lane holds: q << shift_of(). */
static inline int32_t lane_int(int fmt, const uint8_t *p, int j, int g, int i) {
    int q = weight_at(fmt, p, j, g, i);
    return (int32_t)((uint32_t)q << shift_of(fmt, g, i)); /* Q8: q * 2^24 wraps to the signed top byte */
}

static void prepare_rows(int fmt, const void *x, int x_bf16, int m, int k, const void *norm_w, float eps,
                         FRows *out) {
    int nb = k / QK;
    for (int r = 0; r < m; r++) {
        float *row = out->x + (size_t)r * k;
        for (int i = 0; i < k; i++) row[i] = load_act(x, x_bf16, (size_t)r * k + i);
        if (norm_w) {
            float ss = 0.f;
            for (int i = 0; i < k; i++) ss += row[i] * row[i];
            float inv = 1.f / sqrtf(ss / (float)k + eps);
            for (int i = 0; i < k; i++) row[i] = row[i] * inv * load_act(norm_w, x_bf16, (size_t)i);
        }
        for (int b = 0; b < nb; b++) {
            float s = 0.f, *v = row + (size_t)b * QK;
            for (int e = 0; e < QK; e++) {
                s += v[e];
                v[e] = ldexpf(v[e], -shift_of(fmt, e / 4, e % 4));
            }
            out->sum[(size_t)r * nb + b] = s;
        }
    }
}

/* The portable path: the reference the SIMD paths match bit for bit. */
static void tile_scalar(int fmt, const uint8_t *tw, int nb, const FRows *x, int k, int m, int n0, int n,
                        const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    for (int r = 0; r < m; r++) {
        float acc[NT] = {0};
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = tw + (size_t)b * bb;
            const float *xr = x->x + (size_t)r * k + (size_t)b * QK;
            const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
            for (int j = 0; j < NT; j++) {
                float c[8];
                for (int g = 0; g < 8; g++) {
                    c[g] = (float)lane_int(fmt, p, j, g, 0) * xr[4 * g];
                    for (int i = 1; i < 4; i++) c[g] = fmaf((float)lane_int(fmt, p, j, g, i), xr[4 * g + i], c[g]);
                }
                float lo = (c[0] + c[1]) + (c[2] + c[3]), hi = (c[4] + c[5]) + (c[6] + c[7]);
                float d = f16_to_f32(hd[j]), e = fmt != FMT_Q8 ? f16_to_f32(hd[NT + j]) : 0.f;
                if (fmt == FMT_Q6) {
                    acc[j] = fmaf(lo, d, acc[j]);
                    acc[j] = fmaf(hi, e, acc[j]);
                    continue;
                }
                acc[j] = fmaf(lo + hi, d, acc[j]);
                if (fmt == FMT_Q4) acc[j] = fmaf(e, x->sum[(size_t)r * nb + b], acc[j]);
            }
        }
        store_row(acc, r, n0, n, res, y, y_bf16);
    }
}

#if defined(__x86_64__)

/* Lanes of the 32-bit words at `p`: each word is 4 bytes of one column; quad g's element i of every column. */
#define EXTRACT(W, AND, SLLI, SRLI, ADD, SUB, SET1, XOR)                                                      \
    if (fmt == FMT_Q4) return AND(g < 4 ? v : SRLI(v, 4), SET1(0xf << (8 * i)));                                \
    if (fmt == FMT_Q8) return AND(SLLI(XOR(v, SET1((int)0x80808080)), 24 - 8 * i), SET1((int)0xff000000));   \
    {                                                                                                          \
        W lo = AND(SRLI(v, 8 * i + (g < 4 ? 0 : 4)), SET1(0xf));                                               \
        W hi = AND(SRLI(h, 8 * i + 2 * (g & 3)), SET1(3));                                                     \
        return SUB(ADD(lo, SLLI(hi, 4)), SET1(32));                                                            \
    }

AVX2_TARGET static inline __m256i avx2_lane(int fmt, const uint8_t *p, int g, int i, int half) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * (fmt == FMT_Q8 ? g : g & 3) + 32 * half));
    __m256i h = fmt == FMT_Q6 ? _mm256_loadu_si256((const __m256i *)(p + 256 + 64 * (g >> 2) + 32 * half))
                              : _mm256_setzero_si256();
    EXTRACT(__m256i, _mm256_and_si256, _mm256_slli_epi32, _mm256_srli_epi32, _mm256_add_epi32, _mm256_sub_epi32,
            _mm256_set1_epi32, _mm256_xor_si256)
}

VNNI_TARGET static inline __m512i x512_lane(int fmt, const uint8_t *p, int g, int i) {
    __m512i v = _mm512_loadu_si512((const void *)(p + 64 * (fmt == FMT_Q8 ? g : g & 3)));
    __m512i h = fmt == FMT_Q6 ? _mm512_loadu_si512((const void *)(p + 256 + 64 * (g >> 2))) : _mm512_setzero_si512();
    EXTRACT(__m512i, _mm512_and_si512, _mm512_slli_epi32, _mm512_srli_epi32, _mm512_add_epi32, _mm512_sub_epi32,
            _mm512_set1_epi32, _mm512_xor_si512)
}

/* One block's dot for one row: the eight quad chains, then the tree. W(g, i) is the converted weight vector
 * of quad g's element i: read from the block's 32 converted vectors when rows share them, converted where
 * it is used at one row (no round trip through memory: ~15-30 % of a one-row call, measured under load). */
#define BLOCK_DOT(V, MUL, FMA, ADD, SET1, W, xr, lo, hi)                                                       \
    do {                                                                                                       \
        V c[8];                                                                                                \
        for (int g = 0; g < 8; g++) {                                                                          \
            c[g] = MUL(W(g, 0), SET1(xr[4 * g]));                                                              \
            for (int i = 1; i < 4; i++) c[g] = FMA(W(g, i), SET1(xr[4 * g + i]), c[g]);                        \
        }                                                                                                      \
        lo = ADD(ADD(c[0], c[1]), ADD(c[2], c[3]));                                                            \
        hi = ADD(ADD(c[4], c[5]), ADD(c[6], c[7]));                                                            \
    } while (0)

AVX2_TARGET static inline void avx2_rows(int fmt, const uint8_t *tw, int nb, const FRows *x, int k, int r0, int rt,
                                         int n0, int n, const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    __m256 acc[4][2];
    for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = tw + (size_t)b * bb;
        const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
        for (int h = 0; h < 2; h++) {
            __m256 w[32];
            if (rt > 1)
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) w[4 * g + i] = _mm256_cvtepi32_ps(avx2_lane(fmt, p, g, i, h));
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 8 * h)));
            __m256 e = fmt != FMT_Q8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + NT + 8 * h)))
                                     : _mm256_setzero_ps(); /* Q4's mins, Q6's second scales */
            for (int a = 0; a < rt; a++) {
                int r = r0 + a;
                const float *xr = x->x + (size_t)r * k + (size_t)b * QK;
                __m256 lo, hi;
#define W2(g, i) (rt > 1 ? w[4 * (g) + (i)] : _mm256_cvtepi32_ps(avx2_lane(fmt, p, g, i, h)))
                BLOCK_DOT(__m256, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_set1_ps, W2, xr, lo, hi);
#undef W2
                if (fmt == FMT_Q6) {
                    acc[a][h] = _mm256_fmadd_ps(lo, d, acc[a][h]);
                    acc[a][h] = _mm256_fmadd_ps(hi, e, acc[a][h]);
                    continue;
                }
                acc[a][h] = _mm256_fmadd_ps(_mm256_add_ps(lo, hi), d, acc[a][h]);
                if (fmt == FMT_Q4)
                    acc[a][h] = _mm256_fmadd_ps(e, _mm256_set1_ps(x->sum[(size_t)r * nb + b]), acc[a][h]);
            }
        }
    }
    for (int a = 0; a < rt; a++)
        for (int h = 0; h < 2; h++) avx2_store8(acc[a][h], (size_t)(r0 + a) * n + n0 + 8 * h, res, y, y_bf16);
}

VNNI_TARGET static inline void x512_rows(int fmt, const uint8_t *tw, int nb, const FRows *x, int k, int r0, int rt,
                                         int n0, int n, const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    __m512 acc[4];
    for (int a = 0; a < 4; a++) acc[a] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = tw + (size_t)b * bb;
        const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
        __m512 w[32];
        if (rt > 1)
            for (int g = 0; g < 8; g++)
                for (int i = 0; i < 4; i++) w[4 * g + i] = _mm512_cvtepi32_ps(x512_lane(fmt, p, g, i));
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
        __m512 e = fmt != FMT_Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hd + NT))) : _mm512_setzero_ps();
        for (int a = 0; a < rt; a++) {
            int r = r0 + a;
            const float *xr = x->x + (size_t)r * k + (size_t)b * QK;
            __m512 lo, hi;
#define W5(g, i) (rt > 1 ? w[4 * (g) + (i)] : _mm512_cvtepi32_ps(x512_lane(fmt, p, g, i)))
            BLOCK_DOT(__m512, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_set1_ps, W5, xr, lo, hi);
#undef W5
            if (fmt == FMT_Q6) {
                acc[a] = _mm512_fmadd_ps(lo, d, acc[a]);
                acc[a] = _mm512_fmadd_ps(hi, e, acc[a]);
                continue;
            }
            acc[a] = _mm512_fmadd_ps(_mm512_add_ps(lo, hi), d, acc[a]);
            if (fmt == FMT_Q4) acc[a] = _mm512_fmadd_ps(e, _mm512_set1_ps(x->sum[(size_t)r * nb + b]), acc[a]);
        }
    }
    for (int a = 0; a < rt; a++) vnni_store16(acc[a], (size_t)(r0 + a) * n + n0, res, y, y_bf16);
}

AVX2_TARGET static void avx2_tile(int fmt, const uint8_t *tw, int nb, const FRows *x, int k, int m, int n0, int n,
                                  const void *res, void *y, int y_bf16) {
    int r = 0;
    for (; r + 4 <= m; r += 4) avx2_rows(fmt, tw, nb, x, k, r, 4, n0, n, res, y, y_bf16);
    for (; r < m; r++) avx2_rows(fmt, tw, nb, x, k, r, 1, n0, n, res, y, y_bf16);
}

VNNI_TARGET static void x512_tile(int fmt, const uint8_t *tw, int nb, const FRows *x, int k, int m, int n0, int n,
                                  const void *res, void *y, int y_bf16) {
    int r = 0;
    for (; r + 4 <= m; r += 4) x512_rows(fmt, tw, nb, x, k, r, 4, n0, n, res, y, y_bf16);
    for (; r < m; r++) x512_rows(fmt, tw, nb, x, k, r, 1, n0, n, res, y, y_bf16);
}
#endif

/* blockq_gemm's contract (blockq.c) with float32 activations: y[m, n] = norm(x[m, k]) @ W.T (+ res). `isa`
 * as blockq_best_isa() numbers it (the AVX-512 level uses AVX-512F/BW only). Returns 0, or -1 on a bad
 * shape or allocation failure. */
int blockq_gemm_exact(int fmt, int isa, const uint8_t *w, int n, int k, const void *x, int x_bf16, int m,
                      const void *res, void *y, int y_bf16, int threads, const void *norm_w, float eps) {
    if (n % NT || k % QK || m <= 0) return -1;
    int nb = k / QK, tiles = n / NT;
    size_t tile_bytes = (size_t)nb * block_bytes(fmt);
    FRows f;
    f.x = (float *)malloc(sizeof(float) * (size_t)m * k);
    f.sum = (float *)malloc(sizeof(float) * (size_t)m * nb);
    if (!f.x || !f.sum) {
        free(f.x); free(f.sum);
        return -1;
    }
    prepare_rows(fmt, x, x_bf16, m, k, norm_w, eps, &f);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *tw = w + (size_t)t * tile_bytes;
#if defined(__x86_64__)
        if (isa == ISA_VNNI) {
            x512_tile(fmt, tw, nb, &f, k, m, t * NT, n, res, y, y_bf16);
            continue;
        }
        if (isa == ISA_AVX2) {
            avx2_tile(fmt, tw, nb, &f, k, m, t * NT, n, res, y, y_bf16);
            continue;
        }
#endif
        tile_scalar(fmt, tw, nb, &f, k, m, t * NT, n, res, y, y_bf16);
    }
    free(f.x); free(f.sum);
    return 0;
}
