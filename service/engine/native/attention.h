/* Part of decode.c, which includes it once: one translation unit, so the library stays one file to
 * build and these parts share its types and helpers. Attention of one query row and head over its
 * slot's cached keys and values (and of a prompt chunk's rows a few at a time, attend_rows), and
 * the stores of each step's new keys and values. */

/* ---------------------------------------------------------------- attention */

/* A prompt chunk's rows attend in blocks of up to ATT_ROWS (attend_rows): one slot, consecutive
 * positions. Head sizes up to ATT_MAX_HEAD, a multiple of 16, on the AVX-512 level. */
#define ATT_ROWS 4
#define ATT_MAX_HEAD 256

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

/* Sixteen cached elements from element i on, as float32 (attend_rows_kv512's value sums). */
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline __m512 load_kv16(const void *p, size_t i,
                                                                                         int bf) {
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
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

/* The next item's keys and values (ahead_of), asked for into L2 a little at a time while this one
 * is computed: k and v from `done` up to `bytes`, then the lines in [own, own_end). */
typedef struct {
    const char *k, *v;
    size_t bytes, done, own, own_end;
} Ahead;

static inline void ahead_some(Ahead *ah, size_t bytes) {
    if (!ah) return;
    const size_t end = ah->done + bytes < ah->bytes ? ah->done + bytes : ah->bytes;
    for (; ah->done < end; ah->done += 64) prefetch_line_l2(ah->k + ah->done), prefetch_line_l2(ah->v + ah->done);
}

static inline void ahead_rest(Ahead *ah) {
    if (!ah) return;
    ahead_some(ah, ah->bytes);
    for (size_t at = ah->own; at < ah->own_end; at += 64) prefetch_line_l2(ah->k + at), prefetch_line_l2(ah->v + at);
}

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
            if (i == 0) ahead_some(ah, 64);                                                                \
            const __m256 p = _mm256_set1_ps(scores[t]);                                                    \
            const size_t vt = (size_t)t * hs + i;                                                          \
            for (int j = 0; j < (W); j++) o[j] = _mm256_fmadd_ps(p, load_kv(v, vt + 8 * j, bf), o[j]);    \
        }                                                                                                  \
        for (int j = 0; j < (W); j++) _mm256_storeu_ps(out + i + 8 * j, o[j]);                            \
    }

/* scores[0, n) -> the softmax weights p_t, in place. */
__attribute__((target("avx2,fma"), always_inline)) static inline void softmax_scores(float *scores, int64_t n) {
    int64_t t;
    /* The largest score, eight lanes at a time (the scalar loop was one long dependency chain: a
     * fifth of a long prompt's attention). A maximum rounds nothing, so any order finds the same
     * one; max_ps returns its second operand when the first is NaN, so NaN scores are skipped as
     * the comparison below skips them. (Which zero wins a tie of 0.0 and -0.0 may differ;
     * exp(x - best) is the same either way.) */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (t = 0; t + 8 <= n; t += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(scores + t), vmax);
    float best = hmax256(vmax);
    for (; t < n; t++) best = scores[t] > best ? scores[t] : best;
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
}

/* hsum256 of eight vectors at once, into out[0..8) times scale: each sum is added in hsum256's
 * order ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), so the same bits, in a third of the
 * instructions (transposed: halves, then pairs, then the last add, eight sums to a register). */
__attribute__((target("avx2,fma"), always_inline)) static inline void hsum256x8(const __m256 v[8], float scale,
                                                                               float *out) {
    __m256 p[4];
    for (int j = 0; j < 4; j++) /* [v_2j[i] + v_2j[i + 4] | v_2j+1[i] + v_2j+1[i + 4]], i < 4 */
        p[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    /* s0 + s2 and s1 + s3 of each: [v0's, v0's, v2's, v2's | v1's, v1's, v3's, v3's] and v4-v7's */
    const __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xEE));
    const __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xEE));
    /* [h0, h2, h4, h6 | h1, h3, h5, h7] */
    const __m256 h = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, 0x88), _mm256_shuffle_ps(q0, q1, 0xDD));
    const __m256 scaled = _mm256_mul_ps(h, _mm256_set1_ps(scale));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(scaled, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* Attention of one query (head_dim a multiple of 8) over n cached positions, into out; the cache
 * holds float32 or (bf) bfloat16. Scores eight positions at a time (eight chains: four left the
 * FMA units waiting on latency, with attention some 13% of a 64-row 124M step). */
__attribute__((target("avx2,fma"), always_inline)) static inline void attend_kv(
    const float *q, const void *k, const void *v, int64_t n, int hs, float *scores, float *out, int bf, Ahead *ah) {
    const float scale = 1.0f / sqrtf((float)hs);
    int64_t t = 0;
    const size_t row_bytes = (size_t)hs * (bf ? 2 : 4);
    for (; t + 8 <= n; t += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        ahead_some(ah, 4 * row_bytes);
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
    softmax_scores(scores, n);
    int i = 0;
    PV_BLOCK(8)
    PV_BLOCK(4)
    PV_BLOCK(1)
    ahead_rest(ah);
}
#undef SCORE_STEP
#undef SCORE_STORE
#undef PV_BLOCK

__attribute__((target("avx2,fma"))) static void attend_avx2(const float *q, const void *k, const void *v,
                                                            int64_t n, int hs, float *scores, float *out, int kvt,
                                                            Ahead *ah) {
    if (kvt == BF16)
        attend_kv(q, k, v, n, hs, scores, out, 1, ah);
    else
        attend_kv(q, k, v, n, hs, scores, out, 0, ah);
}

/* Up to ATT_ROWS query rows of one sequence at consecutive positions p0.. (a prompt chunk's), over
 * the same cached keys and values: each key and value is loaded and widened once for all of them.
 * Row j's scores are summed exactly as attend_kv sums one query's (eight lanes wide over the dims in
 * order, then hsum256), two rows to a 512-bit register; its softmax is softmax_scores; each of its
 * outputs is the same chain over t = 0..p0 + j. So every row gets attend_kv's bits. Scores of rows
 * past n and of positions past a row's own are computed and never read. stride: floats between
 * rows' scores. */
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void attend_rows_kv512(
    const float *const q[ATT_ROWS], const void *k, const void *v, int64_t p0, int n, int hs, float *scores,
    size_t stride, float *const out[ATT_ROWS], int bf) {
    const float scale = 1.0f / sqrtf((float)hs);
    const int64_t len = p0 + n; /* positions 0..p0 + n - 1: the last row's */
    const int chunks = hs / 8;
    const size_t row_bytes = (size_t)hs * (bf ? 2 : 4);
    float qp[2 * (ATT_MAX_HEAD / 8) * 16]; /* per pair of rows and 8 dims: lanes 0-7 one row's q, 8-15 the next's */
    for (int pr = 0; pr < 2; pr++)
        for (int c8 = 0; c8 < chunks; c8++) {
            memcpy(qp + ((size_t)pr * chunks + c8) * 16, q[2 * pr] + 8 * c8, 8 * sizeof(float));
            memcpy(qp + ((size_t)pr * chunks + c8) * 16 + 8, q[2 * pr + 1] + 8 * c8, 8 * sizeof(float));
        }
    int64_t t = 0;
#define KEY2(j) _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load_kv(k, (size_t)(t + (j)) * hs + 8 * c8, bf))))
#define PAIR_STORE(a, pr, j)                                                                                     \
    scores[(2 * (pr)) * stride + t + (j)] = hsum256(_mm512_castps512_ps256(a)) * scale;                          \
    scores[(2 * (pr) + 1) * stride + t + (j)] = hsum256(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))) * scale;
    for (; t + 8 <= len; t += 8) {
        __m512 a[8], b[8]; /* position t + i: rows 0 and 1 (a), 2 and 3 (b) */
        for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
        if (t + QK_AHEAD < len) {
            const char *ahead = (const char *)k + (size_t)(t + QK_AHEAD) * row_bytes;
            for (size_t x = 0; x < 8 * row_bytes; x += 64) prefetch_line(ahead + x);
        }
        for (int c8 = 0; c8 < chunks; c8++) {
            const __m512 qa = _mm512_loadu_ps(qp + (size_t)c8 * 16), qb = _mm512_loadu_ps(qp + ((size_t)chunks + c8) * 16);
            for (int i = 0; i < 8; i++) {
                const __m512 kk = KEY2(i);
                a[i] = _mm512_fmadd_ps(qa, kk, a[i]);
                b[i] = _mm512_fmadd_ps(qb, kk, b[i]);
            }
        }
        __m256 h[8];
        for (int i = 0; i < 8; i++) h[i] = _mm512_castps512_ps256(a[i]);
        hsum256x8(h, scale, scores + t);
        for (int i = 0; i < 8; i++) h[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1));
        hsum256x8(h, scale, scores + stride + t);
        for (int i = 0; i < 8; i++) h[i] = _mm512_castps512_ps256(b[i]);
        hsum256x8(h, scale, scores + 2 * stride + t);
        for (int i = 0; i < 8; i++) h[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b[i]), 1));
        hsum256x8(h, scale, scores + 3 * stride + t);
    }
    for (; t < len; t++) {
        __m512 a0 = _mm512_setzero_ps(), b0 = a0;
        for (int c8 = 0; c8 < chunks; c8++) {
            const __m512 kk = KEY2(0);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qp + (size_t)c8 * 16), kk, a0);
            b0 = _mm512_fmadd_ps(_mm512_loadu_ps(qp + ((size_t)chunks + c8) * 16), kk, b0);
        }
        PAIR_STORE(a0, 0, 0) PAIR_STORE(b0, 1, 0)
    }
#undef KEY2
#undef PAIR_STORE
    for (int j = 0; j < n; j++) softmax_scores(scores + j * stride, p0 + j + 1);
    /* out_j = sum over t <= p0 + j of p_j[t] v_t, 64 dims (four registers) per pass, then 16. */
    int i = 0;
    for (; i + 64 <= hs; i += 64) {
        __m512 o[ATT_ROWS][4];
        for (int j = 0; j < ATT_ROWS; j++)
            for (int g = 0; g < 4; g++) o[j][g] = _mm512_setzero_ps();
        for (t = 0; t < len; t++) {
            if (i == 0 && t + PV_AHEAD < len)
                for (size_t b = 0; b < row_bytes; b += 64) prefetch_line((const char *)v + (size_t)(t + PV_AHEAD) * row_bytes + b);
            const size_t vt = (size_t)t * hs + i;
            const __m512 v0 = load_kv16(v, vt, bf), v1 = load_kv16(v, vt + 16, bf), v2 = load_kv16(v, vt + 32, bf),
                         v3 = load_kv16(v, vt + 48, bf);
            for (int j = 0; j < ATT_ROWS; j++)
                if (j < n && t <= p0 + j) {
                    const __m512 pj = _mm512_set1_ps(scores[j * stride + t]);
                    o[j][0] = _mm512_fmadd_ps(pj, v0, o[j][0]);
                    o[j][1] = _mm512_fmadd_ps(pj, v1, o[j][1]);
                    o[j][2] = _mm512_fmadd_ps(pj, v2, o[j][2]);
                    o[j][3] = _mm512_fmadd_ps(pj, v3, o[j][3]);
                }
        }
        for (int j = 0; j < n; j++)
            for (int g = 0; g < 4; g++) _mm512_storeu_ps(out[j] + i + 16 * g, o[j][g]);
    }
    for (; i + 16 <= hs; i += 16) {
        __m512 o[ATT_ROWS];
        for (int j = 0; j < ATT_ROWS; j++) o[j] = _mm512_setzero_ps();
        for (t = 0; t < len; t++) {
            const __m512 vv = load_kv16(v, (size_t)t * hs + i, bf);
            for (int j = 0; j < ATT_ROWS; j++)
                if (j < n && t <= p0 + j) o[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * stride + t]), vv, o[j]);
        }
        for (int j = 0; j < n; j++) _mm512_storeu_ps(out[j] + i, o[j]);
    }
}

__attribute__((target("avx512f,avx2,fma"))) static void attend_rows_avx512(
    const float *const q[ATT_ROWS], const void *k, const void *v, int64_t p0, int n, int hs, float *scores,
    size_t stride, float *const out[ATT_ROWS], int kvt) {
    if (kvt == BF16)
        attend_rows_kv512(q, k, v, p0, n, hs, scores, stride, out, 1);
    else
        attend_rows_kv512(q, k, v, p0, n, hs, scores, stride, out, 0);
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

/* Byte offset of row r's keys (and values) of head hd, position 0, in a layer's cache
 * (slots, heads, window, head_dim): the block that row and head attend over. */
static size_t kv_block(const Model *m, const Job *job, int r, int hd) {
    return (((size_t)job->slot[r] * m->n_head + hd) * m->window) * m->head_dim * elem_size(m->kvt);
}

#ifdef NS_X86
/* float_to_bf16 eight at a time, the same bits (round to nearest even, denormals kept, NaN stays a
 * quiet NaN): not the AVX512-BF16 conversion of round_into, which flushes denormal inputs to zero,
 * where the cache must hold what torch's conversion gives. n a multiple of 8. */
__attribute__((target("avx2"))) static void bf16_exact_avx2(const float *src, int n, uint16_t *dst) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (int i = 0; i < n; i += 8) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(src + i));
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(hi, one))), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
        const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
        /* 32 -> 16 bits: every lane is below 0x10000, so the saturating pack keeps it; the pack
         * works within 128-bit halves, the permute puts the two halves' results side by side. */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
    }
}
#endif

/* src[0, n) -> dst in bfloat16 as float_to_bf16 rounds: the cache's stores, eight at a time (a
 * scalar loop was 3% of the samples of a 1,024-token prefill at 10.7M; 10.7M bf16 decode steps
 * of 32-64 rows are 1.02-1.03x faster this way). */
static void bf16_exact(const Model *m, const float *src, int n, uint16_t *dst) {
    int i = 0;
#ifdef NS_X86
    if (m->avx2) {
        i = n / 8 * 8;
        bf16_exact_avx2(src, i, dst);
    }
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* Row r's new key and value for head hd, into its slot at its position. */
static void store_kv(const Model *m, const Layer *L, const Job *job, int r, int hd) {
    const int c = m->n_embd, hs = m->head_dim;
    const size_t at = kv_block(m, job, r, hd) / elem_size(m->kvt) + (size_t)job->pos[r] * hs;
    const float *key = m->qkv + (size_t)r * 3 * c + c + hd * hs, *value = key + c;
    if (m->kvt == BF16) {
        bf16_exact(m, key, hs, (uint16_t *)L->k + at);
        bf16_exact(m, value, hs, (uint16_t *)L->v + at);
    } else {
        memcpy((float *)L->k + at, key, hs * sizeof(float));
        memcpy((float *)L->v + at, value, hs * sizeof(float));
    }
}

/* Row r's keys and values of head hd (the next item), to bring in while the current one is
 * computed: each item's block lies alone in its window-long stretch of the cache, so the hardware
 * prefetcher would start over at each one. Its first QK_AHEAD positions (attend_kv asks for the
 * later ones itself), and the row's own position past those, where a decode step's item stores its
 * key and value. Into L2, not L1: up to 2 x QK_AHEAD lines asked for at once fill L1's miss
 * buffers, so the current item's own loads would wait behind them, and they would push its keys
 * and values out of L1. A decode row's item asks for them a few lines at a time as it goes
 * (ahead_some in attend_kv's loops; a prompt chunk's block of rows still asks at once, see
 * attend_rows): asked for all at once, the prefetches wait for miss buffers and the thread stalls
 * behind them (5-10% of a 10.7M bf16 decode step). */
static Ahead ahead_of(const Model *m, const Layer *L, const Job *job, int r, int hd) {
    const size_t row_bytes = (size_t)m->head_dim * elem_size(m->kvt), at = kv_block(m, job, r, hd);
    const size_t n = (size_t)job->pos[r] + 1, bytes = (n < QK_AHEAD ? n : QK_AHEAD) * row_bytes;
    Ahead ah = {(const char *)L->k + at, (const char *)L->v + at, bytes, 0, 0, 0};
    if (n > QK_AHEAD) ah.own = (n - 1) * row_bytes, ah.own_end = n * row_bytes;
    return ah;
}

/* Row r's query for head hd over its slot's positions 0..pos (softmax in float32, as torch's
 * kernels do for float32). Every row's key and value are stored before any row attends, so rows
 * of one sequence (a prompt chunk) see each other's. */
static void attend(const Model *m, const Layer *L, const Job *job, int r, int hd, float *scores, Ahead *ah) {
    const int c = m->n_embd, hs = m->head_dim;
    const int64_t pos = job->pos[r];
    const float *q = m->qkv + (size_t)r * 3 * c + hd * hs;
    const size_t at = kv_block(m, job, r, hd);
    const void *k = (const char *)L->k + at, *v = (const char *)L->v + at;
    float *out = m->y + (size_t)r * c + hd * hs;
#ifdef NS_X86
    if (m->avx2 && hs % 8 == 0) {
        attend_avx2(q, k, v, pos + 1, hs, scores, out, m->kvt, ah);
        return;
    }
#endif
    attend_generic(q, k, v, pos + 1, hs, scores, out, m->kvt);
    ahead_rest(ah);
}

/* m->block for a step: runs of rows in one slot at consecutive positions (a prompt chunk's) are cut
 * into blocks of up to ATT_ROWS, each held by its first row (block[r] its size; 0 for the rest of
 * it); every other row is a block of one. Blocks only where attend_rows has its kernel. */
static void attention_blocks(Model *m, const Job *job) {
    const int blocks = m->avx512 && m->head_dim % 16 == 0 && m->head_dim <= ATT_MAX_HEAD;
    for (int r = 0, lead = 0; r < job->rows; r++) {
        if (blocks && r > lead && r - lead < ATT_ROWS && job->slot[r] == job->slot[r - 1] &&
            job->pos[r] == job->pos[r - 1] + 1) {
            m->block[lead]++;
            m->block[r] = 0;
        } else {
            lead = r;
            m->block[r] = 1;
        }
    }
}

/* Rows r..r + n - 1 (one block, see attention_blocks) for head hd: a block of one is attend's row;
 * a larger one gets attend's bits for each row, each key and value read once for all of them (a
 * 1024-token prompt at 124M spent a third of its forward in attention, row by row). `ah`: the next
 * item's lines (ahead_of) or NULL; a block of one asks for them as it goes, a larger one at once. */
static inline void attend_rows(const Model *m, const Layer *L, const Job *job, int r, int n, int hd, float *scores,
                               Ahead *ah) {
    if (n > 1) {
        ahead_rest(ah);
        ah = NULL;
    }
#ifdef NS_X86
    if (n > 1 && m->avx512) { /* attention_blocks forms larger blocks only for this kernel */
        const int c = m->n_embd, hs = m->head_dim;
        const size_t at = kv_block(m, job, r, hd);
        const float *q[ATT_ROWS];
        float *out[ATT_ROWS];
        for (int j = 0; j < ATT_ROWS; j++) {
            const int row = r + (j < n ? j : 0); /* rows past n: a stand-in, computed and never stored */
            q[j] = m->qkv + (size_t)row * 3 * c + hd * hs;
            out[j] = m->y + (size_t)row * c + hd * hs;
        }
        attend_rows_avx512(q, (const char *)L->k + at, (const char *)L->v + at, job->pos[r], n, hs, scores,
                           (size_t)m->window, out, m->kvt);
        return;
    }
#endif
    for (int j = 0; j < n; j++) attend(m, L, job, r + j, hd, scores, ah);
}
