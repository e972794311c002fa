/* Block-quantized GEMM for the torch engine's decode, verify and prefill passes: int4/int8 weights in
 * blocks of 32 along K (GGUF's Q4_1 / Q8_0 rules) times activations quantized to int8 per block of 32
 * (llama.cpp's Q8 activations), integer dot products, float32 accumulation.
 *
 * Built and loaded by data_plane/shard/engines/blockq.py (its docstring says why and what it measured).
 *
 * Weight layout: N output columns in tiles of NT = 16; tile t holds, for each block b of 32 along K,
 *   Q4: 256 bytes of nibbles, 16 fp16 scales d, 16 fp16 mins m            (w = q * d + m, q in 0..15)
 *   Q8: 512 bytes q + 128 (uint8), 16 fp16 scales d                     (w = q * d, q in -127..127)
 *   Q6: Q4's 256 bytes of low nibbles, 128 bytes of 2-bit highs, 16 fp16 d for elements 0..15 and 16 for
 *       16..31 (w = q * d, q + 32 in 0..63: a scale per 16, as llama.cpp's Q6_K has)
 * The 32 weights of column j in block b are 8 "quads" of 4 consecutive k; quad g of column j is the
 * 4 bytes at offset 64 * g + 4 * j (Q8), or the low (g < 4) / high (g >= 4) nibbles of the 4 bytes at
 * 64 * (g % 4) + 4 * j (Q4, Q6's low nibbles; Q6's high 2 bits are bits 2 (g % 4) of the bytes at
 * 256 + 64 * (g / 4) + 4 * j). So one 64-byte load gives quad g of all 16 columns: one dot-product
 * instruction per quad (VNNI's dpbusd: 4 u8 x s8 products summed into each int32 lane).
 *
 * With two planes (`planes` = 2) each block of activations is also carried by a second int8 block: the
 * residual x - q d of the first, quantized with its own scale (at most d / 2 / 127 off: ~16 bits in all, where
 * one plane is ~8). The weights are unpacked once and met by both planes (twice the integer dot products,
 * the same bytes); float32 dense's greedy tokens then survive its near-ties (`switchboard bench quality`).
 *
 * Every path (AVX512-VNNI, AVX2, portable C) computes the same integer dot per (row, column, block)
 * exactly and the same float operations in the same order (explicit fmaf, -ffp-contract=off), so the
 * output does not depend on the CPU path, the thread count, or the other rows of the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "blockq_layout.h"

/* Activations: each row's blocks of 32 as int8 q (round to nearest even of x * 127 / amax), the scale
 * d = amax / 127, the integer sum of q and s = d * sum (the min term of Q4). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum;
    int32_t *half; /* the sums of q over each block's elements 0..15 and 16..31 (Q6's two scales) */
} QRows;

/* With `norm_w`, each row is first RMS-normalized and scaled: x * w / sqrt(mean(x^2) + eps) (the
 * Llama block's norm before a projection, fused: no normalized copy is written). `row` is scratch
 * for k floats. */
static void quantize_block(const float *v, int8_t *q, int at, int half_at, QRows *out);

/* `lo` (or NULL): the second plane, each block's residual v - q d quantized the same way with its own scale. */
static void quantize_rows(const void *x, int x_bf16, int m, int k, const void *norm_w, float eps, float *row,
                          QRows *out, QRows *lo) {
    int nb = k / QK;
    for (int r = 0; r < m; r++) {
        for (int i = 0; i < k; i++) row[i] = load_act(x, x_bf16, (size_t)r * k + i);
        if (norm_w) {
            float ss = 0.f;
            for (int i = 0; i < k; i++) ss += row[i] * row[i];
            float inv = 1.f / sqrtf(ss / (float)k + eps);
            for (int i = 0; i < k; i++) row[i] = row[i] * inv * load_act(norm_w, x_bf16, (size_t)i);
        }
        for (int b = 0; b < nb; b++) {
            int8_t *q = out->q + (size_t)r * k + (size_t)b * QK;
            quantize_block(row + b * QK, q, r * nb + b, 2 * (r * nb + b), out);
            if (lo) {
                float rest[QK], d = out->d[r * nb + b];
                for (int i = 0; i < QK; i++) rest[i] = row[b * QK + i] - (float)q[i] * d;
                quantize_block(rest, lo->q + (size_t)r * k + (size_t)b * QK, r * nb + b, 2 * (r * nb + b), lo);
            }
        }
    }
}

/* One block of 32: q = round(v * 127 / amax) (to nearest even), its scale, sum and half sums at `at`. */
static void quantize_block(const float *v, int8_t *q, int at, int half_at, QRows *out) {
    float amax = 0.f;
    for (int i = 0; i < QK; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0, first = 0;
    for (int i = 0; i < QK; i++) {
        /* round to nearest even by the 1.5 * 2^23 trick (|v * id| <= 127): no libm call */
        int qi = (int)((v[i] * id + 12582912.f) - 12582912.f);
        qi = qi > 127 ? 127 : (qi < -127 ? -127 : qi);
        q[i] = (int8_t)qi;
        sum += qi;
        if (i == QK / 2 - 1) first = sum;
    }
    out->d[at] = d;
    out->sum[at] = sum;
    out->half[half_at] = first;
    out->half[half_at + 1] = sum - first;
    out->s[at] = d * (float)sum;
}

/* The portable path: the reference the SIMD paths match bit for bit. */
static void tile_scalar(int fmt, const uint8_t *tw, int nb, const QRows *xs, int planes, int k, int r0, int r1,
                        int n0, int n, const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    for (int r = r0; r < r1; r++) {
        float acc[NT] = {0};
        for (int b = 0; b < nb; b++)
            for (int pl = 0; pl < planes; pl++) {
                const QRows *x = xs + pl;
                const uint8_t *p = tw + (size_t)b * bb;
                const int8_t *xq = x->q + (size_t)r * k + (size_t)b * QK;
                float dx = x->d[r * nb + b];
                for (int j = 0; j < NT; j++) {
                    int32_t dot[2] = {0, 0};
                    for (int g = 0; g < 8; g++)
                        for (int i = 0; i < 4; i++) dot[g >> 2] += weight_at(fmt, p, j, g, i) * xq[4 * g + i];
                    const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
                    if (fmt == FMT_Q6) { /* a scale per 16: elements 0..15, then 16..31 */
                        acc[j] = fmaf((float)dot[0], f16_to_f32(hd[j]) * dx, acc[j]);
                        acc[j] = fmaf((float)dot[1], f16_to_f32(hd[NT + j]) * dx, acc[j]);
                        continue;
                    }
                    float t = f16_to_f32(hd[j]) * dx;
                    acc[j] = fmaf((float)(dot[0] + dot[1]), t, acc[j]);
                    if (fmt == FMT_Q4) acc[j] = fmaf(f16_to_f32(hd[NT + j]), x->s[r * nb + b], acc[j]);
                }
            }
        store_row(acc, r, n0, n, res, y, y_bf16);
    }
}

#if defined(__x86_64__)

/* AVX2: 16 columns as two 8-lane halves; u8 x s8 pairs with maddubs, pairs of pairs with madd. Q8
 * weights are made signed again (xor 0x80) and multiplied as |w| x sign(x, w) (maddubs takes one
 * unsigned operand; |w| <= 127 keeps its int16 pair sums exact). */
AVX2_TARGET static inline void avx2_rows(int fmt, const uint8_t *tw, int nb, const QRows *xs, int planes, int k, int r0,
                                         int rt, int n0, int n, const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    __m256 acc[4][2];
    for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = tw + (size_t)b * bb;
        __m256i w[8][2];
        if (fmt != FMT_Q8) {
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * c + 32 * h));
                    w[c][h] = _mm256_and_si256(v, low);
                    w[c + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            if (fmt == FMT_Q6) /* the high 2 bits: unsigned q + 32 in 0..63 (pair sums stay in int16) */
                for (int g = 0; g < 8; g++)
                    for (int h = 0; h < 2; h++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 256 + 64 * (g >> 2) + 32 * h));
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (g & 3)), _mm256_set1_epi8(3));
                        w[g][h] = _mm256_or_si256(w[g][h], _mm256_slli_epi16(hi, 4));
                    }
        } else {
            for (int g = 0; g < 8; g++)
                for (int h = 0; h < 2; h++)
                    w[g][h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * g + 32 * h)), flip);
        }
        const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
        __m256 dw[2], mw[2];
        for (int h = 0; h < 2; h++) {
            dw[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + 8 * h)));
            mw[h] = fmt != FMT_Q8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hd + NT + 8 * h)))
                                  : _mm256_setzero_ps(); /* Q4's mins, Q6's second scales */
        }
        for (int a = 0; a < rt; a++)
            for (int pl = 0; pl < planes; pl++) {
                const QRows *x = xs + pl;
                int r = r0 + a;
                const int32_t *xq = (const int32_t *)(x->q + (size_t)r * k + (size_t)b * QK);
                __m256 t = _mm256_set1_ps(x->d[r * nb + b]), s = _mm256_set1_ps(x->s[r * nb + b]);
                for (int h = 0; h < 2; h++) {
                    __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                    for (int g = 0; g < 8; g++) {
                        __m256i xv = _mm256_set1_epi32(xq[g]), pr;
                        if (fmt != FMT_Q8) /* Q4 and Q6 weights are unsigned */
                            pr = _mm256_maddubs_epi16(w[g][h], xv);
                        else
                            pr = _mm256_maddubs_epi16(_mm256_abs_epi8(w[g][h]), _mm256_sign_epi8(xv, w[g][h]));
                        part[g >> 2] = _mm256_add_epi32(part[g >> 2], _mm256_madd_epi16(pr, ones));
                    }
                    if (fmt == FMT_Q6) { /* q + 32 stored: less 32 * sum(x q) per half; a scale per half */
                        const int32_t *hs = x->half + 2 * (r * nb + b);
                        __m256i lo = _mm256_sub_epi32(part[0], _mm256_set1_epi32(32 * hs[0]));
                        __m256i hi = _mm256_sub_epi32(part[1], _mm256_set1_epi32(32 * hs[1]));
                        acc[a][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(dw[h], t), acc[a][h]);
                        acc[a][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(mw[h], t), acc[a][h]);
                        continue;
                    }
                    __m256i dot = _mm256_add_epi32(part[0], part[1]);
                    __m256 tt = _mm256_mul_ps(dw[h], t);
                    acc[a][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), tt, acc[a][h]);
                    if (fmt == FMT_Q4) acc[a][h] = _mm256_fmadd_ps(mw[h], s, acc[a][h]);
                }
            }
    }
    for (int a = 0; a < rt; a++)
        for (int h = 0; h < 2; h++) avx2_store8(acc[a][h], (size_t)(r0 + a) * n + n0 + 8 * h, res, y, y_bf16);
}

/* AVX512-VNNI: 16 columns in one register; dpbusd sums 4 u8 x s8 products into each int32 lane. Q8
 * weights are stored + 128 (unsigned), so dpbusd gives dot + 128 * sum(x q), corrected exactly. */
VNNI_TARGET static inline void vnni_rows(int fmt, const uint8_t *tw, int nb, const QRows *xs, int planes, int k, int r0,
                                         int rt, int n0, int n, const void *res, void *y, int y_bf16) {
    int bb = block_bytes(fmt);
    __m512 acc[4];
    for (int a = 0; a < 4; a++) acc[a] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = tw + (size_t)b * bb;
        __m512i w[8];
        if (fmt != FMT_Q8) {
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(p + 64 * c));
                w[c] = _mm512_and_si512(v, low);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (fmt == FMT_Q6)
                for (int g = 0; g < 8; g++) {
                    __m512i v = _mm512_loadu_si512((const void *)(p + 256 + 64 * (g >> 2)));
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 2 * (g & 3)), _mm512_set1_epi8(3));
                    w[g] = _mm512_or_si512(w[g], _mm512_slli_epi16(hi, 4));
                }
        } else {
            for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(p + 64 * g));
        }
        const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
        __m512 mw = fmt != FMT_Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hd + NT))) : _mm512_setzero_ps();
        for (int a = 0; a < rt; a++)
            for (int pl = 0; pl < planes; pl++) {
                const QRows *x = xs + pl;
                int r = r0 + a;
                const int32_t *xq = (const int32_t *)(x->q + (size_t)r * k + (size_t)b * QK);
                /* four independent chains (dpbusd's latency), elements 0..15 in d0/d1 and 16..31 in d2/d3 */
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xq[0]));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xq[1]));
                __m512i d2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(xq[4]));
                __m512i d3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[5], _mm512_set1_epi32(xq[5]));
                d0 = _mm512_dpbusd_epi32(d0, w[2], _mm512_set1_epi32(xq[2]));
                d1 = _mm512_dpbusd_epi32(d1, w[3], _mm512_set1_epi32(xq[3]));
                d2 = _mm512_dpbusd_epi32(d2, w[6], _mm512_set1_epi32(xq[6]));
                d3 = _mm512_dpbusd_epi32(d3, w[7], _mm512_set1_epi32(xq[7]));
                if (fmt == FMT_Q6) { /* q + 32 stored: less 32 * sum(x q) per half; a scale per half */
                    const int32_t *hs = x->half + 2 * (r * nb + b);
                    __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(d0, d1), _mm512_set1_epi32(32 * hs[0]));
                    __m512i hi = _mm512_sub_epi32(_mm512_add_epi32(d2, d3), _mm512_set1_epi32(32 * hs[1]));
                    __m512 dx = _mm512_set1_ps(x->d[r * nb + b]);
                    acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, dx), acc[a]);
                    acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(mw, dx), acc[a]);
                    continue;
                }
                __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_add_epi32(d2, d3));
                if (fmt == FMT_Q8) /* stored + 128: the signed weights' dot, exactly */
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x->sum[r * nb + b]));
                __m512 tt = _mm512_mul_ps(dw, _mm512_set1_ps(x->d[r * nb + b]));
                acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), tt, acc[a]);
                if (fmt == FMT_Q4) acc[a] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->s[r * nb + b]), acc[a]);
            }
    }
    for (int a = 0; a < rt; a++) vnni_store16(acc[a], (size_t)(r0 + a) * n + n0, res, y, y_bf16);
}

/* One function per (path, tile rows) so the row loop is unrolled with its accumulators in registers. */
AVX2_TARGET static void avx2_tile(int fmt, const uint8_t *tw, int nb, const QRows *x, int planes, int k, int m, int n0,
                                  int n, const void *res, void *y, int y_bf16) {
    int r = 0;
    for (; r + 4 <= m; r += 4) avx2_rows(fmt, tw, nb, x, planes, k, r, 4, n0, n, res, y, y_bf16);
    for (; r < m; r++) avx2_rows(fmt, tw, nb, x, planes, k, r, 1, n0, n, res, y, y_bf16);
}

VNNI_TARGET static void vnni_tile(int fmt, const uint8_t *tw, int nb, const QRows *x, int planes, int k, int m, int n0,
                                  int n, const void *res, void *y, int y_bf16) {
    int r = 0;
    for (; r + 4 <= m; r += 4) vnni_rows(fmt, tw, nb, x, planes, k, r, 4, n0, n, res, y, y_bf16);
    for (; r < m; r++) vnni_rows(fmt, tw, nb, x, planes, k, r, 1, n0, n, res, y, y_bf16);
}
#endif

static int detect_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* The best path this CPU runs (2 AVX512-VNNI, 1 AVX2, 0 portable C). */
int blockq_best_isa(void) { return detect_isa(); }

static void free_rows(QRows *q) {
    free(q->q); free(q->d); free(q->s); free(q->sum); free(q->half);
}

static int alloc_rows(QRows *q, int m, int k) {
    int nb = k / QK;
    q->q = (int8_t *)malloc((size_t)m * k);
    q->d = (float *)malloc(sizeof(float) * (size_t)m * nb);
    q->s = (float *)malloc(sizeof(float) * (size_t)m * nb);
    q->sum = (int32_t *)malloc(sizeof(int32_t) * (size_t)m * nb);
    q->half = (int32_t *)malloc(sizeof(int32_t) * (size_t)m * nb * 2);
    return q->q && q->d && q->s && q->sum && q->half;
}

/* y[m, n] = norm(x[m, k]) @ W.T (+ res), W in `fmt` tiles; x, norm_w, res, y float32 or bf16 (uint16);
 * norm_w NULL: no norm. `planes`: 1 (int8 activations) or 2 (int8 plus the residual's int8 plane). `isa`
 * must not exceed blockq_best_isa(). Returns 0, or -1 on a bad shape or allocation failure. */
int blockq_gemm(int fmt, int isa, const uint8_t *w, int n, int k, const void *x, int x_bf16, int m, const void *res,
                void *y, int y_bf16, int threads, const void *norm_w, float eps, int planes) {
    if (n % NT || k % QK || m <= 0 || planes < 1 || planes > 2) return -1;
    int nb = k / QK, tiles = n / NT;
    size_t tile_bytes = (size_t)nb * block_bytes(fmt);
    QRows q[2];
    memset(q, 0, sizeof(q));
    float *row = (float *)malloc(sizeof(float) * (size_t)k);
    int ok = row != NULL;
    for (int pl = 0; pl < planes; pl++) ok = alloc_rows(&q[pl], m, k) && ok;
    if (!ok) {
        free_rows(&q[0]); free_rows(&q[1]); free(row);
        return -1;
    }
    quantize_rows(x, x_bf16, m, k, norm_w, eps, row, &q[0], planes == 2 ? &q[1] : NULL);
    free(row);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *tw = w + (size_t)t * tile_bytes;
#if defined(__x86_64__)
        if (isa == ISA_VNNI) {
            vnni_tile(fmt, tw, nb, q, planes, k, m, t * NT, n, res, y, y_bf16);
            continue;
        }
        if (isa == ISA_AVX2) {
            avx2_tile(fmt, tw, nb, q, planes, k, m, t * NT, n, res, y, y_bf16);
            continue;
        }
#endif
        tile_scalar(fmt, tw, nb, q, planes, k, 0, m, t * NT, n, res, y, y_bf16);
    }
    free_rows(&q[0]); free_rows(&q[1]);
    return 0;
}

/* Rows `ids` of W dequantized (the tied embedding's lookups): out[len(ids), k], float32 or bf16. */
int blockq_rows(int fmt, const uint8_t *w, int n, int k, const int64_t *ids, int count, void *out, int out_bf16) {
    if (n % NT || k % QK) return -1;
    int nb = k / QK, bb = block_bytes(fmt);
    size_t tile_bytes = (size_t)nb * bb;
    for (int i = 0; i < count; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= n) return -1;
        int t = (int)(id / NT), j = (int)(id % NT);
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = w + (size_t)t * tile_bytes + (size_t)b * bb;
            const uint16_t *hd = (const uint16_t *)(p + scales_at(fmt));
            float d = f16_to_f32(hd[j]), mn = fmt != FMT_Q8 ? f16_to_f32(hd[NT + j]) : 0.f;
            for (int g = 0; g < 8; g++) {
                for (int e = 0; e < 4; e++) {
                    int q = weight_at(fmt, p, j, g, e);
                    float v = fmt == FMT_Q4 ? fmaf((float)q, d, mn) : (float)q * (fmt == FMT_Q6 && g >= 4 ? mn : d);
                    size_t at = (size_t)i * k + (size_t)b * QK + 4 * g + e;
                    store_act(out, out_bf16, at, v);
                }
            }
        }
    }
    return 0;
}
