/* Paged decode attention on the CPU: one query token per row, read straight from the pool's blocks.

   The C beside hf_paged/ops/cpu_kernels.py (which compiles it once with the system's C compiler and calls it
   through ctypes) and the PyTorch reference it stands in for, hf_paged/ops/reference.py's decode part: for each
   row and KV head, the query heads of that KV head score every position of the row's blocks (fp32 dot products
   of the bf16 or fp32 values), masked positions drop out, an exact two-pass softmax, and the probabilities weight
   the value rows; the output is rounded once to the query's dtype (round to nearest even, as torch rounds).
   No gather copies the blocks, and no attention call is made per layer beyond this one.

   Layouts (all contiguous):
     q      [rows, hq, d]                    bf16 or fp32 (elem 2 or 4), same as the caches
     kc, vc [num_blocks, block, hkv, d]
     tables [rows, nb] int64                 physical block of each of the row's nb context blocks
     mask   [rows, nb * block] uint8 or NULL 1: the position is attended (NULL: every position)
     out    [rows, hq, d]
   Head sizes a multiple of 16 up to 256, at most 8 query heads per KV head (cpu_kernels.supports checks; other
   shapes run the reference). Work is split over (row, KV head) pairs with OpenMP, ``threads`` threads. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

static inline vf bits_f(vi v) {
    vf f;
    memcpy(&f, &v, sizeof f);
    return f;
}

static inline vi f_bits(vf f) {
    vi v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* e^x in 16 lanes (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2], about 1 ulp; -inf and
   anything below -87.3 give 0) */
static inline vf exp16(vf x) {
    const vi below = x < -87.3f;  /* -1 in the lanes where it holds (C vector compare) */
    x = bits_f((below & f_bits((vf){0} - 87.3f)) | (~below & f_bits(x)));
    const vf t = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);  /* truncated: floor below */
    n += __builtin_convertvector(n > t, vf);  /* -1 where truncation rounded a negative up */
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vf out = p * bits_f((__builtin_convertvector(n, vi) + 127) << 23);
    return bits_f(~below & f_bits(out));
}

#if defined(__AVX512BF16__)
/* pass 2 for bf16 (head size a multiple of 32): the probabilities rounded to bf16, two positions' values interleaved
   so one vdpbf16ps adds both positions' products for 16 dimensions (unpacking works within 128-bit lanes: lane i of
   the low half holds dimension (i / 4) * 8 + i % 4 of its 32, the high half that plus 4) */
static inline __attribute__((always_inline)) void values_bf16(const void *vc, const int64_t *tables,
                                                              const uint8_t *mask, void *out, int64_t r, int64_t h,
                                                              int64_t hq, int64_t hkv, int64_t d, int64_t block,
                                                              int64_t nb, const float *scores, uint16_t *probs,
                                                              int64_t group) {
    const int64_t length = nb * block, wide = d / (2 * LANES);
    for (int64_t g = 0; g < group; ++g) {
        int64_t pos = 0;
        for (; pos + LANES <= length; pos += LANES)
            _mm256_storeu_si256((__m256i *)(probs + g * (length + 2) + pos),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + g * length + pos)));
        for (; pos < length; ++pos) probs[g * (length + 2) + pos] = f32_to_bf16(scores[g * length + pos]);
        probs[g * (length + 2) + length] = 0; /* the pair partner of an odd last position */
    }
    __m512 lo[8 * 8], hi[8 * 8]; /* [group, d / 32]: up to 8 heads of 256 */
    for (int64_t i = 0; i < group * wide; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    int64_t j = 0, offset = 0;
    for (int64_t pos = 0; pos < length; pos += 2) {
        int64_t at[2];
        for (int e = 0; e < 2; ++e) {
            at[e] = -1;
            if (pos + e < length) {
                at[e] = ((tables[r * nb + j] * block + offset) * hkv + h) * d;
                if (++offset == block) offset = 0, ++j;
                if (mask != NULL && !mask[r * length + pos + e]) at[e] = -1; /* its slot may hold anything */
            }
        }
        __m512i vlo[8], vhi[8];
        for (int64_t c = 0; c < wide; ++c) {
            const __m512i v0 = at[0] < 0 ? _mm512_setzero_si512()
                                         : _mm512_loadu_si512((const uint16_t *)vc + at[0] + c * 2 * LANES);
            const __m512i v1 = at[1] < 0 ? _mm512_setzero_si512()
                                         : _mm512_loadu_si512((const uint16_t *)vc + at[1] + c * 2 * LANES);
            vlo[c] = _mm512_unpacklo_epi16(v0, v1);
            vhi[c] = _mm512_unpackhi_epi16(v0, v1);
        }
        for (int64_t g = 0; g < group; ++g) {
            uint32_t pair;
            memcpy(&pair, probs + g * (length + 2) + pos, sizeof pair);
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int64_t c = 0; c < wide; ++c) {
                lo[g * wide + c] = _mm512_dpbf16_ps(lo[g * wide + c], w, (__m512bh)vlo[c]);
                hi[g * wide + c] = _mm512_dpbf16_ps(hi[g * wide + c], w, (__m512bh)vhi[c]);
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        uint16_t *dst = (uint16_t *)out + (r * hq + h * group + g) * d;
        for (int64_t c = 0; c < wide; ++c) {
            float a[LANES], b[LANES];
            _mm512_storeu_ps(a, lo[g * wide + c]);
            _mm512_storeu_ps(b, hi[g * wide + c]);
            for (int i = 0; i < LANES; ++i) {
                const int64_t dim = c * 2 * LANES + (i / 4) * 8 + i % 4;
                dst[dim] = f32_to_bf16(a[i]);
                dst[dim + 4] = f32_to_bf16(b[i]);
            }
        }
    }
}
#endif

/* one (row, KV head) task: the scores of its query heads over the row's positions, their softmax, the weighted
   values */
static inline __attribute__((always_inline)) void task_vec(const void *q, const void *kc, const void *vc, const int64_t *tables, const uint8_t *mask,
                     void *out, int64_t r, int64_t h, int64_t hq, int64_t hkv, int64_t d, int64_t block,
                     int64_t nb, float scale, int elem, float *scores, int64_t group) {
    const int64_t length = nb * block, chunks = d / LANES;
#if defined(__AVX512BF16__)
    const int pairs = elem == 2 && chunks % 2 == 0; /* the AVX512-BF16 form: bf16 heads of a multiple of 32 */
#else
    const int pairs = 0;
#endif
    vf qv[8 * 16], acc[8 * 16], part[8][16];
    float top[8];
    for (int64_t g = 0; g < group; ++g) {
        top[g] = -INFINITY;
        for (int64_t c = 0; c < chunks && !pairs; ++c) {
            qv[g * chunks + c] = load16(q, (r * hq + h * group + g) * d + c * LANES, elem) * scale;
            acc[g * chunks + c] = (vf){0};
        }
    }
    const float qscale = pairs ? scale : 1.0f; /* the pairs form scales the scores, not the query */
#if defined(__AVX512BF16__)
    __m512bh qb[8 * 8]; /* the pairs form: the query as it is */
    for (int64_t g = 0; g < group && pairs; ++g)
        for (int64_t c = 0; c < chunks / 2; ++c)
            qb[g * 8 + c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + (r * hq + h * group + g) * d + c * 2 * LANES);
#endif
    /* pass 1: scores, 16 positions at a time (the last group of a row padded with masked positions); the position's
       block and offset are stepped, not divided (an integer division per position cost more than its dot product) */
    int64_t j = 0, offset = 0;
    for (int64_t first = 0; first < length; first += LANES) {
        for (int p = 0; p < LANES; ++p) {
            const int64_t pos = first + p;
            int64_t at = -1;
            if (pos < length) {
                at = ((tables[r * nb + j] * block + offset) * hkv + h) * d;
                if (++offset == block) offset = 0, ++j;
                if (mask != NULL && !mask[r * length + pos]) at = -1;
            }
            if (at < 0) {
                for (int64_t g = 0; g < group; ++g) part[g][p] = (vf){0};
                continue;
            }
#if defined(__AVX512BF16__)
            if (pairs) {  /* 32 products per instruction, the key as it is */
                __m512i k2[8];
                for (int64_t c = 0; c < chunks / 2; ++c) k2[c] = _mm512_loadu_si512((const uint16_t *)kc + at + c * 2 * LANES);
                for (int64_t g = 0; g < group; ++g) {
                    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g * 8], (__m512bh)k2[0]);
                    for (int64_t c = 1; c < chunks / 2; ++c) sum = _mm512_dpbf16_ps(sum, qb[g * 8 + c], (__m512bh)k2[c]);
                    memcpy(&part[g][p], &sum, sizeof sum);
                }
                continue;
            }
#endif
            vf k[16];
            for (int64_t c = 0; c < chunks; ++c) k[c] = load16(kc, at + c * LANES, elem);
            for (int64_t g = 0; g < group; ++g) {  /* one register sum per query head: stored once */
                vf sum = qv[g * chunks] * k[0];
                for (int64_t c = 1; c < chunks; ++c) sum += qv[g * chunks + c] * k[c];
                part[g][p] = sum;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            vf s = sum16(part[g]) * qscale;
#if defined(__AVX512F__)
            if (first + LANES <= length) {  /* 16 positions at once: masked ones -inf */
                __m512 v;
                memcpy(&v, &s, sizeof v);
                if (mask != NULL) {
                    const __m128i bytes = _mm_loadu_si128((const __m128i *)(mask + r * length + first));
                    v = _mm512_mask_blend_ps(_mm_test_epi8_mask(bytes, bytes), _mm512_set1_ps(-INFINITY), v);
                }
                _mm512_storeu_ps(scores + g * length + first, v);
                const float most = _mm512_reduce_max_ps(v);
                if (most > top[g]) top[g] = most;
                continue;
            }
#endif
            for (int p = 0; p < LANES && first + p < length; ++p) {
                const int64_t pos = first + p;
                const float v = (mask != NULL && !mask[r * length + pos]) ? -INFINITY : s[p];
                scores[g * length + pos] = v;
                if (v > top[g]) top[g] = v;
            }
        }
    }
    /* softmax, 16 lanes at a time */
    for (int64_t g = 0; g < group; ++g) {
        float *row = scores + g * length;
        if (top[g] == -INFINITY) {
            memset(row, 0, sizeof(float) * (size_t)length);
            continue;
        }
        vf total = (vf){0};
        int64_t pos = 0;
        for (; pos + LANES <= length; pos += LANES) {
            vf x;
            memcpy(&x, row + pos, sizeof x);
            x = exp16(x - top[g]);
            memcpy(row + pos, &x, sizeof x);
            total += x;
        }
        float sum = hsum(total);
        for (; pos < length; ++pos) {
            row[pos] = expf(row[pos] - top[g]);
            sum += row[pos];
        }
        const float inv = 1.0f / sum;
        for (pos = 0; pos + LANES <= length; pos += LANES) {
            vf x;
            memcpy(&x, row + pos, sizeof x);
            x *= inv;
            memcpy(row + pos, &x, sizeof x);
        }
        for (; pos < length; ++pos) row[pos] *= inv;
    }
    /* pass 2: the weighted values */
#if defined(__AVX512BF16__)
    if (pairs) {
        values_bf16(vc, tables, mask, out, r, h, hq, hkv, d, block, nb, scores, (uint16_t *)(scores + group * length),
                    group);
        return;
    }
#endif
    j = 0, offset = 0;
    for (int64_t pos = 0; pos < length; ++pos) {
        const int64_t at = ((tables[r * nb + j] * block + offset) * hkv + h) * d;
        if (++offset == block) offset = 0, ++j;
        if (mask != NULL && !mask[r * length + pos]) continue;
        for (int64_t c = 0; c < chunks; ++c) {
            const vf v = load16(vc, at + c * LANES, elem);
            for (int64_t g = 0; g < group; ++g) acc[g * chunks + c] += scores[g * length + pos] * v;
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        const int64_t at = (r * hq + h * group + g) * d;
        for (int64_t c = 0; c < chunks; ++c) {
            const vf a = acc[g * chunks + c];
            for (int i = 0; i < LANES; ++i) {
                if (elem == 2) ((uint16_t *)out)[at + c * LANES + i] = f32_to_bf16(a[i]);
                else ((float *)out)[at + c * LANES + i] = a[i];
            }
        }
    }
}

/* task_vec with its loop bounds and element size as constants for the common bf16 shapes (head size 64 or 128, 1-8
   query heads per KV head), so its accumulators stay in registers; other shapes take the general form */
#define SHAPE(G, C)                                                                                              \
    case (G) * 32 + (C):                                                                                         \
        task_vec(q, kc, vc, tables, mask, out, r, h, hq, hkv, (C) * LANES, block, nb, scale, 2, scores, (G));    \
        return;
#define GROUPS(C) SHAPE(1, C) SHAPE(2, C) SHAPE(3, C) SHAPE(4, C) SHAPE(5, C) SHAPE(6, C) SHAPE(7, C) SHAPE(8, C)

static void task_dispatch(const void *q, const void *kc, const void *vc, const int64_t *tables, const uint8_t *mask,
                          void *out, int64_t r, int64_t h, int64_t hq, int64_t hkv, int64_t d, int64_t block,
                          int64_t nb, float scale, int elem, float *scores, int64_t group) {
    switch (elem == 2 ? group * 32 + d / LANES : 0) {  /* bf16: the engine's case */
        GROUPS(4)
        GROUPS(8)
        default:
            task_vec(q, kc, vc, tables, mask, out, r, h, hq, hkv, d, block, nb, scale, elem, scores, group);
    }
}

void hf_paged_decode_attention(const void *q, const void *kc, const void *vc, const int64_t *tables,
                               const uint8_t *mask, void *out, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                               int64_t block, int64_t nb, float scale, int elem, int threads) {
    const int64_t group = hq / hkv, length = nb * block;
#pragma omp parallel num_threads(threads)
    {
        /* [group, length] fp32 scores, then [group, length + 2] bf16 probabilities */
        float *scores = malloc(sizeof(float) * (size_t)(group * length) + sizeof(uint16_t) * (size_t)(group * (length + 2)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * hkv; ++task)
            task_dispatch(q, kc, vc, tables, mask, out, task / hkv, task % hkv, hq, hkv, d, block, nb, scale, elem,
                          scores, group);
        free(scores);
    }
}
