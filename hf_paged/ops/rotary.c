/* Rotate-half rotary embedding on bf16 heads, rounded as torch's bf16 operations round: for each token t, head h,
   lane i < D/2:   out[i]       = bf16(bf16(x[i] * cos[i])           + bf16(-x[i + D/2] * sin[i]))
   and i >= D/2:   out[i]       = bf16(bf16(x[i] * cos[i])           + bf16( x[i - D/2] * sin[i]))
   (``apply_rotary_pos_emb``: ``(x * cos) + (rotate_half(x) * sin)``, each product and the sum rounded to bf16), so
   the result equals torch's bit for bit. ``x`` holds ``T`` tokens of ``H`` heads of ``D`` lanes, each token's heads
   back to back from ``x + t * row_stride`` (a fused q/k/v GEMM's output row); ``out``: [T, H, D].
   ``cos``/``sin``: [T, D]. D: a multiple of 32. */

#include "cpu_vec.h"

/* 16 fp32 lanes -> bf16 bit patterns, nearest-even (as f32_to_bf16; NaN kept NaN) */
static inline vh round16(vf f) {
    vu u;
    memcpy(&u, &f, sizeof u);
    const vu nan = (u & 0x7fffffffu) > 0x7f800000u;
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu quiet = (u >> 16) | 0x40u;
    return __builtin_convertvector((rounded & ~nan) | (quiet & nan), vh);
}

static inline vf widen(vh h) {
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

void hf_paged_rotary(const uint16_t *x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t dim,
                     const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *src = x + t * row_stride + h * dim;
            uint16_t *dst = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i += LANES) {
                const vf lo = load16_bf16(src + i), hi = load16_bf16(src + half + i);
                const vf cl = load16_bf16(c + i), ch = load16_bf16(c + half + i);
                const vf sl = load16_bf16(s + i), sh = load16_bf16(s + half + i);
                const vh out_lo = round16(widen(round16(lo * cl)) + widen(round16(-hi * sl)));
                const vh out_hi = round16(widen(round16(hi * ch)) + widen(round16(lo * sh)));
                memcpy(dst + i, &out_lo, sizeof out_lo);
                memcpy(dst + half + i, &out_hi, sizeof out_hi);
            }
        }
    }
}
