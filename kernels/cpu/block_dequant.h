/* One weight row's float32 values from its ggml blocks (ggml's dequantize, the same float
 * operations as gguf-py: a scale times an integer code is exact in float32, so only the minimum's
 * add or subtract rounds), for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K and
 * Q6_K.
 * Prompts multiply these rows in an exact fp32 GEMM (kernels/quant/linear_native.py). */
#ifndef LOCALLLM_BLOCK_DEQUANT_H
#define LOCALLLM_BLOCK_DEQUANT_H
#include "block_dots.h"

static int64_t block_row_bytes(int type, int64_t k) {
    switch (type) {
    case MXFP4: return k / 32 * 17;
    case Q4_0: case IQ4_NL: return k / 32 * 18;
    case Q4_1: return k / 32 * 20;
    case Q5_0: return k / 32 * 22;
    case Q5_1: return k / 32 * 24;
    case Q8_0: return k / 32 * 34;
    case IQ4_XS: return k / 256 * 136;
    case Q4_K: return k / 256 * 144;
    case Q5_K: return k / 256 * 176;
    case Q6_K: return k / 256 * 210;
    default: return -1;
    }
}

/* 32 values of a nibble run (low nibbles then high) with optional fifth bits (32-bit word) */
static void codes32(const uint8_t *qs, const uint8_t *qh, int *c) {
    uint32_t h = 0;
    if (qh) memcpy(&h, qh, 4);
    for (int l = 0; l < 16; l++) {
        c[l] = (qs[l] & 0xF) | (int)(((h >> l) & 1) << 4);
        c[l + 16] = (qs[l] >> 4) | (int)(((h >> (l + 16)) & 1) << 4);
    }
}

/* Q4_K (fifth bits NULL) or Q5_K super-block: d x scale x code - dmin x min per 32 */
static void dequant_k45(const uint8_t *b, const uint8_t *qh, const uint8_t *q, float *y) {
    const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
    const uint8_t *sc = b + 4;
    for (int g = 0; g < 8; g += 2, q += 32, y += 64) {
        int s0, m0, s1, m1;
        scale_min_k4(g, sc, &s0, &m0);
        scale_min_k4(g + 1, sc, &s1, &m1);
        const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        for (int l = 0; l < 32; l++) {
            const int h0 = qh ? ((qh[l] >> g) & 1) << 4 : 0, h1 = qh ? ((qh[l] >> (g + 1)) & 1) << 4 : 0;
            y[l] = d0 * (float)((q[l] & 0xF) | h0) - n0;
            y[l + 32] = d1 * (float)((q[l] >> 4) | h1) - n1;
        }
    }
}

static void dequant_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(rd16(b + 208));
    for (int n2 = 0; n2 < 2; n2++, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
    }
}

/* y [k] = the values of one row of `type` at b; 0 for an unknown type */
static int dequant_row(int type, const uint8_t *b, int64_t k, float *y) {
    int c[32];
    switch (type) {
    case Q4_K: case Q5_K: {
        const int64_t bytes = type == Q4_K ? 144 : 176;
        for (int64_t j = 0; j < k / 256; j++, b += bytes, y += 256)
            dequant_k45(b, type == Q5_K ? b + 16 : NULL, b + (type == Q4_K ? 16 : 48), y);
        return 1;
    }
    case Q6_K:
        for (int64_t j = 0; j < k / 256; j++, b += 210, y += 256) dequant_q6_k(b, y);
        return 1;
    case Q8_0:
        for (int64_t j = 0; j < k / 32; j++, b += 34, y += 32) {
            const float d = h2f(rd16(b));
            for (int l = 0; l < 32; l++) y[l] = (float)(int8_t)b[2 + l] * d;
        }
        return 1;
    case IQ4_XS:
        for (int64_t j = 0; j < k / 256; j++, b += 136) {
            for (int ib = 0; ib < 8; ib++, y += 32) {
                const float dl = h2f(rd16(b)) * (float)iq4xs_scale(b, ib);
                codes32(b + 8 + 16 * ib, NULL, c);
                for (int l = 0; l < 32; l++) y[l] = dl * (float)IQ4NL_VALUES[c[l]];
            }
        }
        return 1;
    case MXFP4:
        for (int64_t j = 0; j < k / 32; j++, b += 17, y += 32) {
            const float d = e8m0_half(b[0]);
            codes32(b + 1, NULL, c);
            for (int l = 0; l < 32; l++) y[l] = d * (float)FP4_VALUES[c[l]];
        }
        return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case IQ4_NL: {
        const int64_t bytes = block_row_bytes(type, 32);
        const int at = type == Q4_0 || type == IQ4_NL ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        for (int64_t j = 0; j < k / 32; j++, b += bytes, y += 32) {
            const float d = h2f(rd16(b));
            codes32(b + at, type == Q5_0 ? b + 2 : type == Q5_1 ? b + 4 : NULL, c);
            if (type == Q4_1 || type == Q5_1) {
                const float m = h2f(rd16(b + 2));
                for (int l = 0; l < 32; l++) y[l] = d * (float)c[l] + m;
            } else {
                const int off = type == Q4_0 ? 8 : 16;
                for (int l = 0; l < 32; l++)
                    y[l] = d * (float)(type == IQ4_NL ? IQ4NL_VALUES[c[l]] : c[l] - off);
            }
        }
        return 1;
    }
    default:
        return 0;
    }
}
#endif /* LOCALLLM_BLOCK_DEQUANT_H */
