typedef unsigned short bf16_t;
typedef unsigned long long u64;

__device__ __forceinline__ float lo_bf(unsigned r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float hi_bf(unsigned r) { return __uint_as_float(r & 0xffff0000u); }
__device__ __forceinline__ unsigned to_bf(float f) {  // round to nearest even, as torch does
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_bf(float f) { return __uint_as_float(to_bf(f) << 16); }
// both halves of a * b rounded to bf16 once: what round_bf(lo_bf(a) * lo_bf(b)) gives (the fp32 product of two
// bf16 values is exact), in one instruction (the -0 added keeps a product's sign when it is zero)
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}
__device__ __forceinline__ float half_to_float(unsigned h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
// programmatic dependent launch (sm_90+; no-ops for a grid launched without it)
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ float silu_mul(float gate, float up) {
    float act = round_bf(__fdividef(gate, 1.0f + __expf(-gate)));
    return round_bf(act * up);
}
// Eight bf16 activations (four words) as floats; with SiLU, silu_mul of eight (gate, up) pairs.
__device__ __forceinline__ void bf16x8(const unsigned* pa, float* v) {
#pragma unroll
    for (int h = 0; h < 4; ++h) { v[2 * h] = lo_bf(pa[h]); v[2 * h + 1] = hi_bf(pa[h]); }
}
__device__ __forceinline__ void silu_mul_bf16x8(const unsigned* pa, const unsigned* pb, float* v) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        v[2 * h] = silu_mul(lo_bf(pa[h]), lo_bf(pb[h]));
        v[2 * h + 1] = silu_mul(hi_bf(pa[h]), hi_bf(pb[h]));
    }
}
// y (+ bias) rounded to bf16, stored as bf16 or as fp32 (logits), or added to the bf16 out (a residual
// stream: rounded as a bf16 tensor addition rounds)
__device__ __forceinline__ void store_out(void* out, const bf16_t* bias, int row, int n, int N, float y) {
#if BIAS
    y += lo_bf(bias[n]);
#endif
#if OUT_F32
    ((float*)out)[(u64)row * N + n] = round_bf(y);
#elif ACCUM
    bf16_t* p = (bf16_t*)out + (u64)row * N + n;
    *p = (bf16_t)to_bf(round_bf(y) + lo_bf(*p));
#else
    ((bf16_t*)out)[(u64)row * N + n] = (bf16_t)to_bf(y);
#endif
}
