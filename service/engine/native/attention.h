/* Part of decode.c, which includes it once: one translation unit, so the library stays one file to
 * build and these parts share its types and helpers. Attention of one query row and head over its
 * slot's cached keys and values, and the stores of each step's new keys and values. */

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

/* Byte offset of row r's keys (and values) of head hd, position 0, in a layer's cache
 * (slots, heads, window, head_dim): the block that row and head attend over. */
static size_t kv_block(const Model *m, const Job *job, int r, int hd) {
    return (((size_t)job->slot[r] * m->n_head + hd) * m->window) * m->head_dim * elem_size(m->kvt);
}

/* Row r's new key and value for head hd, into its slot at its position. */
static void store_kv(const Model *m, const Layer *L, const Job *job, int r, int hd) {
    const int c = m->n_embd, hs = m->head_dim;
    const size_t at = kv_block(m, job, r, hd) / elem_size(m->kvt) + (size_t)job->pos[r] * hs;
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
    const size_t row_bytes = (size_t)m->head_dim * elem_size(m->kvt), at = kv_block(m, job, r, hd);
    const size_t n = (size_t)job->pos[r] + 1, bytes = (n < QK_AHEAD ? n : QK_AHEAD) * row_bytes;
    const char *k = (const char *)L->k + at, *v = (const char *)L->v + at;
    for (size_t at = 0; at < bytes; at += 64) prefetch_line(k + at), prefetch_line(v + at);
}

/* Row r's query for head hd over its slot's positions 0..pos (softmax in float32, as torch's
 * kernels do for float32). Every row's key and value are stored before any row attends, so rows
 * of one sequence (a prompt chunk) see each other's. */
static void attend(const Model *m, const Layer *L, const Job *job, int r, int hd, float *scores) {
    const int c = m->n_embd, hs = m->head_dim;
    const int64_t pos = job->pos[r];
    const float *q = m->qkv + (size_t)r * 3 * c + hd * hs;
    const size_t at = kv_block(m, job, r, hd);
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
