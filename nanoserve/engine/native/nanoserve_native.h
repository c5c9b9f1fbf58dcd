/* nanoserve's native step: one forward of a decoder of the GPT-2 or the Llama family over token
 * rows on CPU, and the sampler
 * that draws the rows' next tokens. This header is the library's whole interface: every exported
 * function, its parameter structs and the constants a caller needs. nanoserve/engine/native_abi.py
 * mirrors it for ctypes and checks, when it loads the library, that the library's ABI version,
 * struct layouts and constants are the ones it was written against.
 *
 * Change a function, a struct or a constant's meaning here and bump NS_ABI_VERSION with it (and
 * the mirror's NS_ABI_VERSION): a loader refuses a library of another version instead of passing
 * it arguments it reads differently.
 *
 * Memory: the library keeps raw pointers to what ns_create is given (weights and KV cache buffers)
 * and never frees them; the caller keeps them alive until ns_free. Counts are int32_t and
 * per-row arrays int64_t (torch's index type), so the caller passes its tensors' memory as is.
 */
#ifndef NANOSERVE_NATIVE_H
#define NANOSERVE_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NS_API __attribute__((visibility("default")))

#define NS_ABI_VERSION 5

/* Linear weights come packed in panels of NS_PANEL output features: panel p holds W[p * NS_PANEL + j][k]
 * at [p][k][j] (float32), or, in bfloat16, features j and j + NS_PANEL / 2 of input k side by side,
 * zero-padded past the layer's outputs (native_step.py, pack_panels). */
#define NS_PANEL 16

/* Element types of weights and of the KV cache (bfloat16: the upper half of a float32). NS_I8: a
 * linear layer's weights in symmetric int8 with a float32 scale per output feature (ns_linear's
 * scale), in panels of NS_PANEL features by groups of NS_I8_GROUP inputs: panel p holds
 * W[p * NS_PANEL + j][g * NS_I8_GROUP + i] at [p][g][j][i], zero-padded past the layer's outputs and
 * inputs (int8_weights.py, pack_int8_panels). Never a config's weight_type: the embeddings keep theirs. */
enum ns_type { NS_F32 = 0, NS_BF16 = 1, NS_I8 = 2 };
#define NS_I8_GROUP 4

/* Kernel levels (ns_set_isa), each at most what the CPU has: portable C, AVX2 + FMA, AVX-512, and
 * for bfloat16 models the two tile levels, AVX512-BF16 dot products and AMX, which round the linear
 * layers' inputs to bfloat16. Levels up to NS_ISA_AVX512 compute the same function. */
enum ns_isa { NS_ISA_C = 0, NS_ISA_AVX2 = 1, NS_ISA_AVX512 = 2, NS_ISA_AVX512BF16 = 3, NS_ISA_AMX = 4 };

/* The family choices of ns_config (nanoserve/model/config.py's GPTConfig): GPT-2's are 0. */
enum ns_norm_kind { NS_LAYERNORM = 0, NS_RMSNORM = 1 };
enum ns_mlp_kind { NS_GELU = 0, NS_SWIGLU = 1 };
enum ns_positions { NS_LEARNED = 0, NS_ROPE = 1 };

/* A model: what ns_create makes, opaque to the caller. */
typedef struct ns_model ns_model;

/* ---------------------------------------------------------------- making a model */

typedef struct {
    int32_t n_layer, n_head, n_embd, vocab;
    int32_t slots, window;    /* the KV cache: sequences and positions per sequence */
    int32_t max_rows;         /* the most rows one ns_step takes */
    int32_t max_threads;      /* the most threads ns_step and ns_sample are asked to use */
    float eps;                /* the norms' epsilon */
    int32_t weight_type;      /* enum ns_type of the linear weights and embeddings */
    int32_t kv_type;          /* enum ns_type of the KV cache */
    int32_t n_kv_head;        /* key/value heads, dividing n_head (grouped-query attention) */
    int32_t mlp_hidden;       /* the MLP's width (GPT-2: 4 n_embd) */
    int32_t norm;             /* enum ns_norm_kind: LayerNorm (w, b) or RMSNorm (w only) */
    int32_t mlp;              /* enum ns_mlp_kind: GELU (tanh form) or SwiGLU */
    int32_t positions;        /* enum ns_positions: learned (wpe) or rotary (no weights) */
    double rope_theta;        /* rotary positions' base ("rotate half" layout, HF Llama's) */
} ns_config;

typedef struct {
    const float *w, *b; /* (n_embd,) float32 each; b may be NULL */
} ns_norm;

typedef struct {
    const void *w; /* (out, in) in NS_PANEL panels, of the config's weight_type, or NS_I8 */
    const float *b; /* (out,) float32, or NULL */
    /* NULL: w is of the config's weight_type. Else w is NS_I8 and this its scales, (out,) float32:
     * W[o][k] = w[o][k] * scale[o]. A model with any NS_I8 linear runs no tile level; an NS_I8
     * output layer needs its own wte (the embeddings are not read from int8 panels). */
    const float *scale;
} ns_linear;

/* Attention's attn is (n_embd + 2 kv, n_embd), kv = n_kv_head head_dim: the queries, then the keys
 * and the values. The MLP's fc is (hidden, n_embd) for GELU; for SwiGLU it is the gate (W1) and up
 * (W3) projections interleaved panel by panel, each padded with zeros to whole panels (hp =
 * mlp_hidden rounded up to NS_PANEL): (2 hp, n_embd), panel 2i holding gate features i NS_PANEL..,
 * panel 2i + 1 up's, so that one panel pair gives silu(gate) * up for NS_PANEL features. mproj
 * is (n_embd, mlp_hidden). */
typedef struct {
    ns_norm ln1;
    ns_linear attn, proj;
    ns_norm ln2;
    ns_linear fc, mproj;
    void *k, *v; /* the layer's KV cache, (slots, n_kv_head, window, head_dim) of kv_type each */
} ns_layer;

typedef struct {
    /* (vocab, n_embd) and (positions, n_embd) of the weight type; wpe NULL with rotary positions.
     * wte NULL: the output layer is tied to the embeddings, which are then read from its panels
     * (held once). */
    const void *wte, *wpe;
    const ns_layer *layers; /* n_layer of them; read by ns_create, not kept */
    ns_norm lnf;
    ns_linear head; /* (vocab, n_embd) */
} ns_weights;

/* libgomp's entry points as the caller's process loaded them (GOMP_parallel, omp_get_thread_num,
 * omp_get_num_threads), so that the library runs its parallel regions on the caller's own OpenMP
 * team instead of starting a second pool. (The threads of a region meet at the library's own
 * barrier, not libgomp's: see barrier.inc.) */
typedef struct {
    void *parallel, *thread_num, *num_threads;
} ns_openmp;

/* A model over these weights and KV cache, at kernel level NS_ISA_AVX512 or the best below it this
 * CPU has; omp NULL: every call runs on the calling thread alone. NULL when out of memory (or an
 * NS_I8 output layer comes without a wte). */
NS_API ns_model *ns_create(const ns_config *config, const ns_weights *weights, const ns_openmp *omp);

NS_API void ns_free(ns_model *model);

/* ---------------------------------------------------------------- kernel levels */

/* The kernels to use, at most `level` (enum ns_isa) and at most what this CPU has; returns the
 * level in effect. Once the panels are gone (ns_tiles_only) a request below NS_ISA_AVX512BF16 gets
 * that level. */
NS_API int32_t ns_set_isa(ns_model *model, int32_t level);

/* The best tile level this model can run here (NS_ISA_AVX512BF16 or NS_ISA_AMX), or 0. */
NS_API int32_t ns_tiles_possible(ns_model *model);

/* Make linear i's tile copy now. Linears are numbered each layer's attn, proj, fc, mproj in turn,
 * then the output layer (4 n_layer). Returns 1 if it exists. */
NS_API int32_t ns_tile_linear(ns_model *model, int32_t i);

/* With a tile level in use, stop reading the linear layers' panels (the caller may free them):
 * only the tile levels run afterwards. Returns 1 if done. */
NS_API int32_t ns_tiles_only(ns_model *model);

/* A float32 model's output layer, screened: a step whose every logit row only needs its k largest
 * logits (ns_step_args.screen) computes the output layer in bfloat16 (AVX512-BF16, twice a float32
 * FMA's multiply-adds), bounds each logit's error from that rounding, and recomputes in float32 every
 * logit that could be among the row's k largest, in the same order as the float32 kernels, so
 * those logits are bit for bit the unscreened ones and every other logit is below the k-th largest
 * (its bf16 value stays there). `rowmajor`: the output layer's (vocab, n_embd) float32 weights,
 * which the caller keeps alive; logits from `usable` on are never screened in (the caller masks
 * them). Returns 1 if on: a float32 model on a CPU with AVX512-BF16; 0 otherwise. */
NS_API int32_t ns_screen_head(ns_model *model, const float *rowmajor, int32_t usable);

/* ---------------------------------------------------------------- a forward */

typedef struct {
    const int64_t *tok, *pos, *slot; /* (rows,) each: row i feeds tok[i] at pos[i] into slot[i] */
    const int64_t *out; /* (n_out,) the rows whose logits are wanted */
    float *logits;      /* (n_out, vocab) */
    int32_t rows;       /* 1..max_rows */
    int32_t n_out;
    int32_t threads;    /* 1..max_threads */
    /* (n_out,) or NULL: per logit row, the k of the only logits the caller will read exactly (its
     * k largest: 1 for a greedy pick, top_k for a top-k draw), or 0 for the whole row. Where every
     * row has a k and ns_screen_head is on, the rows are screened (see there). */
    const int32_t *screen;
} ns_step_args;

/* One forward over args->rows token rows: decode rows, or the tokens of prompt chunks (a
 * sequence's rows in position order), each writing its key and value into its slot at its
 * position (a rotary model's key turned by its position) and attending over that slot's
 * positions 0..pos. Nothing is checked: the caller keeps every token, position, slot and out row
 * in range. */
NS_API void ns_step(ns_model *model, const ns_step_args *args);

/* ---------------------------------------------------------------- sampling */

/* The repetition, frequency and presence penalties of a ns_sample call. */
typedef struct {
    const uint8_t *seen;   /* (slots, vocab): whether each token was seen (prompt or generated) */
    const int32_t *counts; /* (slots, vocab): how often each token was generated */
    const int64_t *slot;   /* (rows,) each row's slot */
    const float *repetition, *frequency, *presence; /* (rows,) each; 1, 0, 0: off */
} ns_penalties;

typedef struct {
    const float *logits;      /* (rows, vocab) */
    const float *temperature; /* (rows,) 0: greedy; below 0: the row is skipped */
    const int64_t *top_k;     /* (rows,) 0: off */
    const double *top_p, *min_p, *typical_p; /* (rows,) 1, 0, 1: off */
    const double *uniform;    /* (rows,) each row's uniform number in [0, 1) */
    int64_t *out;             /* (rows,) the tokens drawn */
    const ns_penalties *penalties; /* NULL: none */
    int32_t rows, vocab;
    int32_t threads; /* rows are dealt out to at most this many */
} ns_sample_args;

/* A token for each row of temperature above 0: the penalties, temperature, top_k, top_p, min_p,
 * typical_p, then inverse-CDF sampling with the row's uniform number (nanoserve/model/sampling.py's rules;
 * sampler.inc says what may differ); the first largest penalised logit for rows of temperature
 * 0; out[r] of rows below 0 is left as it is. 0, or -1 when no scratch memory could be had. */
NS_API int32_t ns_sample(ns_model *model, const ns_sample_args *args);

/* ---------------------------------------------------------------- what a loader checks */

/* NS_ABI_VERSION as this library was compiled. */
NS_API int32_t ns_abi_version(void);

/* The value of a constant of this header by name ("NS_PANEL", "NS_BF16", "NS_ISA_AMX", ...), so that
 * a loader reads it instead of copying it; -1 for an unknown name. */
NS_API int64_t ns_constant(const char *name);

/* sizeof(type) when field is NULL, else offsetof(type, field), for the structs of this header by
 * name ("ns_step_args", "logits"), so that a loader checks its mirror; -1 for an unknown name. */
NS_API int64_t ns_layout(const char *type, const char *field);

#ifdef __cplusplus
}
#endif

#endif /* NANOSERVE_NATIVE_H */
