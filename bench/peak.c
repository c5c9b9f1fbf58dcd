/* The vector units' arithmetic peak, measured: for bench/peak.py (the benchmark's compute limit).
 *
 * Each thread runs independent chains of one multiply-add instruction (more chains than the
 * instruction's latency times its issue rate, so the units never wait) on data that stays in
 * registers: no memory traffic, nothing a matrix product could do faster on these units. torch's
 * own matmul is the other measure of the limit; on some CPUs it falls well short of this (MKL's
 * float32 matmul on AMD's Zen 5 reached ~216 GFLOP/s of this CPU's measured ~2x that).
 *
 * Built by bench/peak.py with the system's C compiler, never shipped or imported by the service. */
#include <pthread.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define CHAINS 16

/* Returns the flops one call did, and a sum of the accumulators so nothing is optimised away. */
#define CHAIN_LOOP(TYPE, ZERO, OP, SUM)                                                              \
    TYPE a[CHAINS];                                                                                        \
    for (int c = 0; c < CHAINS; c++) a[c] = ZERO;                                                          \
    for (long i = 0; i < iters; i++)                                                                       \
        for (int c = 0; c < CHAINS; c++) a[c] = OP;                                                        \
    float s = 0;                                                                                           \
    for (int c = 0; c < CHAINS; c++) s += SUM(a[c]);                                                       \
    *sink = s;

__attribute__((target("avx2,fma"))) static float sum256(__m256 v) {
    float f[8], s = 0;
    _mm256_storeu_ps(f, v);
    for (int i = 0; i < 8; i++) s += f[i];
    return s;
}

__attribute__((target("avx2,fma"))) static double fma256(long iters, float *sink) {
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    CHAIN_LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a[c], x, y), sum256)
    return (double)iters * CHAINS * 8 * 2;
}

__attribute__((target("avx512f"))) static double fma512(long iters, float *sink) {
    const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    CHAIN_LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a[c], x, y), _mm512_reduce_add_ps)
    return (double)iters * CHAINS * 16 * 2;
}

/* VDPBF16PS: per float32 lane, two bf16 products added (64 flops per 512-bit instruction). */
__attribute__((target("avx512f,avx512bf16"))) static double dpbf16(long iters, float *sink) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
    CHAIN_LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(a[c], x, y), _mm512_reduce_add_ps)
    return (double)iters * CHAINS * 16 * 2 * 2;
}

static int supported(int kind) {
    switch (kind) {
    case 0: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 1: return __builtin_cpu_supports("avx512f");
    case 2: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    default: return 0;
    }
}

typedef struct {
    int kind;
    long iters;
    double flops;
    float sink;
} Work;

static void *run(void *arg) {
    Work *w = arg;
    w->flops = w->kind == 0 ? fma256(w->iters, &w->sink) : w->kind == 1 ? fma512(w->iters, &w->sink)
                                                                        : dpbf16(w->iters, &w->sink);
    return NULL;
}
#else
static int supported(int kind) { (void)kind; return 0; }
#endif

/* FLOP/s of `threads` threads each running `iters` iterations of kind 0 (AVX2 FMA), 1 (AVX-512 FMA)
 * or 2 (AVX512-BF16 dot products); -1 where this CPU lacks the instructions. */
double peak_flops(int kind, int threads, long iters) {
    if (!supported(kind) || threads < 1 || threads > 256) return -1;
#if defined(__x86_64__)
    pthread_t tid[256];
    Work work[256];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++) {
        work[t] = (Work){kind, iters, 0, 0};
        if (pthread_create(&tid[t], NULL, run, &work[t]) != 0) return -1;
    }
    double flops = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        flops += work[t].flops;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return flops / ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
#else
    return -1;
#endif
}
