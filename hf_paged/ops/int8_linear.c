/* int8 weight-only linear on the CPU for the few rows of a decode step: out = x @ (w * scales)^T + bias.

   The C beside hf_paged/ops/cpu_kernels.py (``int8_linear``, which compiles it with decode_attention.c) and its
   PyTorch reference there (``int8_linear_reference``): fp32 products of the activations and the int8 weights, fp32
   sums, each sum times its column's scale plus the bias, rounded once to the activations' dtype (round to nearest
   even, as torch rounds). A decode step multiplies each weight by a few rows, so the time is the weights' bytes:
   int8 halves bf16's, and each tile of 16 columns is read from memory once for all rows (rows in chunks of up to 8
   while the tile stays in L1).

   Layouts (all contiguous):
     x      [rows, k]   bf16 or fp32 (elem 2 or 4)
     w      [n, k]      int8, symmetric, one scale per output channel
     scales [n]         fp32
     bias   [n]         the activations' dtype, or NULL
     out    [rows, n]   the activations' dtype
   k a multiple of 16 (cpu_kernels.int8_linear checks; other shapes run torch). Tiles of 16 columns are split over
   ``threads`` OpenMP threads. */

#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

#define TILE 16 /* columns per task: every row chunk's column groups below divide it */
#define PREFETCH_ROWS 16

/* 16 int8 weights as fp32 lanes (GCC turns a generic vector conversion from int8 into one insert per lane, so
   the x86 forms are spelled out) */
static inline vf load16_i8(const int8_t *src) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    const __m256 f[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
#else
    float f[LANES];
    for (int i = 0; i < LANES; ++i) f[i] = (float)src[i];
#endif
    vf v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* the sums of ``mb`` rows of x (fp32, [mb, k]) with ``nb`` weight rows from column n0, mb * nb <= 16: lane
   m * nb + j of the result is row m's sum for column n0 + j */
static inline __attribute__((always_inline)) vf dots(const float *x, const int8_t *w, int64_t k, int64_t n0, int mb,
                                                     int nb) {
    vf acc[16], xv[8];
    for (int i = 0; i < 16; ++i) acc[i] = (vf){0};
    for (int64_t c = 0; c < k; c += LANES) {
        for (int m = 0; m < mb; ++m) memcpy(&xv[m], x + m * k + c, sizeof xv[m]);
        for (int j = 0; j < nb; ++j) {
            const vf wv = load16_i8(w + (n0 + j) * k + c);
            for (int m = 0; m < mb; ++m) acc[m * nb + j] += xv[m] * wv;
        }
    }
    return sum16(acc);
}

/* the columns a chunk of mb rows takes at once: mb * columns <= 16 sums, a power of two that divides TILE */
#define COLUMNS(mb) ((mb) == 1 ? 16 : (mb) == 2 ? 8 : (mb) <= 4 ? 4 : 2)

/* a dots function called with the row count (1-8) as a constant, so its accumulators stay in registers */
#define BY_ROWS(fn, x, w, k, n0, mb)                                            \
    switch (mb) {                                                              \
        case 1: return fn(x, w, k, n0, 1, COLUMNS(1));                         \
        case 2: return fn(x, w, k, n0, 2, COLUMNS(2));                         \
        case 3: return fn(x, w, k, n0, 3, COLUMNS(3));                         \
        case 4: return fn(x, w, k, n0, 4, COLUMNS(4));                         \
        case 5: return fn(x, w, k, n0, 5, COLUMNS(5));                         \
        case 6: return fn(x, w, k, n0, 6, COLUMNS(6));                         \
        case 7: return fn(x, w, k, n0, 7, COLUMNS(7));                         \
        default: return fn(x, w, k, n0, 8, COLUMNS(8));                        \
    }

static vf dots_dispatch(const float *x, const int8_t *w, int64_t k, int64_t n0, int mb) {
    BY_ROWS(dots, x, w, k, n0, mb)
}

#if defined(__AVX512BF16__)
/* bf16 activations on a CPU with AVX512-BF16: 32 weights at a time turned into bf16 (exact: int8 fits bf16's
   mantissa), each multiplied with a row's 32 bf16 activations by one vdpbf16ps (pairs of products summed into 16
   fp32 lanes): twice the products of an fp32 FMA, and the activations read as they are */
static inline __m512bh load32_i8_bf16(const int8_t *src) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) vf dots_bf16(const uint16_t *x, const int8_t *w, int64_t k, int64_t n0,
                                                          int mb, int nb) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 2 * LANES) {
        for (int j = 0; j < nb; ++j) {
            /* the next tile's rows, ahead of their use (past the last row the CPU drops the hint) */
            _mm_prefetch((const char *)(w + (n0 + j + PREFETCH_ROWS) * k + c), _MM_HINT_T0);
            const __m512bh wv = load32_i8_bf16(w + (n0 + j) * k + c);
            for (int m = 0; m < mb; ++m)
                acc[m * nb + j] = _mm512_dpbf16_ps(acc[m * nb + j], (__m512bh)_mm512_loadu_si512(x + m * k + c), wv);
        }
    }
    vf v[16];
    memcpy(v, acc, sizeof v);
    return sum16(v);
}

static vf dots_bf16_dispatch(const uint16_t *x, const int8_t *w, int64_t k, int64_t n0, int mb) {
    BY_ROWS(dots_bf16, x, w, k, n0, mb)
}
#endif

/* one tile: columns [first, last) for rows [m0, m0 + mb), the sums into tile[m][column - first] */
static void tile_sums(const void *x, const float *xf, const int8_t *w, float tile[8][TILE], int64_t k, int64_t m0,
                      int mb, int64_t first, int64_t last, int bf16) {
    const int nb = COLUMNS(mb);
    for (int64_t n0 = first; n0 < last; n0 += nb) {
        float sums[16];
        if (n0 + nb <= last) {
            vf s;
#if defined(__AVX512BF16__)
            if (bf16) s = dots_bf16_dispatch((const uint16_t *)x + m0 * k, w, k, n0, mb);
            else
#endif
                s = dots_dispatch(xf + m0 * k, w, k, n0, mb);
            memcpy(sums, &s, sizeof s);
        } else { /* the last columns of a width that is not a multiple of 16: one at a time */
            for (int j = 0; j < last - n0; ++j)
                for (int m = 0; m < mb; ++m) sums[m * nb + j] = dots(xf + (m0 + m) * k, w, k, n0 + j, 1, 1)[0];
        }
        for (int m = 0; m < mb; ++m)
            for (int j = 0; j < nb && n0 + j < last; ++j) tile[m][n0 + j - first] = sums[m * nb + j];
    }
    (void)bf16;
}

void hf_paged_int8_linear(const void *x, const int8_t *w, const float *scales, const void *bias, void *out,
                          int64_t rows, int64_t n, int64_t k, int elem, int threads) {
#if defined(__AVX512BF16__)
    const int bf16 = elem == 2 && k % (2 * LANES) == 0 && n % TILE == 0;
#else
    const int bf16 = 0;
#endif
    float *xf = NULL; /* the activations once in fp32, where the bf16 path does not take them as they are */
    if (!bf16) {
        xf = malloc(sizeof(float) * (size_t)(rows * k));
        for (int64_t i = 0; i < rows * k; i += LANES) {
            const vf v = load16(x, i, elem);
            memcpy(xf + i, &v, sizeof v);
        }
    }
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * TILE, last = first + TILE < n ? first + TILE : n;
        for (int64_t m0 = 0; m0 < rows; m0 += 8) {
            const int mb = rows - m0 < 8 ? (int)(rows - m0) : 8;
            float tile[8][TILE];
            tile_sums(x, xf, w, tile, k, m0, mb, first, last, bf16);
            for (int m = 0; m < mb; ++m)
                for (int64_t col = first; col < last; ++col) {
                    const int64_t at = (m0 + m) * n + col;
                    float v = tile[m][col - first] * scales[col];
                    if (elem == 2) {
                        if (bias != NULL) v += bf16_to_f32(((const uint16_t *)bias)[col]);
                        ((uint16_t *)out)[at] = f32_to_bf16(v);
                    } else {
                        if (bias != NULL) v += ((const float *)bias)[col];
                        ((float *)out)[at] = v;
                    }
                }
        }
    }
    free(xf);
}
