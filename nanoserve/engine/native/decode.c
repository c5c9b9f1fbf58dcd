/* One forward step of a decoder of the GPT-2 or the Llama family over token rows on CPU, in one
 * call: decode rows and prompt chunks (nanoserve/engine/native_step.py). Weights and KV cache in
 * float32 or bfloat16; sums in float32 (a bfloat16 model's linear inputs rounded to bf16 on the
 * tile levels, see ns_set_isa).
 *
 * Why this exists (docs/architecture.md, docs/performance.md): at batch 1 a decode step
 * streams every weight once, so it is bound by memory bandwidth, yet through torch it ran at 5-7
 * GB/s against 25-30 GB/s a plain two-thread read reaches: ~25 library calls per step, each its own
 * parallel region, each handing its weight to the threads in its own way, plus the ops between
 * them. Here the whole step is one OpenMP parallel region, each thread streams long contiguous
 * chunks of every weight (claimed, see claim), and the threads meet at a
 * barrier only where the next phase reads what another thread wrote.
 *
 * Threads: the region runs on the calling thread's OpenMP team through libgomp's own entry point
 * (GOMP_parallel), handed in by the caller from the libgomp torch already loaded. So the step
 * reuses the pool torch's kernels use (its workers already spinning between steps) and never
 * starts a second one: two pools on two cores made every region pay futex wake-ups. Within the
 * region the threads meet at the library's own barrier (barrier.inc), which sleeps where
 * libgomp's would spin for a thread that has lost its core.
 *
 * Nothing here links a Python or torch header: the caller passes raw pointers to tensors it keeps
 * alive (linear weights packed in panels, see gemv; the KV cache's (slots, heads, window, head_dim)
 * buffers), and the library is loaded with ctypes, which releases the GIL for the call.
 *
 * The parts: this file includes row_kernels.inc, matmul.inc, matmul_int8.inc, tiles.inc,
 * attention.inc, sampler.inc and barrier.inc, once each, in that order. They are fragments of this
 * translation unit, not headers (no guards, no interface of their own: nanoserve_native.h is the
 * library's interface), and stay one unit on purpose: their kernels are static functions the
 * compiler inlines into the per-thread step loop below, and they share this file's Model, Job and
 * helpers. As separate units each call between them would be a real call on the hot path (or need
 * link-time optimisation), and their private types would become a second, internal header.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (barrier.inc) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#else
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NS_X86 1
#endif
long syscall(long number, ...); /* <unistd.h> also declares a sync(), which this file defines */

#include "nanoserve_native.h"

typedef void (*parallel_fn)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
typedef int (*int_fn)(void);

/* The step's barrier (barrier.inc), its counters on cache lines of their own. */
typedef struct {
    char before[64];
    int count;    /* threads arrived at the current barrier */
    unsigned gen; /* barriers passed: a waiting thread waits for it to move */
    int sleepers; /* threads asleep on gen */
    int spin_ns;  /* how long a waiting thread spins before it sleeps */
    char after[64];
} Barrier;

/* Element types of weights and of the KV cache: float32, or bfloat16 (the upper half of a float32;
 * computed in float32 all the same, see to_float). */
enum { F32 = NS_F32, BF16 = NS_BF16 };

/* Kernel levels (ns_set_isa). The two tile levels read the bf16 tile copy and round inputs. */
enum {
    ISA_C = NS_ISA_C,
    ISA_AVX2 = NS_ISA_AVX2,
    ISA_AVX512 = NS_ISA_AVX512,
    ISA_AVX512BF16 = NS_ISA_AVX512BF16,
    ISA_AMX = NS_ISA_AMX
};

typedef struct {
    const void *w; /* (out, in) packed in panels of the model's weight type, see gemv */
    const float *b; /* (out,) or NULL */
    int out, in;
    uint16_t *tiles; /* bfloat16 weights in input pairs, for AMX and AVX512-BF16 (amx_tiles), or NULL */
    /* int8 weights (NS_I8): the scales per output (padded to whole panels by i8_prepare) and each
     * output's weight sum, made with the padded scales (matmul_int8.inc); NULL otherwise */
    const float *i8scale;
    int32_t *i8sum;
} Linear;

typedef struct {
    const float *w, *b; /* (C,) each; b may be NULL */
} Norm;

typedef struct {
    Norm ln1, ln2;
    Linear attn, proj, fc, mproj;
    void *k, *v; /* (slots, n_kv, window, head_dim), of type kvt */
} Layer;

/* The MLP's activation after fc (gemv_claimed's `act`): none (other layers), GELU, or SwiGLU. */
enum { ACT_NONE = 0, ACT_GELU = 1, ACT_SWIGLU = 2 };

/* The public header's opaque ns_model. */
typedef struct ns_model {
    int n_layer, n_head, head_dim, n_embd, vocab, slots, window, max_rows, max_threads;
    int n_kv, group;  /* key/value heads, and query heads per key/value head (grouped-query attention) */
    int qkv_w;        /* attn's outputs: n_embd queries, then n_kv head_dim keys and as many values */
    int hidden, fc_w; /* the MLP's width, and fc's outputs (hidden; SwiGLU: gate and up, panel-padded) */
    int rms, act;     /* RMSNorm (else LayerNorm); the MLP's ACT_GELU or ACT_SWIGLU */
    float *rope_cos, *rope_sin; /* rotary positions: (window, head_dim / 2) each, else NULL */
    float eps;
    int wt, kvt; /* element types of the weights (linear, embeddings) and of the KV cache */
    const void *wte, *wpe;
    Layer *layers;
    Norm lnf;
    Linear head;
    int avx2;   /* AVX2 + FMA kernels (every x86-64 CPU of the last decade) */
    int avx512; /* AVX-512 matrix kernels (where the CPU has AVX-512F); see gemv512 */
    int tiles;  /* bfloat16 weights: the tile level in use (ISA_AVX512BF16, see gemv_dp, or ISA_AMX, see
                 * gemv_amx; bf16-rounded inputs), or 0: the widening kernels */
    int tiles_only; /* the panels are gone (ns_tiles_only): only the levels that read tiles run */
    int i8amx;      /* int8 weights on AMX-INT8 tiles (gemv_amx_i8), VNNI's kernels for few rows */
    uint8_t *xq; /* int8 linears: per thread, inputs quantized (xq_each bytes), and their row scales */
    float *xqs;
    uint16_t *xb; /* per thread, (round32(2 max_threads), round32(4 C)): few rows' inputs in bf16 */
    /* On the tile levels, the inputs of the linear layers in bf16, (round32(max_rows), width
     * rounded up to 32) each, rounded where they are computed (see round_shared): hn's, y's, f's */
    uint16_t *hb, *yb, *fb;
    /* Shared activations, (max_rows, width) each; h is per thread (max_threads, 2 max_threads, C),
     * for steps of few rows, where every thread normalises the whole residual itself instead of
     * waiting at a barrier; hn holds the normalised rows of larger steps (see normalise). */
    float *x, *qkv, *y, *f, *h, *hn, *att; /* att: per thread, ATT_ROWS rows of `window` scores */
    float *g; /* SwiGLU: silu(gate) * up, (max_rows, hidden), mproj's input (GELU's is f itself) */
    int *block; /* per row of a step: how many rows its attention block holds (0: another row's
                 * block holds it; see attention_blocks) */
    int *next; /* per phase and thread's part of a step, chunks claimed so far (see claim) */
    unsigned char *seen; /* per slot, zero between steps (see own_slots) */
    char *smp;           /* sampler.inc's scratch, per thread, grown to the widest rows asked for */
    /* The screened output layer (head_screen.inc; ns_screen_head), a float32 model's: on or off, the
     * caller's row-major weights, per output the norm of its weights and an absolute slack, the
     * error bound's coefficient, the logits that may be screened in, and per thread a row of lower
     * bounds, a heap, the candidates and the bf16 rows. */
    int screen;
    const float *srow;
    float *snorm, *sslack;
    double scoef;
    int susable;
    float *slow, *sheap;
    int *scand;
    uint16_t *sxb;
    size_t smp_bytes;
    parallel_fn parallel;
    Barrier bar;
    int_fn thread_num, num_threads;
} Model;

#define PHASES(n_layer) ((n_layer) * 5 + 1) /* per layer qkv, attention, proj, fc, mproj; the head */

typedef struct {
    Model *m;
    int rows, serial; /* serial: no OpenMP entry points, the caller's thread does it all */
    const int64_t *tok, *pos, *slot;
    int own_slots; /* every row in a slot no other row uses (a decode step): see step_thread */
    const int64_t *out; /* the rows whose logits are wanted, n_out of them */
    int n_out;
    float *logits; /* (n_out, vocab) */
    const int32_t *screen; /* each logit row's k, where the output layer is screened; else NULL */
} Job;

/* ---------------------------------------------------------------- bfloat16

 * Up to the AVX-512 level bfloat16 is stored, never computed: weights and cached keys/values are
 * widened to float32 as they are loaded (a 16-bit shift) and every sum runs in float32. On CPUs
 * without bf16 arithmetic (AVX2-only: torch's bf16 matmuls run ~100x slower than float32 there)
 * that is how bf16 can be fast: a batch-1 step reads half the bytes, and no arithmetic is
 * emulated. The tile levels (AVX512-BF16, AMX) multiply bf16 directly: a linear layer's inputs
 * are rounded to bf16, products are exact in float32 and sums stay float32 (see gemv_dp). */

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

#include "row_kernels.inc"

/* Ask for the cache line at p. An asm statement, not __builtin_prefetch: GCC 12 at -O2 and above
 * dropped every __builtin_prefetch of the attention's prefetches once inlined into the step (the
 * object code had none; found when an A/B of it showed no change at all). */
static inline void prefetch_into(const void *p, int l1) {
#ifdef NS_X86
    if (l1)
        __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
    else
        __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
#else
    if (l1)
        __builtin_prefetch(p, 0, 3);
    else
        __builtin_prefetch(p, 0, 2);
#endif
}
static inline void prefetch_line(const void *p) { prefetch_into(p, 1); }
/* Into L2 only (ahead_of in attention.inc: see there why not into L1). */
static inline void prefetch_line_l2(const void *p) { prefetch_into(p, 0); }

#include "matmul.inc"

#include "matmul_int8.inc"

#include "tiles.inc"

/* Work is claimed, not dealt: each thread takes the next `chunk` items of a phase from a shared
 * counter until none are left. On a machine whose cores also run other things (the server's event
 * loop, its clients, other tenants) a thread can lose its core for a while; with a fixed split the
 * other thread then waits at the next barrier for its whole share, and with a claimed one it does
 * the rest instead. (Measured before: another process busy 15% of one core cost the engine 39% of
 * its throughput.) Which thread computes an output never changes its value: each is summed by one
 * thread, in the same order.
 *
 * A phase's chunks are cut into one part per thread, each with its own counter on its own cache
 * line: a thread claims from its own part first and then from the others' in turn. Undisturbed,
 * thread t so computes the same outputs at every step and in every layer (its part of x, the
 * residual that proj and mproj add into, stays in its own core's cache, where one shared counter
 * dealt the columns out anew each phase and about half of them had last been written on the other
 * core); a thread that falls behind still has its part finished by the others. */
#define CLAIM_PAD 16 /* ints between counters: one cache line each */

typedef struct {
    int phase, chunk, chunks, part, tid, nt;
} Claims;

static Claims claims(int phase, int items, int chunk, int tid, int nt) {
    return (Claims){phase, chunk, (items + chunk - 1) / chunk, 0, tid, nt};
}

static int *claim_counter(const Job *job, int phase, int part) {
    return &job->m->next[((size_t)phase * job->m->max_threads + part) * CLAIM_PAD];
}

/* The first item of the next claimed chunk, or -1 once every part is done. */
static int claim(const Job *job, Claims *c) {
    for (; c->part < c->nt; c->part++) {
        const int h = (c->tid + c->part) % c->nt;
        const int first = (int)((int64_t)c->chunks * h / c->nt), end = (int)((int64_t)c->chunks * (h + 1) / c->nt);
        const int k = first + __atomic_fetch_add(claim_counter(job, c->phase, h), 1, __ATOMIC_RELAXED);
        if (k < end) return k * c->chunk;
    }
    return -1;
}

/* Items per claim: about CLAIMS claims per thread, so a late thread's work is spread finely
 * while a chunk of weights stays one long contiguous stream; SMALL_CLAIMS for steps of up to
 * SMALL_STEP rows, whose phases are short: a thread that runs out of work waits at the phase's
 * barrier for about half a chunk of the other's, which at eight claims was some 3% of a 32-row
 * decode step. (124M, A/B in one process: float32 32 rows 1.02x, 8 rows 1.02x, one row 1.06x; bf16
 * 32 rows 1.02x, one row unchanged; an 800-row prefill was 1.02x slower at 64 claims, 1.01x at 32.) */
#define CLAIMS 8
#define SMALL_CLAIMS 64
#define SMALL_STEP 64
static int chunk_of(int items, int rows, int nt) {
    const int chunk = items / ((rows <= SMALL_STEP ? SMALL_CLAIMS : CLAIMS) * nt);
    return chunk > 0 ? chunk : 1;
}

/* On the tile levels, the linear layers read their inputs in bf16. Inputs that several threads
 * compute (the normalised rows of larger steps, attention's outputs, GELU's) are rounded by the
 * thread that computes each piece, while it is in its cache, into one shared copy (hb, yb, fb),
 * which every thread reads after the barrier that already follows; the rows each thread
 * normalises for itself (few rows) it rounds for itself (gemv_claimed). Each value is rounded
 * once, not once per thread: rounding every input on every thread, reading the other thread's
 * float32 results, was ~3% of a 10.7M bf16 step of 32 rows. Row r of a shared copy
 * of width w: ROUND32(w) elements from r * ROUND32(w), the rest zero (never written). */
static void round_shared(const Model *m, const float *src, int n, uint16_t *shared, int width, int r, int col) {
#ifdef NS_X86
    if (m->tiles) round_into(src, n, shared + (size_t)r * ROUND32(width) + col);
#else
    (void)m, (void)src, (void)n, (void)shared, (void)width, (void)r, (void)col;
#endif
}

/* SwiGLU over fc's outputs [o0, o1) of `rows` rows, whole panel pairs (gate, then up: ns_layer):
 * pair o gives features o / 2.. of m->g, rounded into gb (round_shared) if given. */
static void swiglu_rows(const Model *m, const float *y, int ystride, int rows, int o0, int o1, uint16_t *gb) {
    for (int r = 0; r < rows; r++)
        for (int o = o0; o < o1; o += 2 * PANEL) {
            const int f = o / 2, n = m->hidden - f < PANEL ? m->hidden - f : PANEL;
            const float *gate = y + (size_t)r * ystride + o;
            float *out = m->g + (size_t)r * m->hidden + f;
            swiglu(m, gate, gate + PANEL, out, n);
            if (gb) round_shared(m, out, n, gb, m->hidden, r, f);
        }
}

/* y (+)= x W^T + b for all of the layer's outputs, panels claimed in chunks; with `act`, the MLP's
 * activation on each chunk's outputs once they are done (GELU in place, SwiGLU into m->g), and
 * those rounded into yb (round_shared) if given. xs: x already rounded to bf16 (a shared copy), or
 * NULL. */
static void gemv_claimed(const Job *job, int phase, const Linear *l, const float *x, const uint16_t *xs, int rows,
                         float *y, int ystride, int accumulate, int act, uint16_t *yb, int tid, int nt) {
    const Model *m = job->m;
    const int panels = (l->out + PANEL - 1) / PANEL;
    int chunk = chunk_of(panels, rows, nt);
    /* AVX-512's kernels (and the tile levels') take panels in pairs, and so does SwiGLU (gate, up) */
    if ((m->avx512 || act == ACT_SWIGLU) && chunk % 2) chunk++;
#ifdef NS_X86
    const uint16_t *xb = NULL;
    if (m->tiles && xs) {
        xb = xs;
    } else if (m->tiles) { /* rows this thread normalised for itself: rounded into its own buffer */
        uint16_t *own = m->xb + (size_t)tid * xb_each(m);
        to_bf16_rows(x, rows, l->in, own);
        xb = own;
    }
#else
    (void)tid, (void)xs;
#endif
    const QuantRows xq = l->i8sum ? quantize_rows(m, l, x, rows, tid) : (QuantRows){0};
    Claims cl = claims(phase, panels, chunk, tid, nt);
    for (int p = claim(job, &cl); p >= 0; p = claim(job, &cl)) {
        const int o0 = p * PANEL, o1 = (p + chunk) * PANEL < l->out ? (p + chunk) * PANEL : l->out;
        if (xq.q)
            gemv_i8(l, &xq, rows, y, ystride, o0, o1, accumulate);
        else
#ifdef NS_X86
        if (xb && m->tiles == ISA_AMX)
            gemv_amx(l, xb, rows, y, ystride, o0, o1, accumulate);
        else if (xb)
            gemv_dp(l, xb, rows, y, ystride, o0, o1, accumulate);
        else
#endif
            gemv(m, l, x, rows, y, ystride, o0, o1, accumulate);
        if (act == ACT_SWIGLU)
            swiglu_rows(m, y, ystride, rows, o0, o1, yb);
        else if (act == ACT_GELU)
            for (int r = 0; r < rows; r++) {
                gelu(m, y + (size_t)r * ystride + o0, o1 - o0);
                if (yb) round_shared(m, y + (size_t)r * ystride + o0, o1 - o0, yb, l->out, r, o0);
            }
    }
}

#include "attention.inc"

#include "sampler.inc"

/* ---------------------------------------------------------------- the step, per thread */

#include "barrier.inc"

static inline void sync(const Job *job, int nt) {
    if (!job->serial) barrier_wait(&job->m->bar, nt);
}

#include "head_screen.inc"

/* One row of the residual stream through the model's norm (LayerNorm or RMSNorm) at its level. */
typedef void (*norm_fn)(const float *x, float *out, int c, Norm n, float eps);

static void norm_row(const Model *m, const float *x, float *out, Norm nm) {
    norm_fn f = m->rms ? rms_norm_plain : layer_norm_plain;
#ifdef NS_X86
    if (m->avx512)
        f = m->rms ? rms_norm_avx512 : layer_norm_avx512;
    else if (m->avx2)
        f = m->rms ? rms_norm_avx2 : layer_norm_avx2;
#endif
    f(x, out, m->n_embd, nm, m->eps);
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
        norm_row(m, row, normed, nm);
        if (dst == m->hn) round_shared(m, normed, c, m->hb, c, r, 0);
    }
    if (dst == m->hn) sync(job, nt);
    return dst;
}

/* The shared bf16 copy of normalise's result h, or NULL (rows this thread normalised for itself). */
static const uint16_t *shared_of(const Model *m, const float *h) { return h == m->hn ? m->hb : NULL; }

/* Rows [tid, rows) step nt: token t's embedding (row t of wte, or, tied, output feature t of the
 * head's panels, or of its tile copy once the panels are gone, see ns_tiles_only), plus its
 * position's row of wpe where positions are learned. */
static void embed_rows(const Job *job, int tid, int nt) {
    const Model *m = job->m;
    const int c = m->n_embd;
    for (int r = tid; r < job->rows; r += nt) {
        const int t = (int)job->tok[r];
        float *x = m->x + (size_t)r * c;
        if (!m->wte && !m->head.w) {
            const uint16_t *tile = m->head.tiles + (size_t)(t / PANEL) * ROUND32(c) * PANEL + (t % PANEL) * 2;
            for (int i = 0; i < c; i++) x[i] = bf16_to_float(tile[(size_t)(i / 2) * 2 * PANEL + i % 2]);
        } else {
            const void *table = m->wte ? m->wte : m->head.w;
            const size_t te = m->wte ? (size_t)t * c : (size_t)(t / PANEL) * c * PANEL + panel_lane(t % PANEL, m->wt);
            const size_t step = m->wte ? 1 : PANEL;
            for (int i = 0; i < c; i++) x[i] = to_float(table, m->wt, te + i * step);
        }
        if (m->wpe) {
            const size_t pe = (size_t)job->pos[r] * c;
            for (int i = 0; i < c; i++) x[i] += to_float(m->wpe, m->wt, pe + i);
        }
    }
}

/* Parts each key/value head's group of query heads is cut into: one, unless the step has too few
 * (row, key/value head) pairs for two items per thread (a batch-1 decode step of a model with few
 * key/value heads: 135M's 3 groups on 2 threads split its attention 2:1, on 16 threads left 13
 * idle); then enough parts for that, at the cost of storing keys and values before a barrier. */
static int group_parts(const Model *m, int rows, int nt) {
    const int pairs = rows * m->n_kv;
    if (m->group == 1 || pairs >= 2 * nt) return 1;
    const int parts = (2 * nt + pairs - 1) / pairs;
    return parts < m->group ? parts : m->group;
}

/* Attention over one layer, in items of a row and a key/value head: the group of query heads that
 * read that head's keys and values (one query head each without grouped-query attention), or a
 * part of it (group_parts).
 *
 * A prompt chunk's rows attend over each other's keys, so every key and value is stored before any
 * row attends, and so are those of a group cut in parts (each part reads them). Where each row has
 * a slot of its own (decode steps) and each group is one item, only the item reads what it stores:
 * it stores its row's key and value for its head just before attending, without a phase and a
 * barrier of its own (the stores had waited on lines of the cache not read before; the item before
 * now asks for them, see ahead_of). */
static void attention_phase(const Job *job, const Layer *L, int phase, float *scores, int tid, int nt) {
    const Model *m = job->m;
    const int c = m->n_embd, hs = m->head_dim, parts = group_parts(m, job->rows, nt);
    const int per = (m->group + parts - 1) / parts, pairs = job->rows * m->n_kv, items = pairs * parts;
    const int chunk = chunk_of(items, job->rows, nt), store_in_item = job->own_slots && parts == 1;
    if (!store_in_item) {
        for (int p = tid; p < pairs; p += nt) store_kv(m, L, job, p / m->n_kv, p % m->n_kv);
        sync(job, nt);
    }
    Claims cl = claims(phase, items, chunk, tid, nt);
    for (int p0 = claim(job, &cl); p0 >= 0; p0 = claim(job, &cl)) {
        /* Item p is row r, key/value head kv, part `part`: counted on, not divided out per item
         * (three divisions an item were ~1.5% of a 10.7M bf16 decode step of 32 rows). */
        const int first = p0 / parts;
        int r = first / m->n_kv, kv = first % m->n_kv, part = p0 % parts;
        for (int p = p0; p < p0 + chunk && p < items; p++) {
            const int at_r = r, at_kv = kv, n = m->block[at_r];
            const int h0 = at_kv * m->group + part * per, end = (at_kv + 1) * m->group;
            const int h1 = h0 + per < end ? h0 + per : end;
            if (++part == parts) { /* on to the next item */
                part = 0;
                if (++kv == m->n_kv) kv = 0, r++;
            }
            if (!n || h0 >= h1) continue; /* a row's block is attended with the block's first row */
            if (store_in_item) store_kv(m, L, job, at_r, at_kv);
            Ahead next = {0};
            if (p + 1 < items) next = ahead_of(m, L, job, r, kv);
            attend_group(m, L, job, at_r, n, at_kv, h0, h1, scores, p + 1 < items ? &next : NULL);
            const int col = h0 * hs;
            for (int j = at_r; j < at_r + n; j++)
                round_shared(m, m->y + (size_t)j * c + col, (h1 - h0) * hs, m->yb, c, j, col);
        }
    }
    sync(job, nt);
}

static void step_thread(void *arg) {
    const Job *job = arg;
    const Model *m = job->m;
    const int tid = job->serial ? 0 : m->thread_num(), nt = job->serial ? 1 : m->num_threads();
    const int rows = job->rows, c = m->n_embd;
    float *own = m->h + (size_t)tid * 2 * m->max_threads * c;
    float *scores = m->att + (size_t)tid * ATT_ROWS * m->window;
    int phase = 0;

    /* This thread's part counters, zeroed before the barrier below, which every claim follows. */
    for (int ph = 0; ph < PHASES(m->n_layer); ph++) *claim_counter(job, ph, tid) = 0;
    embed_rows(job, tid, nt);
    sync(job, nt);
    const int swiglu = m->act == ACT_SWIGLU;
    for (int li = 0; li < m->n_layer; li++) {
        const Layer *L = &m->layers[li];
        const float *h = normalise(job, L->ln1, NULL, rows, tid, nt, own);
        gemv_claimed(job, phase++, &L->attn, h, shared_of(m, h), rows, m->qkv, m->qkv_w, 0, ACT_NONE, NULL, tid, nt);
        sync(job, nt);
        attention_phase(job, L, phase++, scores, tid, nt);
        gemv_claimed(job, phase++, &L->proj, m->y, m->yb, rows, m->x, c, 1, ACT_NONE, NULL, tid, nt);
        sync(job, nt);
        h = normalise(job, L->ln2, NULL, rows, tid, nt, own);
        gemv_claimed(job, phase++, &L->fc, h, shared_of(m, h), rows, m->f, m->fc_w, 0, m->act, m->fb, tid, nt);
        sync(job, nt);
        gemv_claimed(job, phase++, &L->mproj, swiglu ? m->g : m->f, m->fb, rows, m->x, c, 1, ACT_NONE, NULL, tid, nt);
        sync(job, nt);
    }
    const float *h = normalise(job, m->lnf, job->out, job->n_out, tid, nt, own);
#ifdef NS_X86
    if (job->screen)
        screened_head(job, phase, h, tid, nt);
    else
#endif
    gemv_claimed(job, phase, &m->head, h, shared_of(m, h), job->n_out, job->logits, m->vocab, 0, ACT_NONE, NULL, tid, nt);
#ifdef NS_X86
    if (m->tiles == ISA_AMX || m->i8amx) amx_release(); /* the thread's tile state is not kept between steps */
#endif
    /* Met here, where a late thread sleeps (barrier.inc), not only at the region's end in libgomp,
     * where the others would spin for it. */
    sync(job, nt);
}

/* ---------------------------------------------------------------- the interface (nanoserve_native.h) */

/* The model's linear layers, numbered: each layer's four (attn, proj, fc, mproj), then the output
 * layer (n_linears(m) - 1). */
static int n_linears(const Model *m) { return 4 * m->n_layer + 1; }

static Linear *linear_at(Model *m, int i) {
    if (i == 4 * m->n_layer) return &m->head;
    Layer *L = &m->layers[i / 4];
    Linear *const four[4] = {&L->attn, &L->proj, &L->fc, &L->mproj};
    return four[i % 4];
}

#ifdef NS_X86
/* Whether the kernel lets this process use the tile state (Linux asks each process to request it).
 * Asked once: a permission is the process's for good, and the request checks every thread's signal
 * stack, which ns_set_isa (called per level switch by the comparisons) need not pay again. */
static int amx_permitted(void) {
    static int known = -1; /* -1: not asked yet; else the answer (any thread may store it: the same) */
    int ok = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (ok < 0) {
#ifdef SYS_arch_prctl
        ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
        ok = 0;
#endif
        __atomic_store_n(&known, ok, __ATOMIC_RELAXED);
    }
    return ok;
}

/* The best tile level this bfloat16 model can run here: AVX512-BF16 where the CPU has it, AMX where
 * it also has AMX and the kernel lets this process use it; ISA_C (none) for a float32 model or an
 * older CPU. */
static int tiles_possible(const Model *m) {
    if (m->wt != BF16 || m->xq || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16"))
        return ISA_C;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return ISA_AVX512BF16;
    return amx_permitted() ? ISA_AMX : ISA_AVX512BF16;
}

/* Whether this int8 model's products can run on AMX-INT8 here (on the VNNI level's inputs). */
static int i8_amx_possible(const Model *m) {
    return m->xq && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
}

/* Tile level `level` can run: possible here, and the tile copies and input buffers exist. */
static int tiles_ready(Model *m, int level) {
    if (tiles_possible(m) < level) return 0;
    if (!m->xb) {
        const size_t rows = ROUND32(m->max_rows), c = ROUND32(m->n_embd);
        m->xb = calloc((size_t)m->max_threads * xb_each(m), sizeof(uint16_t));
        m->hb = calloc(rows * c, sizeof(uint16_t));
        m->yb = calloc(rows * c, sizeof(uint16_t));
        m->fb = calloc(rows * ROUND32(m->hidden), sizeof(uint16_t));
        if (!m->xb || !m->hb || !m->yb || !m->fb) {
            free(m->xb), free(m->hb), free(m->yb), free(m->fb);
            m->xb = m->hb = m->yb = m->fb = NULL;
            return 0;
        }
    }
    for (int i = 0; i < n_linears(m); i++) {
        Linear *l = linear_at(m, i);
        if (!l->tiles && !(l->tiles = amx_tiles(l, BF16))) return 0;
    }
    return 1;
}
#endif

/* Only the tile levels read the tile copy: 0 below them. */
int32_t ns_tiles_possible(ns_model *model) {
#ifdef NS_X86
    return tiles_possible(model);
#else
    (void)model;
    return 0;
#endif
}

/* One at a time, so a caller that frees each panel after its tiles are made never holds two copies
 * of every weight at once (ns_set_isa would make them all together). */
int32_t ns_tile_linear(ns_model *model, int32_t i) {
#ifdef NS_X86
    Model *m = model;
    if (i < 0 || i >= n_linears(m) || m->wt != BF16 || m->xq) return 0;
    Linear *l = linear_at(m, i);
    if (!l->tiles && l->w) l->tiles = amx_tiles(l, BF16);
    return l->tiles != NULL;
#else
    (void)model, (void)i;
    return 0;
#endif
}

/* The weights are then held once, in tile order. */
int32_t ns_tiles_only(ns_model *model) {
    Model *m = model;
    if (!m->tiles) return 0;
    for (int i = 0; i < n_linears(m); i++) linear_at(m, i)->w = NULL;
    m->tiles_only = 1;
    return 1;
}

/* Levels 0-2 compute the same function, 1 and 2 the same bits; levels 3 and 4 round the linear
 * layers' inputs to bfloat16 first (see gemv_dp, gemv_amx). An int8 model has no level 3: at level 4
 * it multiplies on AMX-INT8, the same bits as level 2 (gemv_amx_i8). (Lower levels are for
 * comparing and benchmarking.) */
int32_t ns_set_isa(ns_model *model, int32_t level) {
    Model *m = model;
    if (m->tiles_only && level < ISA_AVX512BF16) level = ISA_AVX512BF16;
    m->avx2 = m->avx512 = m->tiles = m->i8amx = 0;
#ifdef NS_X86
    m->avx2 = level >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    m->avx512 = m->avx2 && level >= ISA_AVX512 && __builtin_cpu_supports("avx512f");
    if (m->avx512 && level >= ISA_AVX512BF16)
        m->tiles = level >= ISA_AMX && tiles_ready(m, ISA_AMX) ? ISA_AMX
                   : tiles_ready(m, ISA_AVX512BF16)           ? ISA_AVX512BF16
                                                              : 0;
    m->i8amx = m->avx512 && level >= ISA_AMX && i8_amx_possible(m);
#endif
    return m->tiles ? m->tiles : m->i8amx ? ISA_AMX : m->avx512 ? ISA_AVX512 : m->avx2 ? ISA_AVX2 : ISA_C;
}

static Linear linear(ns_linear w, int out, int in) { return (Linear){w.w, w.b, out, in, NULL, w.scale, NULL}; }

static Norm norm(ns_norm w) { return (Norm){w.w, w.b}; }

/* cos and sin of every position's rotary angles, (window, head_dim / 2) each: frequency i turns by
 * pos / theta^(2i / head_dim), computed in double as nanoserve/model/gpt.py's rope_tables does. */
static int rope_tables(Model *m, double theta) {
    const int half = m->head_dim / 2;
    m->rope_cos = malloc((size_t)m->window * half * sizeof(float));
    m->rope_sin = malloc((size_t)m->window * half * sizeof(float));
    if (!m->rope_cos || !m->rope_sin) return 0;
    for (int i = 0; i < half; i++) {
        const double inv_freq = 1.0 / pow(theta, (double)(2 * i) / m->head_dim);
        for (int p = 0; p < m->window; p++) {
            const double angle = (double)p * inv_freq;
            m->rope_cos[(size_t)p * half + i] = (float)cos(angle);
            m->rope_sin[(size_t)p * half + i] = (float)sin(angle);
        }
    }
    return 1;
}

/* The model's shape and family from its config (no buffers yet). */
static Model model_of(const ns_config *cfg, const ns_weights *w) {
    const int c = cfg->n_embd, head_dim = c / cfg->n_head, n_kv = cfg->n_kv_head;
    const int hidden = cfg->mlp_hidden, swiglu = cfg->mlp == NS_SWIGLU;
    return (Model){.n_layer = cfg->n_layer, .n_head = cfg->n_head, .head_dim = head_dim, .n_embd = c,
                   .vocab = cfg->vocab, .slots = cfg->slots, .window = cfg->window, .max_rows = cfg->max_rows,
                   .max_threads = cfg->max_threads, .n_kv = n_kv, .group = cfg->n_head / n_kv,
                   .qkv_w = c + 2 * n_kv * head_dim, .hidden = hidden,
                   .fc_w = swiglu ? 2 * ((hidden + PANEL - 1) / PANEL * PANEL) : hidden,
                   .rms = cfg->norm == NS_RMSNORM, .act = swiglu ? ACT_SWIGLU : ACT_GELU, .eps = cfg->eps,
                   .wt = cfg->weight_type == BF16 ? BF16 : F32, .kvt = cfg->kv_type == BF16 ? BF16 : F32,
                   .wte = w->wte, .wpe = cfg->positions == NS_ROPE ? NULL : w->wpe};
}

ns_model *ns_create(const ns_config *cfg, const ns_weights *w, const ns_openmp *omp) {
    Model *m = calloc(1, sizeof(Model));
    if (!m) return NULL;
    *m = model_of(cfg, w);
    const int c = m->n_embd, n_layer = m->n_layer, max_threads = m->max_threads;
    if (omp) {
        m->parallel = (parallel_fn)omp->parallel;
        m->thread_num = (int_fn)omp->thread_num;
        m->num_threads = (int_fn)omp->num_threads;
    }
    m->bar.spin_ns = SPIN_MAX_NS;
    m->layers = calloc(n_layer, sizeof(Layer));
    size_t r = cfg->max_rows;
    m->x = calloc(r * c, sizeof(float));
    m->qkv = calloc(r * m->qkv_w, sizeof(float));
    m->y = calloc(r * c, sizeof(float));
    m->f = calloc(r * m->fc_w, sizeof(float));
    m->g = m->act == ACT_SWIGLU ? calloc(r * m->hidden, sizeof(float)) : NULL;
    m->h = calloc((size_t)max_threads * 2 * max_threads * c, sizeof(float));
    m->hn = calloc(r * c, sizeof(float));
    m->att = calloc((size_t)max_threads * ATT_ROWS * cfg->window, sizeof(float));
    m->block = calloc(r, sizeof(int));
    m->next = calloc((size_t)PHASES(n_layer) * max_threads * CLAIM_PAD, sizeof(int));
    m->seen = calloc(cfg->slots, 1);
    const int rope_ok = cfg->positions != NS_ROPE || rope_tables(m, cfg->rope_theta);
    if (!m->layers || !m->x || !m->qkv || !m->y || !m->f || (m->act == ACT_SWIGLU && !m->g) || !m->h || !m->hn ||
        !m->att || !m->block || !m->next || !m->seen || !rope_ok) {
        ns_free(m);
        return NULL;
    }
    for (int i = 0; i < n_layer; i++) {
        const ns_layer *src = &w->layers[i];
        m->layers[i] = (Layer){.ln1 = norm(src->ln1), .ln2 = norm(src->ln2), .attn = linear(src->attn, m->qkv_w, c),
                               .proj = linear(src->proj, c, c), .fc = linear(src->fc, m->fc_w, c),
                               .mproj = linear(src->mproj, c, m->hidden), .k = src->k, .v = src->v};
    }
    m->lnf = norm(w->lnf);
    m->head = linear(w->head, cfg->vocab, c);
    if (!i8_prepare(m, n_linears(m))) {
        ns_free(m);
        return NULL;
    }
    ns_set_isa(m, ISA_AVX512); /* the caller asks for a tile level: its tiles take a copy of the weights */
    return m;
}

/* Whether no two of the rows share a cache slot. */
static int own_slots(Model *m, int rows, const int64_t *slot) {
    int own = 1;
    for (int r = 0; r < rows && own; r++) {
        own = !m->seen[slot[r]];
        m->seen[slot[r]] = 1;
    }
    for (int r = 0; r < rows; r++) m->seen[slot[r]] = 0;
    return own;
}

void ns_step(ns_model *m, const ns_step_args *a) {
    Job job = {m, a->rows, !m->parallel || a->threads <= 1, a->tok, a->pos, a->slot, own_slots(m, a->rows, a->slot),
               a->out, a->n_out, a->logits, NULL};
    /* Screened only where every row wants its k largest logits alone, and the float32 kernels of
     * the AVX-512 level (whose sums head_screen.inc reproduces) are the ones in use. */
    int screen = m->screen && m->avx512 && a->screen && a->n_out <= m->slots; /* see screen_xb_each */
    for (int r = 0; screen && r < a->n_out; r++) screen = a->screen[r] > 0 && a->screen[r] <= SAMPLE_HEAP_MAX;
    if (screen) job.screen = a->screen;
    attention_blocks(m, &job);
    if (job.serial)
        step_thread(&job);
    else
        m->parallel(step_thread, &job, (unsigned)a->threads, 0);
}

int32_t ns_screen_head(ns_model *model, const float *rowmajor, int32_t usable) {
#ifdef NS_X86
    Model *m = model;
    const int c = m->n_embd, v = m->vocab;
    if (m->screen) return 1;
    if (m->wt != F32 || m->head.i8sum || !m->head.w || !rowmajor || usable < 1 || usable > v ||
        (int64_t)v * c >= INT32_MAX || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16"))
        return 0;
    m->snorm = malloc(((size_t)v + 16) * sizeof(float));
    m->sslack = malloc(((size_t)v + 16) * sizeof(float));
    m->slow = malloc((size_t)m->max_threads * ((size_t)v + 16) * sizeof(float));
    m->sheap = malloc((size_t)m->max_threads * SAMPLE_HEAP_MAX * sizeof(float));
    m->scand = malloc((size_t)m->max_threads * SCREEN_CAP * sizeof(int));
    m->sxb = calloc((size_t)m->max_threads * screen_xb_each(m), sizeof(uint16_t));
    if (!m->head.tiles) m->head.tiles = amx_tiles(&m->head, F32);
    if (!m->snorm || !m->sslack || !m->slow || !m->sheap || !m->scand || !m->sxb || !m->head.tiles) {
        free(m->snorm), free(m->sslack), free(m->slow), free(m->sheap), free(m->scand), free(m->sxb);
        free(m->head.tiles);
        m->snorm = m->sslack = m->slow = m->sheap = NULL, m->scand = NULL, m->sxb = NULL, m->head.tiles = NULL;
        return 0;
    }
    for (int j = 0; j < v; j++) {
        double sq = 0;
        for (int i = 0; i < c; i++) sq += (double)rowmajor[(size_t)j * c + i] * rowmajor[(size_t)j * c + i];
        m->snorm[j] = nextafterf((float)sqrt(sq), INFINITY); /* rounded up */
        /* The bias added after either sum rounds both, and underflow flushed in the bf16 products. */
        m->sslack[j] = (m->head.b ? 0x1p-22f * fabsf(m->head.b[j]) : 0.0f) + 1e-30f;
    }
    const double u = 0x1p-8, gamma = 1.01 * c * 0x1p-24;
    m->scoef = 1.01 * (2 * u + u * u + 2.02 * gamma);
    m->srow = rowmajor, m->susable = usable, m->screen = 1;
    return 1;
#else
    (void)model, (void)rowmajor, (void)usable;
    return 0;
#endif
}

/* Rows are dealt out to the threads in turn. */
int32_t ns_sample(ns_model *m, const ns_sample_args *a) {
    int threads = a->threads > a->rows ? a->rows : a->threads;
    if (threads < 1) threads = 1;
    const size_t each = sample_scratch_each(a->vocab), need = each * (size_t)threads;
    if (need > m->smp_bytes) {
        free(m->smp);
        m->smp = aligned_alloc(64, need);
        m->smp_bytes = m->smp ? need : 0;
        if (!m->smp) return -1;
    }
    SampleJob job = {.m = m, .logits = a->logits, .rows = a->rows, .vocab = a->vocab,
                     .serial = !m->parallel || threads <= 1, .temperature = a->temperature, .top_k = a->top_k,
                     .top_p = a->top_p, .min_p = a->min_p, .typical_p = a->typical_p, .uniform = a->uniform,
                     .out = a->out, .scratch = m->smp, .each = each};
    const ns_penalties *pen = a->penalties;
    if (pen) {
        job.seen = pen->seen, job.counts = pen->counts, job.slot = pen->slot;
        job.repetition = pen->repetition, job.frequency = pen->frequency, job.presence = pen->presence;
    }
    if (job.serial)
        sample_thread(&job);
    else
        m->parallel(sample_thread, &job, (unsigned)threads, 0);
    return 0;
}

void ns_free(ns_model *m) {
    if (!m) return;
    if (m->layers)
        for (int i = 0; i < n_linears(m); i++) free(linear_at(m, i)->tiles), free(linear_at(m, i)->i8sum);
    free(m->xq), free(m->xqs);
    free(m->xb), free(m->hb), free(m->yb), free(m->fb);
    free(m->layers), free(m->x), free(m->qkv), free(m->y), free(m->f), free(m->g), free(m->h), free(m->hn), free(m->att);
    free(m->block), free(m->next), free(m->rope_cos), free(m->rope_sin);
    free(m->seen), free(m->smp);
    free(m->snorm), free(m->sslack), free(m->slow), free(m->sheap), free(m->scand), free(m->sxb);
    free(m);
}
