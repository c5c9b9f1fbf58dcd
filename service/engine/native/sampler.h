/* Part of decode.c, which includes it once (see attention.h). Drawing each row's next token from
 * its logits in one call: temperature, top_p, then inverse-CDF sampling, the rule and the order of
 * model/sampling.py's whole-vocabulary path (sample_tokens with candidates off, top_p_mask,
 * sample_from_logits), for rows that use nothing else.
 *
 * Why here and not in torch: that path is some twenty torch operations over (rows, vocab), each
 * releasing the GIL and most allocating (rows, vocab) temporaries; at GPT-2's 50,257 tokens and 32
 * rows it took 13-18 ms of a 124M step of ~40 (AMD Zen 4, session 18), and at the shipped model's
 * 65 tokens the step's sampling was mostly GIL hand-offs to the event loop. Here a row is five
 * passes over its logits in the thread's cache, rows shared among the step's threads.
 *
 * What differs from torch: each token's exp is float32 (exp256, a few ulp from expf) where
 * top_p's mass is float64 there; sums are float64 either way. So a row's cut and draw agree with
 * the torch path unless its running mass, or its uniform number, falls within ~1e-6 of a
 * boundary (the tests check exactly that). */

#define SAMPLE_BUCKET_BITS 13 /* model/nucleus.py's BUCKET_BITS: 8,192 buckets in score order */
#define SAMPLE_SORT_MAX 1024  /* rows this narrow sort every token (clearing the buckets costs more) */

typedef struct {
    float s, e; /* a token's scaled logit and exp(s - max) */
} Scored;

typedef struct {
    const Model *m;
    const float *logits;
    int rows, vocab, serial;
    const float *temperature; /* per row; rows with 0 (greedy) are skipped */
    const double *top_p, *uniform;
    int64_t *out;
    char *scratch;
    size_t each; /* scratch bytes per thread */
} SampleJob;

/* The bucket of a scaled logit, largest scores first (see model/nucleus.py _bucket_of). */
static inline int sample_bucket(float s) {
    /* -0.0 + 0.0 is 0.0: the two zeros, equal as scores, share a bucket, so a cut at zero counts
     * the kept mass of both (ties always stay together). */
    const float canonical = s + 0.0f;
    int32_t bits;
    memcpy(&bits, &canonical, sizeof bits);
    const int32_t key = bits ^ (int32_t)((uint32_t)(bits >> 31) >> 1); /* signed, ordered as the scores */
    /* ~key reverses that order; flipping the sign bit makes it the unsigned order the shift keeps. */
    return (int)(((uint32_t)~key ^ 0x80000000u) >> (32 - SAMPLE_BUCKET_BITS));
}

static int by_score_descending(const void *a, const void *b) {
    const float x = ((const Scored *)a)->s, y = ((const Scored *)b)->s;
    return (x < y) - (x > y);
}

#ifdef NS_X86
/* scale_and_exp eight at a time: the same divisions and maximum; e by exp256. Returns how many
 * elements it did (the rest, fewer than eight, are the caller's). */
__attribute__((target("avx2,fma"))) static int exp_rows_avx2(const float *z, int v, float t, float *s, float *e,
                                                             double *sum) {
    const int n = v & ~7;
    if (!n) return 0;
    const __m256 vt = _mm256_set1_ps(t);
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_div_ps(_mm256_loadu_ps(z + i), vt);
        _mm256_storeu_ps(s + i, x);
        best8 = _mm256_max_ps(x, best8);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, best8);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    for (int i = n; i < v; i++) {
        s[i] = z[i] / t;
        best = s[i] > best ? s[i] : best;
    }
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
    double total = (parts[0] + parts[1]) + (parts[2] + parts[3]);
    for (int i = n; i < v; i++) {
        e[i] = expf(s[i] - best);
        total += e[i];
    }
    *sum = total;
    return v;
}
#endif

/* s = logits / t and e = exp(s - max s) for one row; returns the sum of e (float64). */
static double scale_and_exp(const Model *m, const float *z, int v, float t, float *s, float *e) {
    double sum = 0.0;
#ifdef NS_X86
    if (m->avx2 && exp_rows_avx2(z, v, t, s, e, &sum)) return sum;
#else
    (void)m;
#endif
    float best = -INFINITY;
    for (int i = 0; i < v; i++) {
        s[i] = z[i] / t;
        best = s[i] > best ? s[i] : best;
    }
    for (int i = 0; i < v; i++) {
        e[i] = expf(s[i] - best);
        sum += e[i];
    }
    return sum;
}

/* The scaled logit at which a row's mass, largest first, reaches target (top_p times the row's
 * sum of e): buckets' masses, then the crossing bucket's tokens sorted. -inf: every token stays
 * (top_p 1, or rounding leaves the row short of the target). *kept: the mass of the kept tokens. */
static float nucleus_cut(const float *s, const float *e, int v, double target, double sum, double *bins, Scored *members,
                         double *kept) {
    *kept = sum;
    double above = 0.0;
    int n = 0;
    if (v <= SAMPLE_SORT_MAX) { /* a narrow row: all of it is the "bucket" */
        for (int i = 0; i < v; i++) members[n++] = (Scored){s[i], e[i]};
    } else {
        const int buckets = 1 << SAMPLE_BUCKET_BITS;
        memset(bins, 0, (size_t)buckets * sizeof(double));
        for (int i = 0; i < v; i++) bins[sample_bucket(s[i])] += e[i];
        int b = 0;
        for (; b < buckets && above + bins[b] < target; b++) above += bins[b];
        if (b == buckets) return -INFINITY;
        for (int i = 0; i < v; i++)
            if (sample_bucket(s[i]) == b) members[n++] = (Scored){s[i], e[i]};
    }
    if (!n) return -INFINITY; /* (only a target of 0 or less could pick an empty bucket) */
    qsort(members, (size_t)n, sizeof(Scored), by_score_descending);
    double run = above;
    int j = 0;
    for (; j < n - 1 && run + members[j].e < target; j++) run += members[j].e;
    const float cut = members[j].s;
    /* The kept mass: everything above the bucket, and its members at or above the cut (ties). */
    double in = 0.0;
    for (int k = 0; k < n && members[k].s >= cut; k++) in += members[k].e;
    *kept = above + in;
    return cut;
}

/* The first token (in vocabulary order) whose running kept mass passes u * kept. */
static int64_t draw(const float *s, const float *e, int v, float cut, double kept, double u) {
    double x = u * kept;
    const double below = nextafter(kept, 0.0);
    x = x < below ? x : below;
    double run = 0.0;
    int64_t last = 0;
    for (int i = 0; i < v; i++) {
        if (!(s[i] >= cut)) continue;
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
    float *s = (float *)(members + v), *e = s + v;
    for (int r = tid; r < job->rows; r += nt) {
        const float t = job->temperature[r];
        if (!(t > 0.0f)) continue;
        const double sum = scale_and_exp(m, job->logits + (size_t)r * v, v, t, s, e);
        double kept = sum;
        float cut = -INFINITY;
        if (job->top_p[r] < 1.0) cut = nucleus_cut(s, e, v, job->top_p[r] * sum, sum, bins, members, &kept);
        job->out[r] = draw(s, e, v, cut, kept, job->uniform[r]);
    }
}

/* Scratch bytes per thread for rows of `vocab` logits. */
static size_t sample_scratch_each(int vocab) {
    const size_t bytes = ((size_t)1 << SAMPLE_BUCKET_BITS) * sizeof(double) + (size_t)vocab * (sizeof(Scored) + 2 * sizeof(float));
    return (bytes + 63) & ~(size_t)63;
}
