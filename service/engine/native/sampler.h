/* Part of decode.c, which includes it once (see attention.h). Drawing each row's next token from
 * its logits in one call: the repetition, frequency and presence penalties, temperature, top_k,
 * top_p, min_p, typical_p, then inverse-CDF sampling, the rules and the order of
 * model/sampling.py's whole-vocabulary path (sample_tokens with candidates off: apply_penalties,
 * apply_filters, sample_from_logits).
 *
 * Why here and not in torch: that path is some twenty torch operations over (rows, vocab), each
 * releasing the GIL and most allocating (rows, vocab) temporaries; at GPT-2's 50,257 tokens and 32
 * rows it took 13-18 ms of a 124M step of ~40, and at the shipped model's
 * 65 tokens the step's sampling was mostly GIL hand-offs to the event loop. Here a row is a few
 * passes over its logits in the thread's cache (fewer past top_k, which keeps only its tokens),
 * rows shared among the step's threads, and the GIL is released once for the whole call.
 *
 * What differs from torch: each token's exp is float32 (exp256, a few ulp from expf) where
 * top_p's mass is float64 there; sums are float64 either way. So a row's cuts and draw agree with
 * the torch path unless its running mass, min_p ratio or uniform number falls within ~1e-6 of a
 * boundary (the tests compare every draw). typical_p's entropy and distances are float64 here and
 * float32 in torch: on flat rows many distances lie within float32 rounding of each other, so
 * which of those near-ties stay at the cut can differ (the tests compare with a float64
 * reference and allow only those). Filters drop a token by zeroing its e; the top_k and
 * top_p cuts come from one radix select (crossing_bucket), counting tokens or summing mass. */

#define SAMPLE_BUCKET_BITS 13 /* model/nucleus.py's BUCKET_BITS: 8,192 buckets in score order */
#define SAMPLE_SORT_MAX 1024  /* rows this narrow sort every token (clearing the buckets costs more) */
#define SAMPLE_HEAP_MAX 256   /* top_k up to this on wider rows: a heap of the k largest */

typedef struct {
    float s, e; /* a token's scaled logit and exp(s - max) */
} Scored;

typedef struct {
    const Model *m;
    const float *logits;
    int rows, vocab, serial;
    const float *temperature; /* per row; 0: greedy (the argmax after the penalties); below 0: skipped */
    const int64_t *top_k;             /* 0, or the vocabulary or more: off */
    const double *top_p, *min_p, *typical_p, *uniform; /* top_p 1, min_p 0, typical_p 1: off */
    /* Penalties (NULL: none in the batch): per slot (slots, vocab) whether each token was seen
     * (prompt and generated) and how often generated; each row's slot and factors (1 / 0: off). */
    const uint8_t *seen;
    const int32_t *counts;
    const int64_t *slot;
    const float *repetition, *frequency, *presence;
    int64_t *out;
    char *scratch;
    size_t each; /* scratch bytes per thread */
} SampleJob;

/* The bucket of a scaled logit, largest scores first (see model/nucleus.py _bucket_of). */
static inline int sample_bucket(float s) {
    /* (-0.0 and 0.0 may land in neighbouring buckets; a cut's value is the same either way, and
     * keep_from keeps tokens by comparing values, so both zeros stay or go together.) */
    int32_t bits;
    memcpy(&bits, &s, sizeof bits);
    const int32_t key = bits ^ (int32_t)((uint32_t)(bits >> 31) >> 1); /* signed, ordered as the scores */
    /* ~key reverses that order; flipping the sign bit makes it the unsigned order the shift keeps. */
    return (int)(((uint32_t)~key ^ 0x80000000u) >> (32 - SAMPLE_BUCKET_BITS));
}

static int by_score_descending(const void *a, const void *b) {
    const float x = ((const Scored *)a)->s, y = ((const Scored *)b)->s;
    return (x < y) - (x > y);
}

#ifdef NS_X86
/* scale_max and exp_sum eight at a time (the same divisions and maximum; e by exp256). Each
 * returns how many elements it did: a multiple of eight, the rest is the caller's. */
__attribute__((target("avx2,fma"))) static int scale_max_avx2(const float *z, int v, float t, float *s, float *best) {
    const int n = v & ~7;
    const __m256 vt = _mm256_set1_ps(t);
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_div_ps(_mm256_loadu_ps(z + i), vt);
        _mm256_storeu_ps(s + i, x);
        best8 = _mm256_max_ps(x, best8);
    }
    *best = hmax256(best8); /* (max_ps(x, best8) above has passed NaN scores by) */
    return n;
}

__attribute__((target("avx2,fma"))) static int exp_sum_avx2(const float *s, int n8, float best, float *e, double *sum) {
    const int n = n8 & ~7;
    const __m256 vb = _mm256_set1_ps(best);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (int i = 0; i < n; i += 8) {
        const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vb));
        _mm256_storeu_ps(e + i, x);
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    }
    double parts[4];
    _mm256_storeu_pd(parts, _mm256_add_pd(lo, hi));
    *sum = (parts[0] + parts[1]) + (parts[2] + parts[3]);
    return n;
}
#endif

/* s = logits / t for one row; returns the largest. */
static float scale_max(const Model *m, const float *z, int v, float t, float *s) {
    float best = -INFINITY;
    int i = 0;
#ifdef NS_X86
    if (m->avx2) i = scale_max_avx2(z, v, t, s, &best);
#else
    (void)m;
#endif
    for (; i < v; i++) {
        s[i] = z[i] / t;
        best = s[i] > best ? s[i] : best;
    }
    return best;
}

/* e = exp(s - best) for n scores; returns the sum of e (float64). */
static double exp_sum(const Model *m, const float *s, int n, float best, float *e) {
    double sum = 0.0;
    int i = 0;
#ifdef NS_X86
    if (m->avx2) i = exp_sum_avx2(s, n, best, e, &sum);
#else
    (void)m;
#endif
    for (; i < n; i++) {
        e[i] = expf(s[i] - best);
        sum += e[i];
    }
    return sum;
}

/* The penalties of one row, into `out` (a copy of its logits), as model/sampling.py's
 * apply_penalties computes them in float32: a seen token's logit divided by the repetition factor
 * (multiplied when negative), then count * frequency and presence subtracted from a generated
 * one's. Returns `out`, or the logits themselves when the row has no penalty. */
static const float *penalised(const SampleJob *job, int r, const float *z, int v, float *out) {
    if (!job->seen) return z;
    const float rep = job->repetition[r], freq = job->frequency[r], pres = job->presence[r];
    if (rep == 1.0f && freq == 0.0f && pres == 0.0f) return z;
    const uint8_t *seen = job->seen + (size_t)job->slot[r] * v;
    const int32_t *counts = job->counts + (size_t)job->slot[r] * v;
    for (int i = 0; i < v; i++) {
        float x = z[i];
        if (rep != 1.0f && seen[i]) x = x < 0.0f ? x * rep : x / rep;
        if (counts[i] > 0) x = x - (float)counts[i] * freq - pres;
        out[i] = x;
    }
    return out;
}

/* The k-th largest of v scores, for a k much smaller than v: a min-heap of the k largest seen,
 * which most scores pass by after one comparison with its root. `heap`: room for k floats. */
static float kth_by_heap(const float *s, int v, int k, float *heap) {
    for (int i = 0; i < k; i++) { /* the first k, then heapified */
        int c = i;
        heap[c] = s[i];
        while (c > 0 && heap[(c - 1) / 2] > heap[c]) {
            const float up = heap[(c - 1) / 2];
            heap[(c - 1) / 2] = heap[c], heap[c] = up, c = (c - 1) / 2;
        }
    }
    for (int i = k; i < v; i++) {
        if (!(s[i] > heap[0])) continue;
        int c = 0; /* the root goes; s[i] sinks to its place */
        for (;;) {
            const int l = 2 * c + 1, r = l + 1;
            int least = c;
            float x = s[i];
            if (l < k && heap[l] < x) least = l, x = heap[l];
            if (r < k && heap[r] < x) least = r;
            if (least == c) break;
            heap[c] = heap[least], c = least;
        }
        heap[c] = s[i];
    }
    return heap[0];
}

/* The tokens scoring at least `floor`, in vocabulary order: their indices and scores. */
static int keep_top(const float *s, int v, float floor, int *idx, float *kept) {
    int n = 0;
    for (int i = 0; i < v; i++)
        if (s[i] >= floor) idx[n] = i, kept[n++] = s[i];
    return n;
}

/* Each row's tokens, largest score first, as far as the crossing point needs them: every token
 * for a narrow row (above = 0); for a wide one the tokens of the bucket where the running total of
 * `weight` (e, or 1 a token when e is NULL) reaches `target`, *above the total of the buckets
 * before it. Returns how many, sorted; 0 when the row's total stays below the target. */
static int crossing_bucket(const float *s, const float *e, int v, double target, double *bins, Scored *members,
                           double *above) {
    int n = 0;
    *above = 0.0;
    if (v <= SAMPLE_SORT_MAX) { /* a narrow row: all of it is the "bucket" */
        for (int i = 0; i < v; i++) members[n++] = (Scored){s[i], e ? e[i] : 1.0f};
    } else {
        const int buckets = 1 << SAMPLE_BUCKET_BITS;
        memset(bins, 0, (size_t)buckets * sizeof(double));
        for (int i = 0; i < v; i++) bins[sample_bucket(s[i])] += e ? e[i] : 1.0;
        int b = 0;
        for (; b < buckets && *above + bins[b] < target; b++) *above += bins[b];
        if (b == buckets) return 0;
        for (int i = 0; i < v; i++)
            if (sample_bucket(s[i]) == b) members[n++] = (Scored){s[i], e ? e[i] : 1.0f};
    }
    qsort(members, (size_t)n, sizeof(Scored), by_score_descending);
    return n;
}

/* The k-th largest scaled logit (top_k keeps every token at least as large: ties stay): by a
 * heap for a few out of a wide row, else by the radix select. `heap`: room for k floats. */
static float kth_largest(const float *s, int v, int k, double *bins, Scored *members, float *heap) {
    if (v > SAMPLE_SORT_MAX && k <= SAMPLE_HEAP_MAX) return kth_by_heap(s, v, k, heap);
    double above;
    const int n = crossing_bucket(s, NULL, v, k, bins, members, &above);
    const int j = k - 1 - (int)above;
    return n ? members[j < n ? j : n - 1].s : -INFINITY;
}

/* The scaled logit at which a row's mass, largest first, reaches target (top_p times the row's
 * kept e): the crossing bucket's tokens walked in order. -inf: every token stays (rounding can
 * leave the row a hair short of the target). */
static float nucleus_cut(const float *s, const float *e, int v, double target, double *bins, Scored *members) {
    double run;
    const int n = crossing_bucket(s, e, v, target, bins, members, &run);
    if (!n) return -INFINITY;
    int j = 0;
    for (; j < n - 1 && run + members[j].e < target; j++) run += members[j].e;
    return members[j].s;
}

/* Zeroes e of the tokens scoring below `floor` (a filter's mask); returns the sum of the rest. */
static double keep_from(const float *s, float *e, int v, float floor) {
    double sum = 0.0;
    for (int i = 0; i < v; i++) {
        if (!(s[i] >= floor)) e[i] = 0.0f;
        sum += e[i];
    }
    return sum;
}

/* min_p: zeroes e of the tokens less likely than min_p times the likeliest; returns the sum.
 * The likeliest token survives top_k and top_p, and its e is exp(best - best), exactly 1. */
static double keep_likely(float *e, int v, double min_p) {
    const double floor = min_p;
    double sum = 0.0;
    for (int i = 0; i < v; i++) {
        if ((double)e[i] < floor) e[i] = 0.0f;
        sum += e[i];
    }
    return sum;
}

/* typical_p (HF's TypicalLogitsWarper; model/sampling.py typical_mask) over the tokens the filters
 * before it left (e > 0, summing to `sum`): each one's distance from the row's entropy,
 * |log p + H|, and the closest tokens kept until their mass reaches `mass` of the row's; tied
 * distances stay or go together. `best` is the row's largest scaled logit (e = exp(s - best));
 * `key`: room for n floats. Returns the sum of what stays. */
static double keep_typical(const float *s, float *e, int n, float best, double sum, double mass, float *key,
                           double *bins, Scored *members) {
    const double shift = (double)best + log(sum); /* log p = s - shift */
    double h = 0.0;
    for (int i = 0; i < n; i++)
        if (e[i] > 0.0f) h -= (double)e[i] / sum * ((double)s[i] - shift);
    /* Closest first is largest first for the radix select: the key is minus the distance;
     * tokens already dropped go last, with no mass. */
    for (int i = 0; i < n; i++) key[i] = e[i] > 0.0f ? (float)-fabs((double)s[i] - shift + h) : -INFINITY;
    const float cut = nucleus_cut(key, e, n, mass * sum, bins, members);
    return cut > -INFINITY ? keep_from(key, e, n, cut) : sum;
}

/* The first token (in vocabulary order) whose running mass passes u * kept; tokens a filter
 * dropped (e = 0) are never chosen. */
static int64_t draw(const float *e, int v, double kept, double u) {
    double x = u * kept;
    const double below = nextafter(kept, 0.0);
    x = x < below ? x : below;
    double run = 0.0;
    int64_t last = 0;
    for (int i = 0; i < v; i++) {
        if (!(e[i] > 0.0f)) continue;
        run += e[i];
        last = i;
        if (run > x) return i;
    }
    return last;
}

static void sample_thread(void *arg) {
    const SampleJob *job = arg;
    const Model *m = job->m;
    const int tid = job->serial ? 0 : m->thread_num(), nt = job->serial ? 1 : m->num_threads();
    const int v = job->vocab;
    char *mine = job->scratch + (size_t)tid * job->each;
    double *bins = (double *)mine;
    Scored *members = (Scored *)(bins + (1 << SAMPLE_BUCKET_BITS));
    float *all = (float *)(members + v), *e = all + v, *top = e + v;
    int *idx = (int *)(top + v);
    for (int r = tid; r < job->rows; r += nt) {
        const float t = job->temperature[r];
        if (t == 0.0f) { /* greedy: the first largest of the penalised logits (torch's max) */
            const float *z = penalised(job, r, job->logits + (size_t)r * v, v, all);
            int64_t best = 0;
            for (int i = 1; i < v; i++)
                if (z[i] > z[best]) best = i;
            job->out[r] = best;
            continue;
        }
        if (!(t > 0.0f)) continue;
        /* HF's order, as apply_filters: temperature, top_k, top_p, min_p, typical_p; each on what
         * the previous left. top_k first keeps its tokens (in vocabulary order, `idx`), so the
         * rest runs on those alone. */
        const float best = scale_max(m, penalised(job, r, job->logits + (size_t)r * v, v, all), v, t, all);
        const float *s = all;
        int n = v;
        const int64_t k = job->top_k[r];
        if (k > 0 && k < v) {
            n = keep_top(all, v, kth_largest(all, v, (int)k, bins, members, e), idx, top);
            s = top;
        }
        double sum = exp_sum(m, s, n, best, e);
        if (job->top_p[r] < 1.0) {
            const float cut = nucleus_cut(s, e, n, job->top_p[r] * sum, bins, members);
            if (cut > -INFINITY) sum = keep_from(s, e, n, cut);
        }
        if (job->min_p[r] > 0.0) sum = keep_likely(e, n, job->min_p[r]);
        if (job->typical_p[r] < 1.0) /* its keys go where the scores are not (top_k copied them) */
            sum = keep_typical(s, e, n, best, sum, job->typical_p[r], s == top ? all : top, bins, members);
        const int64_t j = draw(e, n, sum, job->uniform[r]);
        job->out[r] = s == top ? idx[j] : j;
    }
}

/* Scratch bytes per thread for rows of `vocab` logits. */
static size_t sample_scratch_each(int vocab) {
    const size_t bytes = ((size_t)1 << SAMPLE_BUCKET_BITS) * sizeof(double) +
                         (size_t)vocab * (sizeof(Scored) + 3 * sizeof(float) + sizeof(int));
    return (bytes + 63) & ~(size_t)63;
}
