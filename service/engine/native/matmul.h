/* Part of decode.c, which includes it once: one translation unit, so the library stays one file to
 * build and these parts share its types and helpers. The linear layers' products on the widening
 * kernels: weights in panels, the AVX2 and AVX-512 register blocks, the stores after them, and
 * gemv, which picks the level. */

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

/* Rows in the next register block when `left` rows remain and blocks hold up to `most`: full
 * blocks, except that a last block of `few` rows or fewer is evened out with the one before (13
 * rows in blocks of 12: 7 + 6, not 12 + 1), since a block of few rows reloads the whole panel (pair)
 * for little work. AVX-512, blocks of 12, few 4: 13 rows 1.12-1.26x, 25 rows 1.03-1.11x, 28 rows
 * 1.02-1.03x (10.7M and 124M); rebalancing all blocks lost 1-3% at 16-64 rows and evening out a
 * last block of 5-6 was within the noise: 12 rows a block is the kernels' best. AVX2, blocks of 6,
 * few 2: 10.7M float32 7 / 8 / 13 rows 1.09x / 1.08-1.12x / 1.00-1.09x. */
static inline int block_rows(int left, int most, int few) {
    return left <= most ? left : left <= most + few ? (left + 1) / 2 : most;
}

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

/* The largest of eight lanes (max_ps: of 0.0 and -0.0 either may come out). */
__attribute__((target("avx2,fma"))) static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
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
 * AVX-512 the AVX2 kernels use half of each FMA unit, and torch's own matmuls, which use all of
 * it, beat them (torch / native 0.75 at 64 decode rows of the 124M model). bfloat16 panels are widened in the order they
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
/* The 2 x 12 accumulators of the 512-bit kernels (these and the tile levels' in tiles.h). */
#define ACCUMULATORS24                                                                                     \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, \
           a9 = a0, a10 = a0, a11 = a0;                                                                    \
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0, \
           b11 = a0;
/* Input k of the kernels below: the two panels' weights, then every row's products. */
#define KSTEP512                                                                                           \
    const __m512 w0 = LOAD512(wp, k);                                                                      \
    const __m512 w1 = P > 1 ? LOAD512(wp2, k) : w0;                                                        \
    ROW512(0) ROW512(1) ROW512(2) ROW512(3) ROW512(4) ROW512(5)                                             \
    ROW512(6) ROW512(7) ROW512(8) ROW512(9) ROW512(10) ROW512(11)
#define STORES512                                                                                          \
    STORE512(0) STORE512(1) STORE512(2) STORE512(3) STORE512(4) STORE512(5)                                 \
    STORE512(6) STORE512(7) STORE512(8) STORE512(9) STORE512(10) STORE512(11)
/* feature j of a bfloat16 panel is lane panel_lane(j): j % 8 * 2 + j / 8 */
#define ORDER512 const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
/* for (i = 0; i < n; i++) STEP, asking for line i of pf into L2 with each of the first `lines`
 * steps: two loops, so that the steps past them carry no test (a test per step costs the 512-token
 * prefill 1-1.5%); and with no lines (a single row block) the plain loop alone, which the
 * compiler lays out as the kernels without prefetches (through the two loops, float32 at 4 / 8
 * rows runs 0.95x / 0.97x). */
#define AHEAD_LOOP(i, n, STEP)                                                                             \
    if (lines <= 0) {                                                                                      \
        for (int i = 0; i < (n); i++) {                                                                    \
            STEP                                                                                           \
        }                                                                                                  \
    } else {                                                                                               \
        int i = 0;                                                                                         \
        for (const int ahead_ = lines < (n) ? lines : (n); i < ahead_; i++) {                             \
            prefetch_line_l2(pf + (size_t)i * 64);                                                         \
            STEP                                                                                           \
        }                                                                                                  \
        for (; i < (n); i++) {                                                                             \
            STEP                                                                                           \
        }                                                                                                  \
    }
/* Rows N against P panels (wp, and wp2 for the second), weights float32 (BF 0) or bfloat16; and
 * meanwhile lines [0, lines) of pf (a share of the next panel pair, see gemv_pairs) into L2, one
 * per input. */
#define PANEL512(NAME, N, NP, B)                                                                           \
    __attribute__((target("avx512f"))) static void NAME(const void *wp, const void *wp2, int in,          \
                                                        const void *xv, float *sums, const char *pf, int lines) { \
        enum { R = N, P = NP, BF = B };                                                                    \
        const float *x = xv;                                                                               \
        ORDER512                                                                                           \
        ACCUMULATORS24                                                                                     \
        (void)order, (void)wp2;                                                                            \
        AHEAD_LOOP(k, in, KSTEP512)                                                                        \
        STORES512                                                                                          \
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

/* A kernel of the 512-bit families (these widening ones, and the tile levels' AVX512-BF16 ones):
 * one panel's weights wp (and wp2 for a second panel), k inputs per row, rows of x k elements
 * apart, sums out; asking for `lines` cache lines from pf into L2 as it goes (see gemv_pairs). */
typedef void (*pair_fn)(const void *wp, const void *wp2, int k, const void *x, float *sums, const char *pf,
                        int lines);
/* [F32 / BF16][panels - 1][rows - 1] */
static const pair_fn PANELS512[2][2][MAX_R512] = {
    {PANEL512_TABLE(f32, 1), PANEL512_TABLE(f32, 2)}, {PANEL512_TABLE(bf16, 1), PANEL512_TABLE(bf16, 2)}};
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

/* y[r][o] (+)= W[o] . x[r] + b[o] for o in [o0, o1) with a 512-bit family's kernels[panels - 1]
 * [rows - 1]: panels two at a time (one when a single panel is left), rows in blocks of MAX_R512.
 * w: the panels, panel_bytes each; x: the rows, x_bytes apart; k: the kernels' inputs per row.
 * Where there are two or more row blocks, each block's kernel asks for its share of the next panel
 * pair, one cache line per input (pair) into L2, interleaved with its products (at the
 * AVX512-BF16 rate the hardware prefetcher no longer hides the weight stream: 124M bf16 16 rows
 * 1.13x, 10.7M 64 rows 1.06x; batch 1 unchanged, one block). Spread out rather than asked for at
 * once before the block: a burst of up to a few hundred prefetches waits for miss buffers while
 * the kernel cannot start (float32 kernels lose 5-15% with it). */
static void gemv_pairs(const Linear *l, const pair_fn kernels[2][MAX_R512], const char *w, size_t panel_bytes, int k,
                       const char *x, size_t x_bytes, int rows, float *y, int ystride, int o0, int o1, int accumulate) {
    float sums[2 * MAX_R512 * PANEL];
    const int blocks = (rows + MAX_R512 - 1) / MAX_R512;
    const size_t share = (2 * panel_bytes / blocks + 63) / 64 * 64;
    for (int o = o0; o < o1; o += 2 * PANEL) {
        const char *wp = w + (size_t)(o / PANEL) * panel_bytes;
        const int two = o + PANEL < o1;
        /* past o1 too: with each thread's own part of the phase (decode.c, claim), its next claim
         * is most often the chunk that follows (10.7M bf16 16-64 rows 1.02-1.07x, 124M 1.01-1.05x) */
        const char *next = blocks > 1 && o + 2 * PANEL < l->out ? wp + 2 * panel_bytes : NULL;
        for (int r = 0, b = 0, n = 0; r < rows; r += n, b++) {
            n = block_rows(rows - r, MAX_R512, 4);
            float *yr = y + (size_t)r * ystride;
            const char *xr = x + (size_t)r * x_bytes;
            const size_t from = b * share, to = from + share < 2 * panel_bytes ? from + share : 2 * panel_bytes;
            const int lines = next && to > from ? (int)((to - from) / 64) : 0;
            kernels[two][n - 1](wp, wp + panel_bytes, k, xr, sums, lines ? next + from : NULL, lines);
            store512(l, yr, ystride, n, o, sums, accumulate);
            if (two) store512(l, yr, ystride, n, o + PANEL, sums + MAX_R512 * PANEL, accumulate);
        }
    }
}

/* gemv with the AVX-512 widening kernels. */
static void gemv512(const Model *m, const Linear *l, const float *x, int rows, float *y, int ystride, int o0,
                    int o1, int accumulate) {
    gemv_pairs(l, PANELS512[m->wt], l->w, (size_t)l->in * PANEL * elem_size(m->wt), l->in, (const char *)x,
               (size_t)l->in * sizeof(float), rows, y, ystride, o0, o1, accumulate);
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
        for (int r = 0, n = 0; r < rows; r += n) {
            n = block_rows(rows - r, MAX_R, 2);
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
