/* One decode step of a GPT-2 decoder for a few rows, float32 on CPU, in one call.
 *
 * Why this exists (measured on the 2-core AVX2 EPYC, see docs/engine.md): at batch 1 a decode step
 * streams every weight once, so it is bound by memory bandwidth, yet through torch it ran at 5-7
 * GB/s against ~15 GB/s a plain two-thread read reaches: ~25 library calls per step, each its own
 * parallel region, each handing its weight to the threads in its own way, plus the ops between
 * them. Here the whole step is one OpenMP parallel region, each thread streams its own contiguous
 * slice of every weight, and the threads meet at a barrier only where the next phase reads what
 * another thread wrote.
 *
 * Threads: the region runs on the calling thread's OpenMP team through libgomp's own entry points
 * (GOMP_parallel, GOMP_barrier), handed in by the caller from the libgomp torch already loaded. So
 * the step reuses the pool torch's kernels use (its workers already spinning between steps) and
 * never starts a second one: two pools on two cores made every region pay futex wake-ups.
 *
 * Nothing here links a Python or torch header: the caller passes raw pointers to tensors it keeps
 * alive (weights in nn.Linear's (out, in) layout, the KV cache's (slots, heads, window, head_dim)
 * buffers), and the library is loaded with ctypes, which releases the GIL for the call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NS_X86 1
#endif

typedef void (*parallel_fn)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
typedef void (*barrier_fn)(void);
typedef int (*int_fn)(void);

typedef struct {
    const float *w, *b; /* w: (out, in) row-major; b: (out,) or NULL */
    int out, in;
} Linear;

typedef struct {
    const float *w, *b; /* (C,) each; b may be NULL */
} Norm;

typedef struct {
    Norm ln1, ln2;
    Linear attn, proj, fc, mproj;
    float *k, *v; /* (slots, n_head, window, head_dim) */
} Layer;

typedef struct {
    int n_layer, n_head, head_dim, n_embd, vocab, slots, window, max_rows, max_threads;
    float eps;
    const float *wte, *wpe;
    Layer *layers;
    Norm lnf;
    Linear head;
    int avx2;
    /* Shared activations, (max_rows, width) each; h is per thread (max_threads, max_rows, C):
     * every thread normalises the whole residual itself instead of waiting at a barrier. */
    float *x, *qkv, *y, *f, *h, *att;
    parallel_fn parallel;
    barrier_fn barrier;
    int_fn thread_num, num_threads;
} Model;

typedef struct {
    Model *m;
    int rows, serial; /* serial: no OpenMP entry points, the caller's thread does it all */
    const int64_t *tok, *pos, *slot;
    float *logits; /* (rows, vocab) */
} Job;

/* ---------------------------------------------------------------- small row kernels */

static void layer_norm(const float *x, float *out, int c, Norm n, float eps) {
    double mean = 0, var = 0;
    for (int i = 0; i < c; i++) mean += x[i];
    mean /= c;
    for (int i = 0; i < c; i++) {
        double d = x[i] - mean;
        var += d * d;
    }
    float rstd = (float)(1.0 / sqrt(var / c + eps));
    float mu = (float)mean;
    for (int i = 0; i < c; i++) {
        float v = (x[i] - mu) * rstd * n.w[i];
        out[i] = n.b ? v + n.b[i] : v;
    }
}

/* GELU, tanh form (GPT-2's "gelu_new"), as x * sigmoid(2 z): the same function. */
static void gelu(float *x, int n) {
    const float k = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
    for (int i = 0; i < n; i++) {
        float v = x[i];
        float z = k * (v + 0.044715f * v * v * v);
        x[i] = v / (1.0f + expf(-z));
    }
}

/* ---------------------------------------------------------------- matrix-vector products */

/* y[r][o] (+)= W[o] . x[r] + b[o] for o in [o0, o1), r < rows. x rows are `in` apart, y rows
 * `ystride` apart. Weight rows go four at a time so each is read once for all rows. */
static void gemv_scalar(const Linear *l, const float *x, int rows, float *y, int ystride, int o0, int o1,
                        int accumulate) {
    for (int o = o0; o < o1; o++) {
        const float *w = l->w + (size_t)o * l->in;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * l->in;
            float s = 0;
            for (int i = 0; i < l->in; i++) s += w[i] * xr[i];
            if (l->b) s += l->b[o];
            float *dst = y + (size_t)r * ystride + o;
            *dst = accumulate ? *dst + s : s;
        }
    }
}

#ifdef NS_X86
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The kernels below sum each dot product in the same order (eight lanes, lane sums, then the tail
 * in sequence), so a row's result never depends on how many rows share the step. */
__attribute__((target("avx2,fma"))) static inline float finish(__m256 acc, const float *w, const float *x,
                                                               int from, int in) {
    float s = hsum256(acc);
    for (int i = from; i < in; i++) s += w[i] * x[i];
    return s;
}

/* Four weight rows against one input row: four independent sums, the weights streamed once. */
__attribute__((target("avx2,fma"))) static inline void dot4x1(const float *w, int in, const float *xr,
                                                              float s[4]) {
    const float *w0 = w, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    const int vec_end = in & ~7;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < vec_end; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), v, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), v, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), v, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), v, a3);
    }
    s[0] = finish(a0, w0, xr, vec_end, in);
    s[1] = finish(a1, w1, xr, vec_end, in);
    s[2] = finish(a2, w2, xr, vec_end, in);
    s[3] = finish(a3, w3, xr, vec_end, in);
}

/* Four weight rows against three input rows: twelve sums in registers, so each load of a weight
 * or input vector feeds three or four multiply-adds (one row at a time is load-bound). */
__attribute__((target("avx2,fma"))) static inline void dot4x3(const float *w, int in, const float *x,
                                                              float s[3][4]) {
    const float *w0 = w, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    const float *x0 = x, *x1 = x0 + in, *x2 = x1 + in;
    const int vec_end = in & ~7;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
           a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int i = 0; i < vec_end; i += 8) {
        __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i), v2 = _mm256_loadu_ps(x2 + i), wv;
        wv = _mm256_loadu_ps(w0 + i);
        a00 = _mm256_fmadd_ps(wv, v0, a00), a10 = _mm256_fmadd_ps(wv, v1, a10), a20 = _mm256_fmadd_ps(wv, v2, a20);
        wv = _mm256_loadu_ps(w1 + i);
        a01 = _mm256_fmadd_ps(wv, v0, a01), a11 = _mm256_fmadd_ps(wv, v1, a11), a21 = _mm256_fmadd_ps(wv, v2, a21);
        wv = _mm256_loadu_ps(w2 + i);
        a02 = _mm256_fmadd_ps(wv, v0, a02), a12 = _mm256_fmadd_ps(wv, v1, a12), a22 = _mm256_fmadd_ps(wv, v2, a22);
        wv = _mm256_loadu_ps(w3 + i);
        a03 = _mm256_fmadd_ps(wv, v0, a03), a13 = _mm256_fmadd_ps(wv, v1, a13), a23 = _mm256_fmadd_ps(wv, v2, a23);
    }
    __m256 acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
    const float *xs[3] = {x0, x1, x2}, *ws[4] = {w0, w1, w2, w3};
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++) s[r][j] = finish(acc[r][j], ws[j], xs[r], vec_end, in);
}

static inline void store4(const Linear *l, float *dst, int o, const float s[4], int accumulate) {
    for (int j = 0; j < 4; j++) {
        float v = s[j] + (l->b ? l->b[o + j] : 0.0f);
        dst[j] = accumulate ? dst[j] + v : v;
    }
}

__attribute__((target("avx2,fma"))) static void gemv_avx2(const Linear *l, const float *x, int rows, float *y,
                                                          int ystride, int o0, int o1, int accumulate) {
    const int in = l->in;
    int o = o0;
    for (; o + 4 <= o1; o += 4) {
        const float *w = l->w + (size_t)o * in;
        int r = 0;
        for (; r + 3 <= rows; r += 3) {
            float s[3][4];
            dot4x3(w, in, x + (size_t)r * in, s);
            for (int k = 0; k < 3; k++) store4(l, y + (size_t)(r + k) * ystride + o, o, s[k], accumulate);
        }
        for (; r < rows; r++) {
            float s[4];
            dot4x1(w, in, x + (size_t)r * in, s);
            store4(l, y + (size_t)r * ystride + o, o, s, accumulate);
        }
    }
    if (o < o1) gemv_scalar(l, x, rows, y, ystride, o, o1, accumulate);
}
#endif

static void gemv(const Model *m, const Linear *l, const float *x, int rows, float *y, int ystride, int o0, int o1,
                 int accumulate) {
#ifdef NS_X86
    if (m->avx2) {
        gemv_avx2(l, x, rows, y, ystride, o0, o1, accumulate);
        return;
    }
#endif
    (void)m;
    gemv_scalar(l, x, rows, y, ystride, o0, o1, accumulate);
}

/* This thread's share of `n` output rows, in whole blocks of 8 (the tail goes to the last one). */
static void share(int n, int tid, int nt, int *lo, int *hi) {
    int blocks = (n + 7) / 8;
    int b0 = (int)((long)blocks * tid / nt), b1 = (int)((long)blocks * (tid + 1) / nt);
    *lo = b0 * 8 < n ? b0 * 8 : n;
    *hi = b1 * 8 < n ? b1 * 8 : n;
}

/* ---------------------------------------------------------------- attention */

static float dot_scalar(const float *a, const float *b, int n) {
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_scalar(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

#ifdef NS_X86
__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum256(_mm256_add_ps(s0, s1));
    return s + dot_scalar(a + i, b + i, n - i);
}

__attribute__((target("avx2,fma"))) static void axpy_avx2(float *y, float a, const float *x, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    axpy_scalar(y + i, a, x + i, n - i);
}
#endif

static float dot(const Model *m, const float *a, const float *b, int n) {
#ifdef NS_X86
    if (m->avx2) return dot_avx2(a, b, n);
#endif
    (void)m;
    return dot_scalar(a, b, n);
}

static void axpy(const Model *m, float *y, float a, const float *x, int n) {
#ifdef NS_X86
    if (m->avx2) {
        axpy_avx2(y, a, x, n);
        return;
    }
#endif
    (void)m;
    axpy_scalar(y, a, x, n);
}

/* Write row r's new key and value for head hd at its position, then attend over positions 0..pos
 * (softmax in float32, as torch's kernels do for float32). */
static void attend(const Model *m, const Layer *L, const Job *job, int r, int hd, float *scores) {
    const int c = m->n_embd, hs = m->head_dim;
    const int64_t pos = job->pos[r];
    const size_t base = (((size_t)job->slot[r] * m->n_head + hd) * m->window) * hs;
    const float *qkv = m->qkv + (size_t)r * 3 * c;
    const float *q = qkv + hd * hs;
    float *k = L->k + base, *v = L->v + base;
    memcpy(k + pos * hs, qkv + c + hd * hs, hs * sizeof(float));
    memcpy(v + pos * hs, qkv + 2 * c + hd * hs, hs * sizeof(float));
    const float scale = 1.0f / sqrtf((float)hs);
    float best = -INFINITY;
    for (int64_t t = 0; t <= pos; t++) {
        scores[t] = dot(m, q, k + t * hs, hs) * scale;
        if (scores[t] > best) best = scores[t];
    }
    float total = 0;
    for (int64_t t = 0; t <= pos; t++) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    float *out = m->y + (size_t)r * c + hd * hs;
    memset(out, 0, hs * sizeof(float));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t <= pos; t++) axpy(m, out, scores[t] * inv, v + t * hs, hs);
}

/* ---------------------------------------------------------------- the step, per thread */

static inline void sync(const Job *job) {
    if (!job->serial) job->m->barrier();
}

static void step_thread(void *arg) {
    const Job *job = arg;
    const Model *m = job->m;
    const int tid = job->serial ? 0 : m->thread_num(), nt = job->serial ? 1 : m->num_threads();
    const int rows = job->rows, c = m->n_embd;
    float *h = m->h + (size_t)tid * m->max_rows * c;
    float *scores = m->att + (size_t)tid * m->window;
    int lo, hi;

    for (int r = tid; r < rows; r += nt) {
        const float *te = m->wte + (size_t)job->tok[r] * c, *pe = m->wpe + (size_t)job->pos[r] * c;
        for (int i = 0; i < c; i++) m->x[(size_t)r * c + i] = te[i] + pe[i];
    }
    sync(job);
    for (int li = 0; li < m->n_layer; li++) {
        const Layer *L = &m->layers[li];
        for (int r = 0; r < rows; r++) layer_norm(m->x + (size_t)r * c, h + (size_t)r * c, c, L->ln1, m->eps);
        share(3 * c, tid, nt, &lo, &hi);
        gemv(m, &L->attn, h, rows, m->qkv, 3 * c, lo, hi, 0);
        sync(job);
        for (int p = tid; p < rows * m->n_head; p += nt) attend(m, L, job, p / m->n_head, p % m->n_head, scores);
        sync(job);
        share(c, tid, nt, &lo, &hi);
        gemv(m, &L->proj, m->y, rows, m->x, c, lo, hi, 1);
        sync(job);
        for (int r = 0; r < rows; r++) layer_norm(m->x + (size_t)r * c, h + (size_t)r * c, c, L->ln2, m->eps);
        share(4 * c, tid, nt, &lo, &hi);
        gemv(m, &L->fc, h, rows, m->f, 4 * c, lo, hi, 0);
        for (int r = 0; r < rows; r++) gelu(m->f + (size_t)r * 4 * c + lo, hi - lo);
        sync(job);
        share(c, tid, nt, &lo, &hi);
        gemv(m, &L->mproj, m->f, rows, m->x, c, lo, hi, 1);
        sync(job);
    }
    for (int r = 0; r < rows; r++) layer_norm(m->x + (size_t)r * c, h + (size_t)r * c, c, m->lnf, m->eps);
    share(m->vocab, tid, nt, &lo, &hi);
    gemv(m, &m->head, h, rows, job->logits, m->vocab, lo, hi, 0);
}

/* ---------------------------------------------------------------- the interface */

static Linear linear(const float *const **p, int out, int in) {
    Linear l = {(*p)[0], (*p)[1], out, in};
    *p += 2;
    return l;
}

static Norm norm(const float *const **p) {
    Norm n = {(*p)[0], (*p)[1]};
    *p += 2;
    return n;
}

/* ptrs: wte, wpe; per layer ln1.w, ln1.b, attn.w, attn.b, proj.w, proj.b, ln2.w, ln2.b, fc.w,
 * fc.b, mproj.w, mproj.b, k, v; then lnf.w, lnf.b, head.w, head.b. Biases may be NULL.
 * omp: GOMP_parallel, GOMP_barrier, omp_get_thread_num, omp_get_num_threads, or NULL (one thread). */
void *ns_create(int n_layer, int n_head, int n_embd, int vocab, int slots, int window, int max_rows,
                int max_threads, float eps, const float *const *ptrs, void *const *omp) {
    Model *m = calloc(1, sizeof(Model));
    if (!m) return NULL;
    const int c = n_embd;
    *m = (Model){.n_layer = n_layer, .n_head = n_head, .head_dim = n_embd / n_head, .n_embd = c,
                 .vocab = vocab, .slots = slots, .window = window, .max_rows = max_rows,
                 .max_threads = max_threads, .eps = eps};
    if (omp) {
        m->parallel = (parallel_fn)omp[0];
        m->barrier = (barrier_fn)omp[1];
        m->thread_num = (int_fn)omp[2];
        m->num_threads = (int_fn)omp[3];
    }
#ifdef NS_X86
    m->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    const float *const *p = ptrs;
    m->wte = *p++;
    m->wpe = *p++;
    m->layers = calloc(n_layer, sizeof(Layer));
    size_t r = max_rows;
    m->x = calloc(r * c, sizeof(float));
    m->qkv = calloc(r * 3 * c, sizeof(float));
    m->y = calloc(r * c, sizeof(float));
    m->f = calloc(r * 4 * c, sizeof(float));
    m->h = calloc((size_t)max_threads * r * c, sizeof(float));
    m->att = calloc((size_t)max_threads * window, sizeof(float));
    if (!m->layers || !m->x || !m->qkv || !m->y || !m->f || !m->h || !m->att) {
        free(m->layers), free(m->x), free(m->qkv), free(m->y), free(m->f), free(m->h), free(m->att), free(m);
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
        L->k = (float *)*p++;
        L->v = (float *)*p++;
    }
    m->lnf = norm(&p);
    m->head = linear(&p, vocab, c);
    return m;
}

/* One decode step for `rows` rows (<= max_rows) on `threads` threads (<= max_threads). */
void ns_step(void *model, int rows, const int64_t *tok, const int64_t *pos, const int64_t *slot, float *logits,
             int threads) {
    Model *m = model;
    Job job = {m, rows, !m->parallel || threads <= 1, tok, pos, slot, logits};
    if (job.serial)
        step_thread(&job);
    else
        m->parallel(step_thread, &job, (unsigned)threads, 0);
}

void ns_free(void *model) {
    Model *m = model;
    if (!m) return;
    free(m->layers), free(m->x), free(m->qkv), free(m->y), free(m->f), free(m->h), free(m->att), free(m);
}
