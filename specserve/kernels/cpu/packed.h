// A product over a packed weight matrix (QuantWeight: bit-packed words, an fp16 (scale, min) pair per group),
// as the two packed kernels take it: gemv_q.c (fp32 activations) and gemv_i8.c (int8 activations).
#pragma once
#include <stdint.h>

typedef struct {
    const int32_t* words;  // [n, words_per_row]
    const uint16_t* sm;    // [n, groups_per_row, 2]
    float* out;            // [rows, n]
    int rows, n, words_per_row, groups_per_row, words_per_group, chunks;
} packed_product;
