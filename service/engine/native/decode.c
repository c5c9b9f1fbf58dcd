/* One forward step of a GPT-2 decoder over token rows on CPU, in one call: decode rows and prompt
 * chunks (service/engine/native_step.py). Weights and KV cache in float32 or bfloat16; arithmetic
 * in float32.
 *
 * Why this exists (measured on the 2-core AVX2 EPYC, see docs/engine.md): at batch 1 a decode step
 * streams every weight once, so it is bound by memory bandwidth, yet through torch it ran at 5-7
 * GB/s against 25-30 GB/s a plain two-thread read reaches: ~25 library calls per step, each its own
 * parallel region, each handing its weight to the threads in its own way, plus the ops between
 * them. Here the whole step is one OpenMP parallel region, each thread streams long contiguous
 * chunks of every weight (claimed from a shared counter, see claim), and the threads meet at a
 * barrier only where the next phase reads what another thread wrote.
 *
 * Threads: the region runs on the calling thread's OpenMP team through libgomp's own entry points
 * (GOMP_parallel, GOMP_barrier), handed in by the caller from the libgomp torch already loaded. So
 * the step reuses the pool torch's kernels use (its workers already spinning between steps) and
 * never starts a second one: two pools on two cores made every region pay futex wake-ups.
 *
 * Nothing here links a Python or torch header: the caller passes raw pointers to tensors it keeps
 * alive (linear weights packed in panels, see gemv; the KV cache's (slots, heads, window, head_dim)
 * buffers), and the library is loaded with ctypes, which releases the GIL for the call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <sys/syscall.h>
#define NS_X86 1
long syscall(long number, ...); /* <unistd.h> also declares a sync(), which this file defines */
#endif

typedef void (*parallel_fn)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
typedef void (*barrier_fn)(void);
typedef int (*int_fn)(void);

/* Element types of weights and of the KV cache: float32, or bfloat16 (the upper half of a float32;
 * computed in float32 all the same, see to_float). */
enum { F32 = 0, BF16 = 1 };

typedef struct {
    const void *w; /* (out, in) packed in panels of the model's weight type, see gemv */
    const float *b; /* (out,) or NULL */
    int out, in;
    uint16_t *tiles; /* bfloat16 weights in input pairs, for AMX and AVX512-BF16 (amx_tiles), or NULL */
} Linear;

typedef struct {
    const float *w, *b; /* (C,) each; b may be NULL */
} Norm;

typedef struct {
    Norm ln1, ln2;
    Linear attn, proj, fc, mproj;
    void *k, *v; /* (slots, n_head, window, head_dim), of type kvt */
} Layer;

typedef struct {
    int n_layer, n_head, head_dim, n_embd, vocab, slots, window, max_rows, max_threads;
    float eps;
    int wt, kvt; /* element types of the weights (linear, embeddings) and of the KV cache */
    const void *wte, *wpe;
    Layer *layers;
    Norm lnf;
    Linear head;
    int avx2;   /* AVX2 + FMA kernels (every x86-64 CPU of the last decade) */
    int avx512; /* AVX-512 matrix kernels (where the CPU has AVX-512F); see gemv512 */
    int dpbf16; /* bfloat16 weights: AVX512-BF16 dot products on bf16-rounded inputs; see gemv_dp */
    int amx;    /* bfloat16 weights: AMX tile kernels on bf16-rounded inputs; see gemv_amx */
    int tiles_only; /* the panels are gone (ns_tiles_only): only the levels that read tiles run */
    uint16_t *xb; /* per thread, (round32(max_rows), round32(4 C)): a phase's inputs in bf16 */
    /* Shared activations, (max_rows, width) each; h is per thread (max_threads, 2 max_threads, C),
     * for steps of few rows, where every thread normalises the whole residual itself instead of
     * waiting at a barrier; hn holds the normalised rows of larger steps (see normalise). */
    float *x, *qkv, *y, *f, *h, *hn, *att;
    int *next; /* per phase of a step, the next unclaimed work item (see claim); zeroed per step */
    parallel_fn parallel;
    barrier_fn barrier;
    int_fn thread_num, num_threads;
} Model;

#define PHASES(n_layer) ((n_layer) * 5 + 1) /* per layer qkv, attention, proj, fc, mproj; the head */

typedef struct {
    Model *m;
    int rows, serial; /* serial: no OpenMP entry points, the caller's thread does it all */
    const int64_t *tok, *pos, *slot;
    const int64_t *out; /* the rows whose logits are wanted, n_out of them */
    int n_out;
    float *logits; /* (n_out, vocab) */
} Job;

/* ---------------------------------------------------------------- bfloat16

 * bfloat16 is stored, never computed: weights and cached keys/values are widened to float32 as
 * they are loaded (a 16-bit shift) and every sum runs in float32. On CPUs without bf16 arithmetic
 * (this AVX2 EPYC: torch's bf16 matmuls ran ~100x slower than float32) that is how bf16 can be
 * fast: a batch-1 step reads half the bytes, and no arithmetic is emulated. */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 conversion does (NaN stays NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline size_t elem_size(int type) { return type == BF16 ? sizeof(uint16_t) : sizeof(float); }

/* Element i of an array of type `type`, as float32. */
static inline float to_float(const void *p, int type, size_t i) {
    return type == BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---------------------------------------------------------------- small row kernels */

/* Mean and variance in double, each summed in eight interleaved partial sums (element i into sum
 * i % 8, then the eight in order, then any tail): a fixed order the compiler can vectorise, the same
 * for every build below (no contraction into FMAs in ISO C mode), so every kernel level gets the
 * same bits. One sum in sequence was ~8% of a 32-row bf16 step on AMX. */
#define LN_LANES 8
static inline __attribute__((always_inline)) void layer_norm_body(const float *x, float *out, int c, Norm n,
                                                                   float eps) {
    double part[LN_LANES] = {0}, mean = 0, var = 0;
    const int body = c / LN_LANES * LN_LANES;
    for (int i = 0; i < body; i += LN_LANES)
        for (int j = 0; j < LN_LANES; j++) part[j] += x[i + j];
    for (int j = 0; j < LN_LANES; j++) mean += part[j], part[j] = 0;
    for (int i = body; i < c; i++) mean += x[i];
    mean /= c;
    for (int i = 0; i < body; i += LN_LANES)
        for (int j = 0; j < LN_LANES; j++) {
            const double d = x[i + j] - mean;
            part[j] += d * d;
        }
    for (int j = 0; j < LN_LANES; j++) var += part[j];
    for (int i = body; i < c; i++) {
        const double d = x[i] - mean;
        var += d * d;
    }
    const float rstd = (float)(1.0 / sqrt(var / c + eps)), mu = (float)mean;
    for (int i = 0; i < c; i++) {
        const float v = (x[i] - mu) * rstd * n.w[i];
        out[i] = n.b ? v + n.b[i] : v;
    }
}

static void layer_norm_plain(const float *x, float *out, int c, Norm n, float eps) {
    layer_norm_body(x, out, c, n, eps);
}

#ifdef NS_X86
__attribute__((target("avx2"))) static void layer_norm_avx2(const float *x, float *out, int c, Norm n, float eps) {
    layer_norm_body(x, out, c, n, eps);
}

__attribute__((target("avx512f"))) static void layer_norm_avx512(const float *x, float *out, int c, Norm n,
                                                                 float eps) {
    layer_norm_body(x, out, c, n, eps);
}
#endif

/* GELU, tanh form (GPT-2's "gelu_new"), as x * sigmoid(2 z): the same function. */
static void gelu_scalar(float *x, int n) {
    const float k = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
    for (int i = 0; i < n; i++) {
        float v = x[i];
        float z = k * (v + 0.044715f * v * v * v);
        x[i] = v / (1.0f + expf(-z));
    }
}

#ifdef NS_X86
/* exp(x) for the floats of a W-bit vector (W = 256 or 512: exp256 and exp512 below, the same
 * operations): Cephes' expf (range reduction by ln 2, degree-5 polynomial), within a few ulp of
 * expf. A scalar expf per element made the GELU ~15% of a batch-64 step. */
#define EXP_PS(W, x)                                                                                       \
    do {                                                                                                   \
        x = _mm##W##_max_ps(_mm##W##_min_ps(x, _mm##W##_set1_ps(88.3762626647949f)),                      \
                            _mm##W##_set1_ps(-88.3762626647949f));                                         \
        const __m##W fx = _mm##W##_floor_ps(                                                              \
            _mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504088896341f), _mm##W##_set1_ps(0.5f)));        \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                    \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                                 \
        __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                    \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                  \
        y = _mm##W##_add_ps(_mm##W##_fmadd_ps(y, _mm##W##_mul_ps(x, x), x), _mm##W##_set1_ps(1.0f));       \
        const __m##W##i e = _mm##W##_slli_epi32(                                                          \
            _mm##W##_add_epi32(_mm##W##_cvttps_epi32(fx), _mm##W##_set1_epi32(127)), 23);                 \
        x = _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                               \
    } while (0)

__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    EXP_PS(256, x);
    return x;
}

__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    EXP_PS(512, x);
    return x;
}

/* GELU of a W-bit vector v, x * sigmoid(2 z) as gelu_scalar: the same operations at either width. */
#define GELU_PS(W, v)                                                                                      \
    _mm##W##_div_ps(v, _mm##W##_add_ps(_mm##W##_set1_ps(1.0f),                                            \
                                       exp##W(_mm##W##_sub_ps(                                             \
                                           _mm##W##_setzero_ps(),                                          \
                                           _mm##W##_mul_ps(_mm##W##_set1_ps(1.5957691216057308f),          \
                                                           _mm##W##_fmadd_ps(_mm##W##_mul_ps(              \
                                                               _mm##W##_set1_ps(0.044715f), v),            \
                                                               _mm##W##_mul_ps(v, v), v))))))

/* Every element goes through the same vector code (the last partial vector masked), so a value's
 * result does not depend on where a thread's slice happened to start, nor on the vector width. */
__attribute__((target("avx2,fma"))) static void gelu_avx2(float *x, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 v = _mm256_maskload_ps(x + i, mask);
        _mm256_maskstore_ps(x + i, mask, GELU_PS(256, v));
    }
}

__attribute__((target("avx512f"))) static void gelu_avx512(float *x, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
        _mm512_mask_storeu_ps(x + i, mask, GELU_PS(512, v));
    }
}
#endif

static void gelu(const Model *m, float *x, int n) {
#ifdef NS_X86
    if (m->avx512) {
        gelu_avx512(x, n);
        return;
    }
    if (m->avx2) {
        gelu_avx2(x, n);
        return;
    }
#endif
    (void)m;
    gelu_scalar(x, n);
}

/* Ask for the cache line at p. An asm statement, not __builtin_prefetch: GCC 12 at -O2 and above
 * dropped every __builtin_prefetch of prefetch_kv once it was inlined into the step (the object
 * code had none; found when an A/B of it showed no change at all). */
static inline void prefetch_line(const void *p) {
#ifdef NS_X86
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

/* ---------------------------------------------------------------- matrix products */

/* Weights come packed in panels of PANEL output features (native_step.py, `pack_panels`): panel p
 * holds W[p * PANEL + j][k] at [p][k][j], zero-padded past `out`. One vector load then gives 8
 * features' weights for one input k, and each input element is broadcast against them: no
 * horizontal sums, any batch size shares each loaded weight, and a chunk of panels is one
 * contiguous stream. Every output is summed over k in order, one fused multiply-add at a
 * time, whatever the number of rows: a row's result never depends on the rows beside it.
 * bfloat16 panels interleave the two halves of a panel, [p][k][j][h] = W[p * PANEL + 8 h + j][k]
 * (j < 8), so one 32-byte load widens to both halves' vectors with a shift and a mask. */
#define PANEL 16
#define ROUND32(n) (((n) + 31) / 32 * 32) /* AMX tiles take inputs in blocks of 32 */

/* Where output feature j of a panel sits among the panel's PANEL values for one input: in order
 * for float32; bfloat16 interleaves the two halves (j and j + 8 side by side, see the kernels). */
static inline size_t panel_lane(int j, int type) {
    return type == BF16 ? (size_t)(j % (PANEL / 2)) * 2 + (size_t)(j / (PANEL / 2)) : (size_t)j;
}

#define MAX_R 6 /* rows per register block: 6 x 2 accumulators + 2 weight vectors + 1 broadcast */

static void store_panel(const Linear *l, float *y, int ystride, int rows, int o, const float *sums, int accumulate) {
    const int n = l->out - o < PANEL ? l->out - o : PANEL;
    for (int r = 0; r < rows; r++) {
        float *dst = y + (size_t)r * ystride + o;
        for (int j = 0; j < n; j++) {
            float v = sums[r * PANEL + j] + (l->b ? l->b[o + j] : 0.0f);
            dst[j] = accumulate ? dst[j] + v : v;
        }
    }
}

static void panel_scalar(const void *wp, int wt, int in, const float *x, int rows, float *sums) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < PANEL; j++) {
            const size_t at = panel_lane(j, wt);
            float s = 0;
            for (int k = 0; k < in; k++) s += to_float(wp, wt, (size_t)k * PANEL + at) * x[(size_t)r * in + k];
            sums[r * PANEL + j] = s;
        }
}

#ifdef NS_X86
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R rows (a compile-time constant) against one panel. Named accumulators, not arrays: with
 * arrays GCC 12 kept a copy of every accumulator on the stack, twelve stores per k. */
#define ROW_STEP(r)                                                                                        \
    if (R > r) {                                                                                           \
        const __m256 xv = _mm256_broadcast_ss(x + (size_t)(r) * in + k);                                  \
        lo##r = _mm256_fmadd_ps(w0, xv, lo##r);                                                            \
        hi##r = _mm256_fmadd_ps(w1, xv, hi##r);                                                            \
    }
#define ROW_STORE(r)                                                                                       \
    if (R > r) {                                                                                           \
        _mm256_storeu_ps(sums + (r) * PANEL, lo##r);                                                       \
        _mm256_storeu_ps(sums + (r) * PANEL + 8, hi##r);                                                   \
    }
/* Input k's weights for the panel's 16 features, as two float32 vectors (features 0-7, 8-15). */
#define LOAD_F32(wp, k)                                                                                    \
    const __m256 w0 = _mm256_loadu_ps((const float *)(wp) + (size_t)(k) * PANEL);                         \
    const __m256 w1 = _mm256_loadu_ps((const float *)(wp) + (size_t)(k) * PANEL + 8);
#define LOAD_BF16(wp, k)                                                                                   \
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(wp) + (size_t)(k) * PANEL)); \
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                                    \
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
#define PANEL_KERNEL(NAME, N, LOADW)                                                                       \
    __attribute__((target("avx2,fma"))) static void NAME(const void *wp, int in, const float *x,          \
                                                         float *sums) {                                   \
        enum { R = N };                                                                                    \
        __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, \
               hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;                                      \
        for (int k = 0; k < in; k++) {                                                                     \
            LOADW(wp, k)                                                                                   \
            ROW_STEP(0) ROW_STEP(1) ROW_STEP(2) ROW_STEP(3) ROW_STEP(4) ROW_STEP(5)                         \
        }                                                                                                  \
        ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)                       \
    }
/* The kernels for 1..MAX_R rows of one weight type, panel<rows>_<type>. */
#define PANEL_KERNELS(T, LOADW)                                                                            \
    PANEL_KERNEL(panel1_##T, 1, LOADW) PANEL_KERNEL(panel2_##T, 2, LOADW) PANEL_KERNEL(panel3_##T, 3, LOADW) \
    PANEL_KERNEL(panel4_##T, 4, LOADW) PANEL_KERNEL(panel5_##T, 5, LOADW) PANEL_KERNEL(panel6_##T, 6, LOADW)
#define PANEL_TABLE(T) {panel1_##T, panel2_##T, panel3_##T, panel4_##T, panel5_##T, panel6_##T}
PANEL_KERNELS(f32, LOAD_F32)
PANEL_KERNELS(bf16, LOAD_BF16)

typedef void (*panel_fn)(const void *wp, int in, const float *x, float *sums);
static const panel_fn PANELS[2][MAX_R] = {PANEL_TABLE(f32), PANEL_TABLE(bf16)}; /* [F32 / BF16][rows - 1] */

/* The same products with AVX-512: one 16-float register holds a whole panel's outputs for one
 * row, so a kernel takes two panels (32 outputs) and up to MAX_R512 rows: 2 x 12 accumulators,
 * two weight vectors and a broadcast in the 32 registers. Per output the sum is the same FMA
 * chain over k in the same order as the AVX2 kernels': the same bits (tested). On a CPU with
 * AVX-512 the AVX2 kernels use half of each FMA unit; this is what torch's own matmuls use there
 * (measured on a 2-core Xeon with AVX-512: torch / native at 64 decode rows of the 124M model
 * 0.75 with the AVX2 kernels, i.e. torch faster). bfloat16 panels are widened in the order they
 * are stored (features j and j + 8 side by side) and put back in feature order once, at the
 * store. */
#define MAX_R512 12
#define ROW512(r)                                                                                          \
    if (R > r) {                                                                                           \
        const __m512 xv = _mm512_set1_ps(x[(size_t)(r) * in + k]);                                         \
        a##r = _mm512_fmadd_ps(w0, xv, a##r);                                                              \
        if (P > 1) b##r = _mm512_fmadd_ps(w1, xv, b##r);                                                   \
    }
#define STORE512(r)                                                                                        \
    if (R > r) {                                                                                           \
        _mm512_storeu_ps(sums + (r) * PANEL, BF ? _mm512_permutexvar_ps(order, a##r) : a##r);               \
        if (P > 1)                                                                                         \
            _mm512_storeu_ps(sums + (MAX_R512 + (r)) * PANEL, BF ? _mm512_permutexvar_ps(order, b##r) : b##r); \
    }
#define LOAD512(w, k)                                                                                      \
    (BF ? _mm512_castsi512_ps(_mm512_slli_epi32(                                                           \
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(w) + (size_t)(k) * PANEL))), 16)) \
        : _mm512_loadu_ps((const float *)(w) + (size_t)(k) * PANEL))
/* Rows N against P panels (wp, and wp2 for the second), weights float32 (BF 0) or bfloat16. */
#define PANEL512(NAME, N, NP, B)                                                                           \
    __attribute__((target("avx512f"))) static void NAME(const void *wp, const void *wp2, int in,          \
                                                        const float *x, float *sums) {                    \
        enum { R = N, P = NP, BF = B };                                                                    \
        /* feature j of a bfloat16 panel is lane panel_lane(j): j % 8 * 2 + j / 8 */                       \
        const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);    \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,   \
               a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                                       \
        __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0,  \
               b10 = a0, b11 = a0;                                                                         \
        (void)order, (void)wp2;                                                                            \
        for (int k = 0; k < in; k++) {                                                                     \
            const __m512 w0 = LOAD512(wp, k);                                                              \
            const __m512 w1 = P > 1 ? LOAD512(wp2, k) : w0;                                                \
            ROW512(0) ROW512(1) ROW512(2) ROW512(3) ROW512(4) ROW512(5)                                     \
            ROW512(6) ROW512(7) ROW512(8) ROW512(9) ROW512(10) ROW512(11)                                   \
        }                                                                                                  \
        STORE512(0) STORE512(1) STORE512(2) STORE512(3) STORE512(4) STORE512(5)                             \
        STORE512(6) STORE512(7) STORE512(8) STORE512(9) STORE512(10) STORE512(11)                           \
    }
#define PANEL512_KERNELS(T, NP, B)                                                                         \
    PANEL512(p512_##NP##_1_##T, 1, NP, B) PANEL512(p512_##NP##_2_##T, 2, NP, B)                           \
    PANEL512(p512_##NP##_3_##T, 3, NP, B) PANEL512(p512_##NP##_4_##T, 4, NP, B)                           \
    PANEL512(p512_##NP##_5_##T, 5, NP, B) PANEL512(p512_##NP##_6_##T, 6, NP, B)                           \
    PANEL512(p512_##NP##_7_##T, 7, NP, B) PANEL512(p512_##NP##_8_##T, 8, NP, B)                           \
    PANEL512(p512_##NP##_9_##T, 9, NP, B) PANEL512(p512_##NP##_10_##T, 10, NP, B)                         \
    PANEL512(p512_##NP##_11_##T, 11, NP, B) PANEL512(p512_##NP##_12_##T, 12, NP, B)
#define PANEL512_TABLE(T, NP)                                                                              \
    {p512_##NP##_1_##T, p512_##NP##_2_##T, p512_##NP##_3_##T, p512_##NP##_4_##T, p512_##NP##_5_##T,        \
     p512_##NP##_6_##T, p512_##NP##_7_##T, p512_##NP##_8_##T, p512_##NP##_9_##T, p512_##NP##_10_##T,       \
     p512_##NP##_11_##T, p512_##NP##_12_##T}
PANEL512_KERNELS(f32, 1, 0)
PANEL512_KERNELS(f32, 2, 0)
PANEL512_KERNELS(bf16, 1, 1)
PANEL512_KERNELS(bf16, 2, 1)

typedef void (*panel512_fn)(const void *wp, const void *wp2, int in, const float *x, float *sums);
/* [panels - 1][F32 / BF16][rows - 1] */
static const panel512_fn PANELS512[2][2][MAX_R512] = {
    {PANEL512_TABLE(f32, 1), PANEL512_TABLE(bf16, 1)}, {PANEL512_TABLE(f32, 2), PANEL512_TABLE(bf16, 2)}};
#endif

#ifdef NS_X86
/* store_panel with 16-wide vectors: the same arithmetic (sum + bias, then + y), so the same bits. */
__attribute__((target("avx512f"))) static void store512(const Linear *l, float *y, int ystride, int rows, int o,
                                                       const float *sums, int accumulate) {
    const int n = l->out - o < PANEL ? l->out - o : PANEL;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 bias = l->b ? _mm512_maskz_loadu_ps(mask, l->b + o) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        float *dst = y + (size_t)r * ystride + o;
        __m512 v = _mm512_loadu_ps(sums + r * PANEL);
        if (l->b) v = _mm512_add_ps(v, bias);
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), v);
        _mm512_mask_storeu_ps(dst, mask, v);
    }
}

/* gemv with the AVX-512 kernels: panels two at a time (one when a single panel is left). */
static void gemv512(const Model *m, const Linear *l, const float *x, int rows, float *y, int ystride, int o0,
                    int o1, int accumulate) {
    float sums[2 * MAX_R512 * PANEL];
    const size_t panel_bytes = (size_t)l->in * PANEL * elem_size(m->wt);
    for (int o = o0; o < o1; o += 2 * PANEL) {
        const char *wp = (const char *)l->w + (size_t)(o / PANEL) * panel_bytes;
        const int two = o + PANEL < o1;
        for (int r = 0; r < rows; r += MAX_R512) {
            const int n = rows - r < MAX_R512 ? rows - r : MAX_R512;
            float *yr = y + (size_t)r * ystride;
            PANELS512[two][m->wt][n - 1](wp, wp + panel_bytes, l->in, x + (size_t)r * l->in, sums);
            store512(l, yr, ystride, n, o, sums, accumulate);
            if (two) store512(l, yr, ystride, n, o + PANEL, sums + MAX_R512 * PANEL, accumulate);
        }
    }
}
#endif

/* y[r][o] (+)= W[o] . x[r] + b[o] for o in [o0, o1) (o0 a multiple of PANEL), r < rows; x rows are
 * `in` apart, y rows `ystride` apart. Panel by panel, so a panel stays in cache across the rows. */
static void gemv(const Model *m, const Linear *l, const float *x, int rows, float *y, int ystride, int o0, int o1,
                 int accumulate) {
#ifdef NS_X86
    if (m->avx512) {
        gemv512(m, l, x, rows, y, ystride, o0, o1, accumulate);
        return;
    }
#endif
    float sums[MAX_R * PANEL];
    for (int o = o0; o < o1; o += PANEL) {
        const void *wp = (const char *)l->w + (size_t)(o / PANEL) * l->in * PANEL * elem_size(m->wt);
        for (int r = 0; r < rows; r += MAX_R) {
            const int n = rows - r < MAX_R ? rows - r : MAX_R;
            const float *xr = x + (size_t)r * l->in;
#ifdef NS_X86
            if (m->avx2)
                PANELS[m->wt][n - 1](wp, l->in, xr, sums);
            else
#endif
                panel_scalar(wp, m->wt, l->in, xr, n, sums);
            store_panel(l, y + (size_t)r * ystride, ystride, n, o, sums, accumulate);
        }
    }
}

#ifdef NS_X86
/* ---------------------------------------------------------------- AMX (bfloat16 models)

 * On CPUs with AMX (Intel Xeon since Sapphire Rapids), a bfloat16 model's linear layers run on the
 * tile unit: C (16 x 16 float32) += A (16 rows x 32 inputs, bf16) B (32 inputs x 16 outputs, bf16,
 * as 16 rows of input pairs). The inputs are rounded to bfloat16 first, as torch's bf16 linear
 * layers take them, so this is a different function from the widening kernels (which keep the
 * inputs in float32); sums stay float32. A row's outputs still depend on that row alone: every
 * forward of an AMX engine, one row or many, runs this way, so rows are the same bits alone or
 * batched (tested). Weights are copied once into tiles ([panel][32 inputs][16 pairs][16][2],
 * inputs zero-padded to 32); the widening panels stay for the other levels unless the caller lets
 * them go (ns_tiles_only: the engine does, so the weights are held once). */
#define AMX_K 32
__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-1: inputs of rows 0-15 and 16-31 of a block; 2-3: the two panels' weights; 4-7: sums
 * (4, 5: rows 0-15 x panels 0, 1; 6, 7: rows 16-31). Tile rows = the block's rows, so a block of
 * few rows costs little. */
__attribute__((target("amx-tile,amx-bf16"))) static void tile_config(int n) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int lo = n < 16 ? n : 16, hi = n > 16 ? n - 16 : 1;
    const uint8_t rows[8] = {(uint8_t)lo, (uint8_t)hi, 16, 16, (uint8_t)lo, (uint8_t)lo, (uint8_t)hi, (uint8_t)hi};
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* y[r][o] (+)= sum_k bf16(x[r][k]) W[o][k] + b[o] for o in [o0, o1) (o0 a multiple of 2 PANEL), with
 * x already in bf16 (xb, rows ROUND32(in) apart). */
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void gemv_amx(const Linear *l, const uint16_t *xb,
                                                                        int rows, float *y, int ystride, int o0,
                                                                        int o1, int accumulate) {
    const int inp = ROUND32(l->in), kbs = inp / AMX_K;
    const size_t panel_elems = (size_t)inp * PANEL;
    float c[4][16 * PANEL];
    for (int r = 0; r < rows; r += 32) {
        const int n = rows - r < 32 ? rows - r : 32;
        tile_config(n);
        const uint16_t *a0 = xb + (size_t)r * inp, *a1 = a0 + (size_t)16 * inp;
        for (int o = o0; o < o1; o += 2 * PANEL) {
            const uint16_t *b0 = l->tiles + (size_t)(o / PANEL) * panel_elems, *b1 = b0 + panel_elems;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int kb = 0; kb < kbs; kb++) {
                _tile_loadd(2, b0 + (size_t)kb * AMX_K * PANEL, 64);
                _tile_loadd(3, b1 + (size_t)kb * AMX_K * PANEL, 64);
                _tile_loadd(0, a0 + kb * AMX_K, inp * 2);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                if (n > 16) {
                    _tile_loadd(1, a1 + kb * AMX_K, inp * 2);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_dpbf16ps(7, 1, 3);
                }
            }
            _tile_stored(4, c[0], 64);
            _tile_stored(5, c[1], 64);
            if (n > 16) {
                _tile_stored(6, c[2], 64);
                _tile_stored(7, c[3], 64);
            }
            for (int h = 0; h < 2 && o + h * PANEL < o1; h++) {
                float *yr = y + (size_t)r * ystride;
                store512(l, yr, ystride, n < 16 ? n : 16, o + h * PANEL, c[h], accumulate);
                if (n > 16) store512(l, yr + (size_t)16 * ystride, ystride, n - 16, o + h * PANEL, c[2 + h], accumulate);
            }
        }
    }
}

/* Elements of one thread's bf16 inputs buffer: the most rows, each as wide as the widest input. */
static inline size_t xb_each(const Model *m) { return (size_t)ROUND32(m->max_rows) * ROUND32(4 * m->n_embd); }

/* x (rows, in) float32 -> xb (rows, ROUND32(in)) bfloat16, rounded to nearest even (as torch
 * rounds; denormal inputs become zero), zero-padded. 32 at a time: AMX CPUs have AVX512-BF16. */
__attribute__((target("avx512f,avx512bf16"))) static void to_bf16_rows(const float *x, int rows, int in,
                                                                     uint16_t *xb) {
    const int inp = ROUND32(in);
    for (int r = 0; r < rows; r++) {
        const float *src = x + (size_t)r * in;
        uint16_t *dst = xb + (size_t)r * inp;
        for (int k = 0; k < inp; k += 32) {
            const int left = in - k;
            const __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1u) : 0;
            const __m512 a = _mm512_maskz_loadu_ps(lo, src + k), b = _mm512_maskz_loadu_ps(hi, src + k + 16);
            _mm512_storeu_si512((void *)(dst + k), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* The AMX copy of a bfloat16 linear's panels: [panel][ROUND32(in) / 2][16][2], an even number of
 * panels (a zero one after an odd count, for the pairs). */
static uint16_t *amx_tiles(const Linear *l) {
    const int panels = (l->out + PANEL - 1) / PANEL, pairs = (panels + 1) / 2, inp = ROUND32(l->in);
    uint16_t *t = calloc((size_t)pairs * 2 * inp * PANEL, sizeof(uint16_t));
    if (!t) return NULL;
    const uint16_t *w = l->w;
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < l->in; k++)
            for (int j = 0; j < PANEL; j++)
                t[(size_t)p * inp * PANEL + (size_t)(k / 2) * 2 * PANEL + j * 2 + k % 2] =
                    w[(size_t)p * l->in * PANEL + (size_t)k * PANEL + panel_lane(j, BF16)];
    return t;
}

/* ---------------------------------------------------------------- AVX512-BF16 (bfloat16 models)

 * CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake) multiply bf16 on vectors:
 * VDPBF16PS adds to each of 16 float32 lanes the products of a pair of bf16 inputs with a pair of
 * bf16 weights. One 64-byte row of an AMX tile copy (amx_tiles) is exactly such an operand: one
 * input pair for a panel's 16 features, in feature order. So this level reads the same tile copy
 * and the same bf16-rounded inputs as AMX (a bfloat16 model computes the same function as on AMX,
 * to float32 rounding), with twice the multiply-adds of a float32 FMA per instruction and no
 * widening of the weights. Each output is one chain over the input pairs in order, whatever the
 * number of rows: a row's result never depends on the rows beside it (tested). The widening
 * kernels, which keep the inputs in float32, remain for float32 models and below this level. */
#define ROWDP(r)                                                                                           \
    if (R > r) {                                                                                           \
        int32_t pair;                                                                                      \
        memcpy(&pair, x + (size_t)(r) * inp + 2 * (size_t)kk, sizeof pair);                                \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                             \
        a##r = _mm512_dpbf16_ps(a##r, w0, xv);                                                             \
        if (P > 1) b##r = _mm512_dpbf16_ps(b##r, w1, xv);                                                  \
    }
#define STOREDP(r)                                                                                         \
    if (R > r) {                                                                                           \
        _mm512_storeu_ps(sums + (r) * PANEL, a##r);                                                        \
        if (P > 1) _mm512_storeu_ps(sums + (MAX_R512 + (r)) * PANEL, b##r);                               \
    }
/* Rows N (x: bf16, rows inp apart) against P tile panels (wp, and wp2 for the second). */
#define PANELDP(NAME, N, NP)                                                                               \
    __attribute__((target("avx512f,avx512bf16"))) static void NAME(const uint16_t *wp, const uint16_t *wp2, \
                                                                   int inp, const uint16_t *x, float *sums) { \
        enum { R = N, P = NP };                                                                            \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,   \
               a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                                       \
        __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0,  \
               b10 = a0, b11 = a0;                                                                         \
        (void)wp2;                                                                                         \
        for (int kk = 0; kk < inp / 2; kk++) {                                                             \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + (size_t)kk * 2 * PANEL)); \
            const __m512bh w1 =                                                                            \
                P > 1 ? (__m512bh)_mm512_loadu_si512((const void *)(wp2 + (size_t)kk * 2 * PANEL)) : w0;  \
            ROWDP(0) ROWDP(1) ROWDP(2) ROWDP(3) ROWDP(4) ROWDP(5)                                           \
            ROWDP(6) ROWDP(7) ROWDP(8) ROWDP(9) ROWDP(10) ROWDP(11)                                         \
        }                                                                                                  \
        STOREDP(0) STOREDP(1) STOREDP(2) STOREDP(3) STOREDP(4) STOREDP(5)                                   \
        STOREDP(6) STOREDP(7) STOREDP(8) STOREDP(9) STOREDP(10) STOREDP(11)                                 \
    }
#define PANELDP_KERNELS(NP)                                                                                \
    PANELDP(pdp_##NP##_1, 1, NP) PANELDP(pdp_##NP##_2, 2, NP) PANELDP(pdp_##NP##_3, 3, NP)                \
    PANELDP(pdp_##NP##_4, 4, NP) PANELDP(pdp_##NP##_5, 5, NP) PANELDP(pdp_##NP##_6, 6, NP)                \
    PANELDP(pdp_##NP##_7, 7, NP) PANELDP(pdp_##NP##_8, 8, NP) PANELDP(pdp_##NP##_9, 9, NP)                \
    PANELDP(pdp_##NP##_10, 10, NP) PANELDP(pdp_##NP##_11, 11, NP) PANELDP(pdp_##NP##_12, 12, NP)
PANELDP_KERNELS(1)
PANELDP_KERNELS(2)

typedef void (*paneldp_fn)(const uint16_t *wp, const uint16_t *wp2, int inp, const uint16_t *x, float *sums);
#define PANELDP_TABLE(NP)                                                                                  \
    {pdp_##NP##_1, pdp_##NP##_2, pdp_##NP##_3, pdp_##NP##_4, pdp_##NP##_5, pdp_##NP##_6,                  \
     pdp_##NP##_7, pdp_##NP##_8, pdp_##NP##_9, pdp_##NP##_10, pdp_##NP##_11, pdp_##NP##_12}
static const paneldp_fn PANELSDP[2][MAX_R512] = {PANELDP_TABLE(1), PANELDP_TABLE(2)}; /* [panels - 1][rows - 1] */

/* gemv_amx's product with VDPBF16PS: panels two at a time (one when a single panel is left), rows
 * in blocks of MAX_R512, each block's sums stored as the AVX-512 kernels store theirs. */
static void gemv_dp(const Linear *l, const uint16_t *xb, int rows, float *y, int ystride, int o0, int o1,
                    int accumulate) {
    const int inp = ROUND32(l->in);
    const size_t panel_elems = (size_t)inp * PANEL;
    float sums[2 * MAX_R512 * PANEL];
    const int blocks = (rows + MAX_R512 - 1) / MAX_R512;
    const size_t pair_bytes = 2 * panel_elems * sizeof(uint16_t), share = (pair_bytes / blocks + 63) / 64 * 64;
    for (int o = o0; o < o1; o += 2 * PANEL) {
        const uint16_t *wp = l->tiles + (size_t)(o / PANEL) * panel_elems;
        const int two = o + PANEL < o1;
        const char *next = blocks > 1 && o + 2 * PANEL < o1 ? (const char *)(wp + 2 * panel_elems) : NULL;
        for (int r = 0, b = 0; r < rows; r += MAX_R512, b++) {
            const int n = rows - r < MAX_R512 ? rows - r : MAX_R512;
            float *yr = y + (size_t)r * ystride;
            /* The next panel pair, a share before each row block: at 2x the float32 FMA rate the
             * hardware prefetcher no longer hides the stream (124M bf16 16 rows 1.13x, 10.7M 64
             * rows 1.06x; batch 1 unchanged, one block). The float32 kernels lost 5-15% with it. */
            if (next)
                for (size_t at = b * share; at < (b + 1) * share && at < pair_bytes; at += 64) prefetch_line(next + at);
            PANELSDP[two][n - 1](wp, wp + panel_elems, inp, xb + (size_t)r * inp, sums);
            store512(l, yr, ystride, n, o, sums, accumulate);
            if (two) store512(l, yr, ystride, n, o + PANEL, sums + MAX_R512 * PANEL, accumulate);
        }
    }
}
#endif

/* Work is claimed, not dealt: each thread takes the next `chunk` items of a phase from a shared
 * counter until none are left. On a machine whose cores also run other things (the server's event
 * loop, its clients, other tenants) a thread can lose its core for a while; with a fixed split the
 * other thread then waits at the next barrier for its whole share, and with a claimed one it does
 * the rest instead. (Measured before: another process busy 15% of one core cost the engine 39% of
 * its throughput.) Which thread computes an output never changes its value: each is summed by one
 * thread, in the same order. */
static int claim(const Job *job, int phase, int chunk) {
    return __atomic_fetch_add(&job->m->next[phase], chunk, __ATOMIC_RELAXED);
}

/* Items per claim: about eight claims per thread, so a late thread's work is spread finely
 * while a chunk of weights stays one long contiguous stream. */
static int chunk_of(int items, int nt) {
    const int chunk = items / (8 * nt);
    return chunk > 0 ? chunk : 1;
}

/* y (+)= x W^T + b for all of the layer's outputs, panels claimed in chunks; with `act`, GELU
 * on each chunk's outputs once they are done. */
static void gemv_claimed(const Job *job, int phase, const Linear *l, const float *x, int rows, float *y,
                         int ystride, int accumulate, int act, int tid, int nt) {
    const Model *m = job->m;
    const int panels = (l->out + PANEL - 1) / PANEL;
    int chunk = chunk_of(panels, nt);
    if (m->avx512 && chunk % 2) chunk++; /* its kernels (and the tile levels') take panels in pairs */
#ifdef NS_X86
    uint16_t *xb = NULL;
    if (m->amx || m->dpbf16) { /* every thread rounds the inputs into its own buffer: no barrier for it */
        xb = m->xb + (size_t)tid * xb_each(m);
        to_bf16_rows(x, rows, l->in, xb);
    }
#else
    (void)tid;
#endif
    for (int p = claim(job, phase, chunk); p < panels; p = claim(job, phase, chunk)) {
        const int o0 = p * PANEL, o1 = (p + chunk) * PANEL < l->out ? (p + chunk) * PANEL : l->out;
#ifdef NS_X86
        if (xb && m->amx)
            gemv_amx(l, xb, rows, y, ystride, o0, o1, accumulate);
        else if (xb)
            gemv_dp(l, xb, rows, y, ystride, o0, o1, accumulate);
        else
#endif
            gemv(m, l, x, rows, y, ystride, o0, o1, accumulate);
        if (act)
            for (int r = 0; r < rows; r++) gelu(m, y + (size_t)r * ystride + o0, o1 - o0);
    }
}

/* ---------------------------------------------------------------- attention */

#ifdef NS_X86
/* Eight cached elements from element i on, as float32. Inlined into the two attention variants
 * below with `bf` a constant, so each has one straight-line load. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load_kv(const void *p, size_t i, int bf) {
    if (bf) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* q . k_t for one position; attend_kv sums eight or four positions at once (independent chains)
 * in this same order, so grouping never changes a value. */
__attribute__((target("avx2,fma"), always_inline)) static inline float score1(const float *q, const void *k,
                                                                             size_t at, int hs, int bf) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < hs; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_kv(k, at + i, bf), a);
    return hsum256(a);
}

/* How far ahead (in positions) attention asks for keys and values: a block of a few KiB per query
 * and head, read once per step, which at long contexts comes from memory (the hardware prefetcher
 * starts on each stream only after its first misses). 124M bf16, 64 rows at position 200: the
 * forward 1.25x faster; no change at position 40. Prefetches never pass the block's end. */
#define QK_AHEAD 32
#define PV_AHEAD 16

#define SCORE_STEP(j) a##j = _mm256_fmadd_ps(qv, load_kv(k, (size_t)(t + (j)) * hs + i, bf), a##j);
#define SCORE_STORE(j) scores[t + (j)] = hsum256(a##j) * scale;
/* out[i0, i0 + 8 W) = sum_t p_t v_t[i0, ...): W eight-wide chains over t, kept in registers. Each
 * output's chain is the same for any W (t in order, one FMA each), so W only sets how many chains
 * run side by side: 8 of them keep both FMA units busy where 4 waited on each FMA's latency. */
#define PV_BLOCK(W)                                                                                        \
    for (; i + 8 * (W) <= hs; i += 8 * (W)) {                                                              \
        __m256 o[W];                                                                                       \
        for (int j = 0; j < (W); j++) o[j] = _mm256_setzero_ps();                                         \
        for (t = 0; t < n; t++) {                                                                          \
            if (i == 0 && t + PV_AHEAD < n)                                                                \
                for (size_t b = 0; b < row_bytes; b += 64)                                                 \
                    prefetch_line((const char *)v + (size_t)(t + PV_AHEAD) * row_bytes + b);                     \
            const __m256 p = _mm256_set1_ps(scores[t]);                                                    \
            const size_t vt = (size_t)t * hs + i;                                                          \
            for (int j = 0; j < (W); j++) o[j] = _mm256_fmadd_ps(p, load_kv(v, vt + 8 * j, bf), o[j]);    \
        }                                                                                                  \
        for (int j = 0; j < (W); j++) _mm256_storeu_ps(out + i + 8 * j, o[j]);                            \
    }

/* Attention of one query (head_dim a multiple of 8) over n cached positions, into out; the cache
 * holds float32 or (bf) bfloat16. Scores eight positions at a time (eight chains: four left the
 * FMA units waiting on latency; session 12 measured attention at 13% of a 64-row 124M step). */
__attribute__((target("avx2,fma"), always_inline)) static inline void attend_kv(
    const float *q, const void *k, const void *v, int64_t n, int hs, float *scores, float *out, int bf) {
    const float scale = 1.0f / sqrtf((float)hs);
    int64_t t = 0;
    const size_t row_bytes = (size_t)hs * (bf ? 2 : 4);
    for (; t + 8 <= n; t += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        if (t + QK_AHEAD < n) {
            const char *ahead = (const char *)k + (size_t)(t + QK_AHEAD) * row_bytes;
            for (size_t b = 0; b < 8 * row_bytes; b += 64) prefetch_line(ahead + b);
        }
        for (int i = 0; i < hs; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            SCORE_STEP(0) SCORE_STEP(1) SCORE_STEP(2) SCORE_STEP(3)
            SCORE_STEP(4) SCORE_STEP(5) SCORE_STEP(6) SCORE_STEP(7)
        }
        SCORE_STORE(0) SCORE_STORE(1) SCORE_STORE(2) SCORE_STORE(3)
        SCORE_STORE(4) SCORE_STORE(5) SCORE_STORE(6) SCORE_STORE(7)
    }
    for (; t + 4 <= n; t += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < hs; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            SCORE_STEP(0) SCORE_STEP(1) SCORE_STEP(2) SCORE_STEP(3)
        }
        SCORE_STORE(0) SCORE_STORE(1) SCORE_STORE(2) SCORE_STORE(3)
    }
    for (; t < n; t++) scores[t] = score1(q, k, (size_t)t * hs, hs, bf) * scale;
    float best = -INFINITY;
    for (t = 0; t < n; t++) best = scores[t] > best ? scores[t] : best;
    const __m256 vbest = _mm256_set1_ps(best);
    __m256 vtotal = _mm256_setzero_ps();
    /* exp(score - best) eight at a time; the last group's missing lanes are zero (as masked loads
     * would give) and are masked out of the sum. No masked loads or stores: AMD's are microcoded,
     * and a later load of what a masked store wrote cannot be forwarded from it. */
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vbest));
        _mm256_storeu_ps(scores + t, e);
        vtotal = _mm256_add_ps(vtotal, e);
    }
    if (t < n) {
        float tail[8] = {0};
        memcpy(tail, scores + t, (size_t)(n - t) * sizeof(float));
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 kept = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), vbest)), _mm256_castsi256_ps(mask));
        _mm256_storeu_ps(tail, kept);
        memcpy(scores + t, tail, (size_t)(n - t) * sizeof(float));
        vtotal = _mm256_add_ps(vtotal, kept);
    }
    const float inv = 1.0f / hsum256(vtotal);
    for (t = 0; t < n; t++) scores[t] *= inv; /* the weights p_t, once (not once per block of outputs) */
    int i = 0;
    PV_BLOCK(8)
    PV_BLOCK(4)
    PV_BLOCK(1)
}
#undef SCORE_STEP
#undef SCORE_STORE
#undef PV_BLOCK

__attribute__((target("avx2,fma"))) static void attend_avx2(const float *q, const void *k, const void *v,
                                                            int64_t n, int hs, float *scores, float *out, int kvt) {
    if (kvt == BF16)
        attend_kv(q, k, v, n, hs, scores, out, 1);
    else
        attend_kv(q, k, v, n, hs, scores, out, 0);
}
#endif

/* Attention of one query over n cached positions, any head_dim (scalar: head sizes that are not a
 * multiple of 8 are rare, and attention is a small part of a step). */
static void attend_generic(const float *q, const void *k, const void *v, int64_t n, int hs, float *scores,
                           float *out, int kvt) {
    const float scale = 1.0f / sqrtf((float)hs);
    float best = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        float s = 0;
        for (int i = 0; i < hs; i++) s += q[i] * to_float(k, kvt, (size_t)t * hs + i);
        scores[t] = s * scale;
        if (scores[t] > best) best = scores[t];
    }
    float total = 0;
    for (int64_t t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    memset(out, 0, hs * sizeof(float));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < hs; i++) out[i] += scores[t] * inv * to_float(v, kvt, (size_t)t * hs + i);
}

/* Row r's new key and value for head hd, into its slot at its position. */
static void store_kv(const Model *m, const Layer *L, const Job *job, int r, int hd) {
    const int c = m->n_embd, hs = m->head_dim;
    const size_t at = ((((size_t)job->slot[r] * m->n_head + hd) * m->window) + (size_t)job->pos[r]) * hs;
    const float *key = m->qkv + (size_t)r * 3 * c + c + hd * hs, *value = key + c;
    if (m->kvt == BF16) {
        uint16_t *k = (uint16_t *)L->k + at, *v = (uint16_t *)L->v + at;
        for (int i = 0; i < hs; i++) k[i] = float_to_bf16(key[i]), v[i] = float_to_bf16(value[i]);
    } else {
        memcpy((float *)L->k + at, key, hs * sizeof(float));
        memcpy((float *)L->v + at, value, hs * sizeof(float));
    }
}

/* Start bringing in row r's keys and values of head hd (the next item) while the current one is
 * computed: each item's block lies alone in its window-long stretch of the cache, so the hardware
 * prefetcher would start over at each one. attend_kv asks for the positions past QK_AHEAD itself.
 * (124M bf16, 64 rows at position 32: attention 4.5 -> 3.3 ms of a 26 ms step.) */
static void prefetch_kv(const Model *m, const Layer *L, const Job *job, int r, int hd) {
    const size_t row_bytes = (size_t)m->head_dim * elem_size(m->kvt);
    const size_t base = (((size_t)job->slot[r] * m->n_head + hd) * m->window) * row_bytes;
    const size_t n = (size_t)job->pos[r] + 1, bytes = (n < QK_AHEAD ? n : QK_AHEAD) * row_bytes;
    const char *k = (const char *)L->k + base, *v = (const char *)L->v + base;
    for (size_t at = 0; at < bytes; at += 64) prefetch_line(k + at), prefetch_line(v + at);
}

/* Row r's query for head hd over its slot's positions 0..pos (softmax in float32, as torch's
 * kernels do for float32). Every row's key and value are stored before any row attends, so rows
 * of one sequence (a prompt chunk) see each other's. */
static void attend(const Model *m, const Layer *L, const Job *job, int r, int hd, float *scores) {
    const int c = m->n_embd, hs = m->head_dim;
    const int64_t pos = job->pos[r];
    const size_t base = (((size_t)job->slot[r] * m->n_head + hd) * m->window) * hs;
    const float *q = m->qkv + (size_t)r * 3 * c + hd * hs;
    const size_t at = base * elem_size(m->kvt);
    const void *k = (const char *)L->k + at, *v = (const char *)L->v + at;
    float *out = m->y + (size_t)r * c + hd * hs;
#ifdef NS_X86
    if (m->avx2 && hs % 8 == 0) {
        attend_avx2(q, k, v, pos + 1, hs, scores, out, m->kvt);
        return;
    }
#endif
    attend_generic(q, k, v, pos + 1, hs, scores, out, m->kvt);
}

/* ---------------------------------------------------------------- the step, per thread */

static inline void sync(const Job *job) {
    if (!job->serial) job->m->barrier();
}

/* Rows of the residual stream, normalised: all of them (sel NULL) or rows sel[0..n), compacted.
 * Fewer than two rows per thread are normalised by every thread into its own buffer, no barrier;
 * more are split between the threads, who then wait for each other. The same function either
 * way, so the same values. */
static const float *normalise(const Job *job, Norm nm, const int64_t *sel, int n, int tid, int nt, float *own) {
    const Model *m = job->m;
    const int c = m->n_embd;
    float *dst = own;
    int r0 = 0, step = 1;
    if (n >= 2 * nt) {
        dst = m->hn, r0 = tid, step = nt;
    }
    for (int r = r0; r < n; r += step) {
        const size_t src = sel ? (size_t)sel[r] : (size_t)r;
        const float *row = m->x + src * c;
        float *normed = dst + (size_t)r * c;
#ifdef NS_X86
        if (m->avx512)
            layer_norm_avx512(row, normed, c, nm, m->eps);
        else if (m->avx2)
            layer_norm_avx2(row, normed, c, nm, m->eps);
        else
#endif
            layer_norm_plain(row, normed, c, nm, m->eps);
    }
    if (dst == m->hn) sync(job);
    return dst;
}

static void step_thread(void *arg) {
    const Job *job = arg;
    const Model *m = job->m;
    const int tid = job->serial ? 0 : m->thread_num(), nt = job->serial ? 1 : m->num_threads();
    const int rows = job->rows, c = m->n_embd;
    float *own = m->h + (size_t)tid * 2 * m->max_threads * c;
    float *scores = m->att + (size_t)tid * m->window;
    const int heads = rows * m->n_head, head_chunk = chunk_of(heads, nt);
    int phase = 0;

    for (int r = tid; r < rows; r += nt) {
        /* Token t's embedding: row t of wte, or (tied) output feature t of the head's panels, or of
         * its tile copy once the panels are gone (see ns_tiles_only). */
        const int t = (int)job->tok[r];
        const size_t pe = (size_t)job->pos[r] * c;
        float *x = m->x + (size_t)r * c;
        if (!m->wte && !m->head.w) {
            const uint16_t *tile = m->head.tiles + (size_t)(t / PANEL) * ROUND32(c) * PANEL + (t % PANEL) * 2;
            for (int i = 0; i < c; i++)
                x[i] = bf16_to_float(tile[(size_t)(i / 2) * 2 * PANEL + i % 2]) + to_float(m->wpe, m->wt, pe + i);
            continue;
        }
        const void *table = m->wte ? m->wte : m->head.w;
        const size_t te = m->wte ? (size_t)t * c : (size_t)(t / PANEL) * c * PANEL + panel_lane(t % PANEL, m->wt);
        const size_t step = m->wte ? 1 : PANEL;
        for (int i = 0; i < c; i++) x[i] = to_float(table, m->wt, te + i * step) + to_float(m->wpe, m->wt, pe + i);
    }
    sync(job);
    for (int li = 0; li < m->n_layer; li++) {
        const Layer *L = &m->layers[li];
        const float *h = normalise(job, L->ln1, NULL, rows, tid, nt, own);
        gemv_claimed(job, phase++, &L->attn, h, rows, m->qkv, 3 * c, 0, 0, tid, nt);
        sync(job);
        for (int p = tid; p < heads; p += nt) store_kv(m, L, job, p / m->n_head, p % m->n_head);
        sync(job);
        for (int p0 = claim(job, phase, head_chunk); p0 < heads; p0 = claim(job, phase, head_chunk))
            for (int p = p0; p < p0 + head_chunk && p < heads; p++) {
                if (p + 1 < heads) prefetch_kv(m, L, job, (p + 1) / m->n_head, (p + 1) % m->n_head);
                attend(m, L, job, p / m->n_head, p % m->n_head, scores);
            }
        phase++;
        sync(job);
        gemv_claimed(job, phase++, &L->proj, m->y, rows, m->x, c, 1, 0, tid, nt);
        sync(job);
        h = normalise(job, L->ln2, NULL, rows, tid, nt, own);
        gemv_claimed(job, phase++, &L->fc, h, rows, m->f, 4 * c, 0, 1, tid, nt);
        sync(job);
        gemv_claimed(job, phase++, &L->mproj, m->f, rows, m->x, c, 1, 0, tid, nt);
        sync(job);
    }
    const float *h = normalise(job, m->lnf, job->out, job->n_out, tid, nt, own);
    gemv_claimed(job, phase, &m->head, h, job->n_out, job->logits, m->vocab, 0, 0, tid, nt);
#ifdef NS_X86
    if (m->amx) amx_release(); /* the thread's tile state is not kept between steps */
#endif
}

/* ---------------------------------------------------------------- the interface */

void ns_free(void *model);

/* The model's linear layers, numbered: each layer's four (attn, proj, fc, mproj), then the output
 * layer (n_linears(m) - 1). */
static int n_linears(const Model *m) { return 4 * m->n_layer + 1; }

static Linear *linear_at(Model *m, int i) {
    if (i == 4 * m->n_layer) return &m->head;
    Layer *L = &m->layers[i / 4];
    Linear *const four[4] = {&L->attn, &L->proj, &L->fc, &L->mproj};
    return four[i % 4];
}

/* Kernel levels (ns_set_isa). The two tile levels read the bf16 tile copy and round inputs. */
enum { ISA_C, ISA_AVX2, ISA_AVX512, ISA_AVX512BF16, ISA_AMX };

#ifdef NS_X86
/* The best tile level this bfloat16 model can run here: AVX512-BF16 where the CPU has it, AMX where
 * it also has AMX and the kernel lets this process use it (Linux asks each process to request the
 * tile state); ISA_C (none) for a float32 model or an older CPU. */
static int tiles_possible(const Model *m) {
    if (m->wt != BF16 || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16"))
        return ISA_C;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return ISA_AVX512BF16;
#ifdef SYS_arch_prctl
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0)
        return ISA_AMX;
#endif
    return ISA_AVX512BF16;
}

/* Tile level `level` can run: possible here, and the tile copies and input buffers exist. */
static int tiles_ready(Model *m, int level) {
    if (tiles_possible(m) < level) return 0;
    if (!m->xb) {
        m->xb = calloc((size_t)m->max_threads * xb_each(m), sizeof(uint16_t));
        if (!m->xb) return 0;
    }
    for (int i = 0; i < n_linears(m); i++) {
        Linear *l = linear_at(m, i);
        if (!l->tiles && !(l->tiles = amx_tiles(l))) return 0;
    }
    return 1;
}
#endif

/* The best level that reads the tile copy for this model here (3 AVX512-BF16, 4 AMX), or 0. */
int ns_tiles_possible(void *model) {
#ifdef NS_X86
    return tiles_possible(model);
#else
    (void)model;
    return 0;
#endif
}

/* Make linear i's tile copy now (each layer's four in order, then the output layer), so a caller
 * that frees each panel after its tiles are made never holds two copies of every weight at once
 * (ns_set_isa would make them all together). Returns 1 if they exist. */
int ns_tile_linear(void *model, int i) {
#ifdef NS_X86
    Model *m = model;
    if (i < 0 || i >= n_linears(m) || m->wt != BF16) return 0;
    Linear *l = linear_at(m, i);
    if (!l->tiles && l->w) l->tiles = amx_tiles(l);
    return l->tiles != NULL;
#else
    (void)model, (void)i;
    return 0;
#endif
}

/* With a tile level in use, stop reading the linear layers' panels: the caller may free them (the
 * weights are then held once, in tile order). Only the tile levels run afterwards. Returns 1 if done. */
int ns_tiles_only(void *model) {
    Model *m = model;
    if (!m->amx && !m->dpbf16) return 0;
    for (int i = 0; i < n_linears(m); i++) linear_at(m, i)->w = NULL;
    m->tiles_only = 1;
    return 1;
}

/* The kernels to use, at most `level` (0 portable C, 1 AVX2 + FMA, 2 AVX-512 matrix kernels, 3
 * AVX512-BF16 and 4 AMX for a bfloat16 model's linear layers) and at most what this CPU has; returns
 * the level in effect. Levels 0-2 compute the same function, 1 and 2 the same bits; levels 3 and 4
 * round the linear layers' inputs to bfloat16 first (see gemv_dp, gemv_amx). Once the panels are
 * gone (ns_tiles_only) a request below level 3 gets level 3. (Lower levels are for comparing and
 * benchmarking.) */
int ns_set_isa(void *model, int level) {
    Model *m = model;
    if (m->tiles_only && level < ISA_AVX512BF16) level = ISA_AVX512BF16;
    m->avx2 = m->avx512 = m->dpbf16 = m->amx = 0;
#ifdef NS_X86
    m->avx2 = level >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    m->avx512 = m->avx2 && level >= ISA_AVX512 && __builtin_cpu_supports("avx512f");
    m->amx = m->avx512 && level >= ISA_AMX && tiles_ready(m, ISA_AMX);
    m->dpbf16 = !m->amx && m->avx512 && level >= ISA_AVX512BF16 && tiles_ready(m, ISA_AVX512BF16);
#endif
    return m->amx ? ISA_AMX : m->dpbf16 ? ISA_AVX512BF16 : m->avx512 ? ISA_AVX512 : m->avx2 ? ISA_AVX2 : ISA_C;
}

static Linear linear(const void *const **p, int out, int in) {
    Linear l = {(*p)[0], (const float *)(*p)[1], out, in, NULL};
    *p += 2;
    return l;
}

static Norm norm(const void *const **p) {
    Norm n = {(const float *)(*p)[0], (const float *)(*p)[1]};
    *p += 2;
    return n;
}

/* ptrs: wte (or NULL when the output layer is tied to it: the embeddings are then read from the
 * head's panels, so the model needs them once), wpe; per layer ln1.w, ln1.b, attn.w, attn.b,
 * proj.w, proj.b, ln2.w, ln2.b, fc.w, fc.b, mproj.w, mproj.b, k, v; then lnf.w, lnf.b, head.w,
 * head.b. Biases may be NULL. Linear weights and embeddings are of type wt, k and v of type kvt
 * (F32 or BF16), the rest float32.
 * omp: GOMP_parallel, GOMP_barrier, omp_get_thread_num, omp_get_num_threads, or NULL (one thread). */
void *ns_create(int n_layer, int n_head, int n_embd, int vocab, int slots, int window, int max_rows,
                int max_threads, float eps, int wt, int kvt, const void *const *ptrs, void *const *omp) {
    Model *m = calloc(1, sizeof(Model));
    if (!m) return NULL;
    const int c = n_embd;
    *m = (Model){.n_layer = n_layer, .n_head = n_head, .head_dim = n_embd / n_head, .n_embd = c,
                 .vocab = vocab, .slots = slots, .window = window, .max_rows = max_rows,
                 .max_threads = max_threads, .eps = eps, .wt = wt == BF16 ? BF16 : F32,
                 .kvt = kvt == BF16 ? BF16 : F32};
    if (omp) {
        m->parallel = (parallel_fn)omp[0];
        m->barrier = (barrier_fn)omp[1];
        m->thread_num = (int_fn)omp[2];
        m->num_threads = (int_fn)omp[3];
    }
    const void *const *p = ptrs;
    m->wte = *p++;
    m->wpe = *p++;
    m->layers = calloc(n_layer, sizeof(Layer));
    size_t r = max_rows;
    m->x = calloc(r * c, sizeof(float));
    m->qkv = calloc(r * 3 * c, sizeof(float));
    m->y = calloc(r * c, sizeof(float));
    m->f = calloc(r * 4 * c, sizeof(float));
    m->h = calloc((size_t)max_threads * 2 * max_threads * c, sizeof(float));
    m->hn = calloc(r * c, sizeof(float));
    m->att = calloc((size_t)max_threads * window, sizeof(float));
    m->next = calloc(PHASES(n_layer), sizeof(int));
    if (!m->layers || !m->x || !m->qkv || !m->y || !m->f || !m->h || !m->hn || !m->att || !m->next) {
        ns_free(m);
        return NULL;
    }
    for (int i = 0; i < n_layer; i++) {
        Layer *L = &m->layers[i];
        L->ln1 = norm(&p);
        L->attn = linear(&p, 3 * c, c);
        L->proj = linear(&p, c, c);
        L->ln2 = norm(&p);
        L->fc = linear(&p, 4 * c, c);
        L->mproj = linear(&p, c, 4 * c);
        L->k = (void *)*p++;
        L->v = (void *)*p++;
    }
    m->lnf = norm(&p);
    m->head = linear(&p, vocab, c);
    ns_set_isa(m, ISA_AVX512); /* the caller asks for a tile level: its tiles take a copy of the weights */
    return m;
}

/* One forward over `rows` token rows (<= max_rows): row i feeds tok[i] at pos[i] into cache slot
 * slot[i] (decode rows, or the tokens of prompt chunks, a sequence's in position order); the
 * logits of rows out[0..n_out) go to `logits`. On `threads` threads (<= max_threads). */
void ns_step(void *model, int rows, const int64_t *tok, const int64_t *pos, const int64_t *slot, int n_out,
             const int64_t *out, float *logits, int threads) {
    Model *m = model;
    Job job = {m, rows, !m->parallel || threads <= 1, tok, pos, slot, out, n_out, logits};
    memset(m->next, 0, PHASES(m->n_layer) * sizeof(int));
    if (job.serial)
        step_thread(&job);
    else
        m->parallel(step_thread, &job, (unsigned)threads, 0);
}

void ns_free(void *model) {
    Model *m = model;
    if (!m) return;
    if (m->layers)
        for (int i = 0; i < n_linears(m); i++) free(linear_at(m, i)->tiles);
    free(m->xb);
    free(m->layers), free(m->x), free(m->qkv), free(m->y), free(m->f), free(m->h), free(m->hn), free(m->att), free(m->next);
    free(m);
}
