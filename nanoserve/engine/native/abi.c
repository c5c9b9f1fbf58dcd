/* What a loader checks before it calls the library (nanoserve_native.h, "what a loader checks"):
 * the ABI version, the header's constants by name and its structs' layouts. A compilation unit of
 * its own: it needs nothing of the step's internals, only the public header. */
#include <stddef.h>
#include <string.h>

#include "nanoserve_native.h"

int32_t ns_abi_version(void) { return NS_ABI_VERSION; }

typedef struct {
    const char *name;
    int64_t value;
} Constant;

#define CONSTANT(name) {#name, name}

static const Constant CONSTANTS[] = {
    CONSTANT(NS_ABI_VERSION), CONSTANT(NS_PANEL),        CONSTANT(NS_F32),
    CONSTANT(NS_BF16),        CONSTANT(NS_ISA_C),        CONSTANT(NS_ISA_AVX2),
    CONSTANT(NS_ISA_AVX512),  CONSTANT(NS_ISA_AVX512BF16), CONSTANT(NS_ISA_AMX),
    CONSTANT(NS_I8),          CONSTANT(NS_I8_GROUP),
    CONSTANT(NS_LAYERNORM),   CONSTANT(NS_RMSNORM),      CONSTANT(NS_GELU),
    CONSTANT(NS_SWIGLU),      CONSTANT(NS_LEARNED),      CONSTANT(NS_ROPE),
};

int64_t ns_constant(const char *name) {
    for (size_t i = 0; name && i < sizeof CONSTANTS / sizeof CONSTANTS[0]; i++)
        if (!strcmp(CONSTANTS[i].name, name)) return CONSTANTS[i].value;
    return -1;
}

typedef struct {
    const char *type, *field; /* field NULL: the struct's size */
    size_t value;
} Layout;

#define SIZE(T) {#T, NULL, sizeof(T)}
#define FIELD(T, f) {#T, #f, offsetof(T, f)}

/* Every field of every struct in nanoserve_native.h, in its order. */
static const Layout LAYOUTS[] = {
    SIZE(ns_config),
    FIELD(ns_config, n_layer), FIELD(ns_config, n_head), FIELD(ns_config, n_embd), FIELD(ns_config, vocab),
    FIELD(ns_config, slots), FIELD(ns_config, window), FIELD(ns_config, max_rows),
    FIELD(ns_config, max_threads), FIELD(ns_config, eps), FIELD(ns_config, weight_type),
    FIELD(ns_config, kv_type), FIELD(ns_config, n_kv_head), FIELD(ns_config, mlp_hidden),
    FIELD(ns_config, norm), FIELD(ns_config, mlp), FIELD(ns_config, positions), FIELD(ns_config, rope_theta),
    SIZE(ns_norm), FIELD(ns_norm, w), FIELD(ns_norm, b),
    SIZE(ns_linear), FIELD(ns_linear, w), FIELD(ns_linear, b), FIELD(ns_linear, scale),
    SIZE(ns_layer),
    FIELD(ns_layer, ln1), FIELD(ns_layer, attn), FIELD(ns_layer, proj), FIELD(ns_layer, ln2),
    FIELD(ns_layer, fc), FIELD(ns_layer, mproj), FIELD(ns_layer, k), FIELD(ns_layer, v),
    SIZE(ns_weights),
    FIELD(ns_weights, wte), FIELD(ns_weights, wpe), FIELD(ns_weights, layers), FIELD(ns_weights, lnf),
    FIELD(ns_weights, head),
    SIZE(ns_openmp),
    FIELD(ns_openmp, parallel), FIELD(ns_openmp, thread_num),
    FIELD(ns_openmp, num_threads),
    SIZE(ns_step_args),
    FIELD(ns_step_args, tok), FIELD(ns_step_args, pos), FIELD(ns_step_args, slot), FIELD(ns_step_args, out),
    FIELD(ns_step_args, logits), FIELD(ns_step_args, rows), FIELD(ns_step_args, n_out),
    FIELD(ns_step_args, threads), FIELD(ns_step_args, screen),
    SIZE(ns_penalties),
    FIELD(ns_penalties, seen), FIELD(ns_penalties, counts), FIELD(ns_penalties, slot),
    FIELD(ns_penalties, repetition), FIELD(ns_penalties, frequency), FIELD(ns_penalties, presence),
    SIZE(ns_sample_args),
    FIELD(ns_sample_args, logits), FIELD(ns_sample_args, temperature), FIELD(ns_sample_args, top_k),
    FIELD(ns_sample_args, top_p), FIELD(ns_sample_args, min_p), FIELD(ns_sample_args, typical_p),
    FIELD(ns_sample_args, uniform), FIELD(ns_sample_args, out), FIELD(ns_sample_args, penalties),
    FIELD(ns_sample_args, rows), FIELD(ns_sample_args, vocab), FIELD(ns_sample_args, threads),
};

int64_t ns_layout(const char *type, const char *field) {
    for (size_t i = 0; type && i < sizeof LAYOUTS / sizeof LAYOUTS[0]; i++) {
        const Layout *l = &LAYOUTS[i];
        const int same_field = field ? l->field && !strcmp(l->field, field) : !l->field;
        if (same_field && !strcmp(l->type, type)) return (int64_t)l->value;
    }
    return -1;
}
