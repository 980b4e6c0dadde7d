/* Vector helpers shared by the CPU kernels (decode_attention.c, int8_linear.c): 16 fp32 lanes as GCC vector
   extensions (one AVX-512 register, two AVX2 ones), bf16 <-> fp32, and sum reductions. */

#ifndef HF_PAGED_CPU_VEC_H
#define HF_PAGED_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef float vf __attribute__((vector_size(64)));         /* 16 fp32 lanes (two AVX2 registers, one AVX-512) */
typedef uint16_t vh __attribute__((vector_size(32)));      /* 16 bf16 bit patterns */
typedef uint32_t vu __attribute__((vector_size(64)));

/* 16 bf16 values at ``src`` as fp32 lanes */
static inline vf load16_bf16(const uint16_t *src) {
    vh h;
    memcpy(&h, src, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline vf load16(const void *base, int64_t offset, int elem) {
    if (elem == 2) return load16_bf16((const uint16_t *)base + offset);
    vf f;
    memcpy(&f, (const float *)base + offset, sizeof f);
    return f;
}

typedef int32_t vi __attribute__((vector_size(64)));

/* the sum of the 16 lanes, as a tree (a chain of 16 dependent adds per score was the kernel's bottleneck) */
static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (vi){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    return v[0];
}

/* 16 score vectors (one per position) -> one vector of their 16 lane sums, lane i = sum of v[i] (a transposing
   tree: 15 combines instead of 16 separate reductions) */
static inline vf sum16(vf *v) {
    static const vi lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                             {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                             {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                             {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
    static const vi hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                             {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                             {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                             {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
    int n = 16;
    for (int level = 0; level < 4; ++level, n /= 2)
        for (int i = 0; i < n / 2; ++i)
            v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo[level]) +
                   __builtin_shuffle(v[2 * i], v[2 * i + 1], hi[level]);
    return v[0];
}

#endif
