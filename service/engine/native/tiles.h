/* Part of decode.c, which includes it once: one translation unit, so the library stays one file to
 * build and these parts share its types and helpers. The tile levels for bfloat16 models: AMX
 * tiles and AVX512-BF16 dot products over one tile copy of the weights, on inputs rounded to bf16. */

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

/* Elements of one thread's bf16 inputs buffer, each row as wide as the widest input. A thread
 * rounds inputs for itself only for steps of fewer than two rows per thread (larger ones read the
 * shared copies, see round_shared in decode.c), so it holds that many rows, in whole tiles. */
static inline size_t xb_each(const Model *m) {
    return (size_t)ROUND32(2 * m->max_threads) * ROUND32(4 * m->n_embd);
}

/* src[0, n) -> dst[0, n) in bfloat16, rounded to nearest even as torch rounds (denormal inputs
 * become zero): 32 at a time, then 16, then the tail (AMX CPUs have AVX512-BF16). Every bf16 input
 * of the tile levels goes through here, so a value gets the same bits whoever rounds it. */
__attribute__((target("avx512f,avx512bf16"))) static void round_into(const float *src, int n, uint16_t *dst) {
    int i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512((void *)(dst + i),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i)));
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
        uint16_t tail[16];
        const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1u), src + i);
        _mm256_storeu_si256((__m256i *)tail, (__m256i)_mm512_cvtneps_pbh(v));
        memcpy(dst + i, tail, (size_t)(n - i) * sizeof(uint16_t));
    }
}

/* x (rows, in) float32 -> xb (rows, ROUND32(in)) bfloat16, zero-padded: the buffer also holds rows
 * of other widths between calls, so the padding is written each time. */
static void to_bf16_rows(const float *x, int rows, int in, uint16_t *xb) {
    const int inp = ROUND32(in);
    for (int r = 0; r < rows; r++) {
        uint16_t *dst = xb + (size_t)r * inp;
        round_into(x + (size_t)r * in, in, dst);
        memset(dst + in, 0, (size_t)(inp - in) * sizeof(uint16_t));
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
/* One input pair kk of the kernels below: the two panels' weights, then every row's products. */
#define KSTEPDP                                                                                            \
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + (size_t)kk * 2 * PANEL));         \
    const __m512bh w1 = P > 1 ? (__m512bh)_mm512_loadu_si512((const void *)(wp2 + (size_t)kk * 2 * PANEL)) : w0; \
    ROWDP(0) ROWDP(1) ROWDP(2) ROWDP(3) ROWDP(4) ROWDP(5)                                                   \
    ROWDP(6) ROWDP(7) ROWDP(8) ROWDP(9) ROWDP(10) ROWDP(11)
#define STORESDP                                                                                           \
    STOREDP(0) STOREDP(1) STOREDP(2) STOREDP(3) STOREDP(4) STOREDP(5)                                       \
    STOREDP(6) STOREDP(7) STOREDP(8) STOREDP(9) STOREDP(10) STOREDP(11)
/* Rows N (x: bf16, rows inp apart) against P tile panels (wp, and wp2 for the second); and
 * meanwhile lines [0, lines) of pf (the next panel pair's share, see gemv_pairs) into L2, one per
 * input pair (AHEAD_LOOP): spread over the products instead of asked for all at once. */
#define PANELDP(NAME, N, NP)                                                                               \
    __attribute__((target("avx512f,avx512bf16"))) static void NAME(                                        \
        const void *wpv, const void *wp2v, int inp, const void *xv, float *sums, const char *pf, int lines) { \
        enum { R = N, P = NP };                                                                            \
        const uint16_t *wp = wpv, *wp2 = wp2v, *x = xv;                                                    \
        ACCUMULATORS24                                                                                     \
        (void)wp2;                                                                                         \
        AHEAD_LOOP(kk, inp / 2, KSTEPDP)                                                                   \
        STORESDP                                                                                           \
    }
#define PANELDP_KERNELS(NP)                                                                                \
    PANELDP(pdp_##NP##_1, 1, NP) PANELDP(pdp_##NP##_2, 2, NP) PANELDP(pdp_##NP##_3, 3, NP)                \
    PANELDP(pdp_##NP##_4, 4, NP) PANELDP(pdp_##NP##_5, 5, NP) PANELDP(pdp_##NP##_6, 6, NP)                \
    PANELDP(pdp_##NP##_7, 7, NP) PANELDP(pdp_##NP##_8, 8, NP) PANELDP(pdp_##NP##_9, 9, NP)                \
    PANELDP(pdp_##NP##_10, 10, NP) PANELDP(pdp_##NP##_11, 11, NP) PANELDP(pdp_##NP##_12, 12, NP)
PANELDP_KERNELS(1)
PANELDP_KERNELS(2)

#define PANELDP_TABLE(NP)                                                                                  \
    {pdp_##NP##_1, pdp_##NP##_2, pdp_##NP##_3, pdp_##NP##_4, pdp_##NP##_5, pdp_##NP##_6,                  \
     pdp_##NP##_7, pdp_##NP##_8, pdp_##NP##_9, pdp_##NP##_10, pdp_##NP##_11, pdp_##NP##_12}
static const pair_fn PANELSDP[2][MAX_R512] = {PANELDP_TABLE(1), PANELDP_TABLE(2)}; /* [panels - 1][rows - 1] */

/* gemv_amx's product with VDPBF16PS, on the 512-bit families' loop (gemv_pairs; tile rows of
 * inputs, the next panel pair prefetched). */
static void gemv_dp(const Linear *l, const uint16_t *xb, int rows, float *y, int ystride, int o0, int o1,
                    int accumulate) {
    const int inp = ROUND32(l->in);
    gemv_pairs(l, PANELSDP, (const char *)l->tiles, (size_t)inp * PANEL * sizeof(uint16_t), inp, (const char *)xb,
               (size_t)inp * sizeof(uint16_t), rows, y, ystride, o0, o1, accumulate);
}
#endif
