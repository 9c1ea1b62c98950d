// KV cache rows as kernels/kv_format.py lays them out: fp32 (bits 0), fp16 (bits 16), or packed q8_0 / q4_0
// (bits 8 / 4): the codes of `dim` values, then dim / 32 fp16 scales. q4_0's byte j holds value j (low nibble) and value
// j + dim / 2 (high nibble). Encoding rounds as the torch reference does (scale rounded to fp16 first; q8_0 to
// the nearest code, ties to even; q4_0 floor(x / scale + 8.5)), so either path writes the same bytes.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KV_GROUP 32

#define KV_F16 16

// Storage elements (floats, halves, or bytes when packed) of one row, and the bytes of an element.
static inline int64_t kv_row_width(int dim, int bits) {
    return bits == 0 || bits == KV_F16 ? dim : (int64_t)dim * bits / 8 + dim / 16;
}
static inline int kv_elem_bytes(int bits) { return bits == 0 ? 4 : bits == KV_F16 ? 2 : 1; }

static inline float kv_half_to_float(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// x [dim] -> a packed row.
static inline void kv_encode_row(const float* x, uint8_t* row, int dim, int bits) {
    const int n_code = dim * bits / 8;
    for (int g = 0; g < dim / KV_GROUP; ++g) {
        const float* xg = x + g * KV_GROUP;
        float picked = 0.0f, amax = 0.0f;  // q4_0: the signed value of largest magnitude (the first of equals)
        for (int i = 0; i < KV_GROUP; ++i) {
            if (fabsf(xg[i]) > amax) {
                amax = fabsf(xg[i]);
                picked = xg[i];
            }
        }
        const uint16_t h = _cvtss_sh(bits == 8 ? amax / 127.0f : picked / -8.0f + 0.0f, _MM_FROUND_TO_NEAREST_INT);
        memcpy(row + n_code + 2 * g, &h, 2);
        const float s = _cvtsh_ss(h), inv = s == 0.0f ? 0.0f : 1.0f / s;
        for (int i = 0; i < KV_GROUP; ++i) {
            const int j = g * KV_GROUP + i;
            if (bits == 8) {
                float c = nearbyintf(xg[i] * inv);
                c = c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c);
                row[j] = (uint8_t)(int8_t)c;
            } else {
                float c = floorf(xg[i] * inv + 8.5f);
                c = c > 15.0f ? 15.0f : (c < 0.0f ? 0.0f : c);
                const int half = dim / 2, at = j % half;
                row[at] = j < half ? (uint8_t)((row[at] & 0xF0) | (int)c) : (uint8_t)((row[at] & 0x0F) | ((int)c << 4));
            }
        }
    }
}

// A packed or fp16 row -> out [dim]. Each group's loop has one form (no per-value branch), so the compiler
// vectorises it.
static inline void kv_decode_row(const uint8_t* row, float* out, int dim, int bits) {
    if (bits == KV_F16) {
        const uint16_t* h = (const uint16_t*)row;
        for (int j = 0; j < dim; ++j) out[j] = _cvtsh_ss(h[j]);
        return;
    }
    const int n_code = dim * bits / 8, half = dim / 2;
    for (int j0 = 0; j0 < dim; j0 += KV_GROUP) {
        const float s = kv_half_to_float(row + n_code + 2 * (j0 / KV_GROUP));
        float* o = out + j0;
        if (bits == 8) {
            const int8_t* c = (const int8_t*)row + j0;
            for (int i = 0; i < KV_GROUP; ++i) o[i] = s * (float)c[i];
        } else if (j0 + KV_GROUP <= half) {
            for (int i = 0; i < KV_GROUP; ++i) o[i] = s * (float)((row[j0 + i] & 15) - 8);
        } else if (j0 >= half) {
            for (int i = 0; i < KV_GROUP; ++i) o[i] = s * (float)((row[j0 - half + i] >> 4) - 8);
        } else {  // a group across the middle (head sizes that are an odd multiple of 32)
            for (int i = 0; i < KV_GROUP; ++i) {
                const int j = j0 + i;
                o[i] = s * (float)((j < half ? row[j] & 15 : row[j - half] >> 4) - 8);
            }
        }
    }
}

// Store x [dim] as the row at `at` (storage elements of a cache with this row format); fp16 rounds to nearest even,
// as torch's conversion does.
static inline void kv_store_row(const float* x, void* cache, int64_t at, int dim, int bits) {
    if (bits == 0) {
        memcpy((float*)cache + at, x, sizeof(float) * (size_t)dim);
    } else if (bits == KV_F16) {
        uint16_t* h = (uint16_t*)cache + at;
        for (int j = 0; j < dim; ++j) h[j] = _cvtss_sh(x[j], _MM_FROUND_TO_NEAREST_INT);
    } else {
        kv_encode_row(x, (uint8_t*)cache + at, dim, bits);
    }
}
