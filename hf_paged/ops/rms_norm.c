/* RMSNorm of bf16 rows, bit for bit as transformers' RMSNorm computes it in torch:
       h = x.to(float32); variance = h.pow(2).mean(-1, keepdim=True)
       out = weight * (h * rsqrt(variance + eps)).to(bfloat16)
   Each square is rounded to fp32, then summed in the order of ATen's CPU sum over a contiguous row (cascade_sum's
   inner reduction: 8-lane vectors, four interleaved accumulators in up to four cascade levels of 16 steps, the
   scalar tail, then the lanes one by one), divided by n, 1 / sqrt(variance + eps), and each product rounded as
   torch's fp32 and bf16 operations round. ``rms_norm`` in cpu_kernels.py checks the result against torch once per
   process (another ATen may sum in another order) and keeps torch's operations if it differs. */

#pragma GCC optimize("fp-contract=off") /* a square and the sum it joins must round apart, as in torch */

#include <math.h>

#include "cpu_vec.h"

typedef float v8 __attribute__((vector_size(32)));

#define ILP 4
#define LEVELS 4

static inline v8 squares8(const uint16_t *src) {
    v8 f;
    for (int i = 0; i < 8; ++i) f[i] = bf16_to_f32(src[i]);
    return f * f;
}

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) ++r;
    return r;
}

/* ATen's multi_row_sum over ``size`` rows of ILP vectors (row i, column k: vector i * ILP + k of the row) */
static void multi_row_sum(const uint16_t *x, int64_t size, v8 out[ILP]) {
    int level_power = ceil_log2(size) / LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    v8 acc[LEVELS][ILP];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP; ++k) acc[0][k] += squares8(x + (i * ILP + k) * 8);
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = (v8){0};
            }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; ++k) acc[0][k] += squares8(x + (i * ILP + k) * 8);
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k) acc[0][k] += acc[j][k];
    for (int k = 0; k < ILP; ++k) out[k] = acc[0][k];
}

static float sum_of_squares(const uint16_t *x, int64_t n) {
    const int64_t vectors = n / 8, size = vectors / ILP;
    v8 partial[ILP];
    multi_row_sum(x, size, partial);
    for (int64_t i = size * ILP; i < vectors; ++i) partial[0] += squares8(x + i * 8);
    for (int k = 1; k < ILP; ++k) partial[0] += partial[k];
    float total = 0.0f;
    for (int64_t i = vectors * 8; i < n; ++i) {
        const float v = bf16_to_f32(x[i]);
        const float square = v * v;
        total += square;
    }
    for (int k = 0; k < 8; ++k) total += partial[0][k];
    return total;
}

void hf_paged_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t n,
                       float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = x + r * n;
        const float variance = sum_of_squares(row, n) / (float)n;
        const float scale = 1.0f / sqrtf(variance + eps);
        for (int64_t i = 0; i < n; ++i) {
            const float h = bf16_to_f32(row[i]) * scale;
            out[r * n + i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(h)));
        }
    }
}
