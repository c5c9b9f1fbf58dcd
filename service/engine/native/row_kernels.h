/* Part of decode.c, which includes it once: one translation unit, so the library stays one file to
 * build and these parts share its types and helpers. Layer norm, GELU and the exp they share, per
 * row of the residual stream, at each kernel level. */

/* ---------------------------------------------------------------- small row kernels */

/* Mean and variance in double, each summed in eight interleaved partial sums (element i into sum
 * i % 8, then the eight in order, then any tail): a fixed order the compiler can vectorise, the same
 * for every build below (no contraction into FMAs in ISO C mode), so every kernel level gets the
 * same bits. One sum in sequence was ~8% of a 32-row bf16 step on AMX. */
#define LN_LANES 8
static inline __attribute__((always_inline)) void layer_norm_body(const float *x, float *out, int c, Norm n,
                                                                   float eps) {
    double part[LN_LANES] = {0}, mean = 0, var = 0;
    const int body = c / LN_LANES * LN_LANES;
    for (int i = 0; i < body; i += LN_LANES)
        for (int j = 0; j < LN_LANES; j++) part[j] += x[i + j];
    for (int j = 0; j < LN_LANES; j++) mean += part[j], part[j] = 0;
    for (int i = body; i < c; i++) mean += x[i];
    mean /= c;
    for (int i = 0; i < body; i += LN_LANES)
        for (int j = 0; j < LN_LANES; j++) {
            const double d = x[i + j] - mean;
            part[j] += d * d;
        }
    for (int j = 0; j < LN_LANES; j++) var += part[j];
    for (int i = body; i < c; i++) {
        const double d = x[i] - mean;
        var += d * d;
    }
    const float rstd = (float)(1.0 / sqrt(var / c + eps)), mu = (float)mean;
    for (int i = 0; i < c; i++) {
        const float v = (x[i] - mu) * rstd * n.w[i];
        out[i] = n.b ? v + n.b[i] : v;
    }
}

static void layer_norm_plain(const float *x, float *out, int c, Norm n, float eps) {
    layer_norm_body(x, out, c, n, eps);
}

#ifdef NS_X86
__attribute__((target("avx2"))) static void layer_norm_avx2(const float *x, float *out, int c, Norm n, float eps) {
    layer_norm_body(x, out, c, n, eps);
}

__attribute__((target("avx512f"))) static void layer_norm_avx512(const float *x, float *out, int c, Norm n,
                                                                 float eps) {
    layer_norm_body(x, out, c, n, eps);
}
#endif

/* GELU, tanh form (GPT-2's "gelu_new"), as x * sigmoid(2 z): the same function. */
static void gelu_scalar(float *x, int n) {
    const float k = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
    for (int i = 0; i < n; i++) {
        float v = x[i];
        float z = k * (v + 0.044715f * v * v * v);
        x[i] = v / (1.0f + expf(-z));
    }
}

#ifdef NS_X86
/* exp(x) for the floats of a W-bit vector (W = 256 or 512: exp256 and exp512 below, the same
 * operations): Cephes' expf (range reduction by ln 2, degree-5 polynomial), within a few ulp of
 * expf. A scalar expf per element made the GELU ~15% of a batch-64 step. */
#define EXP_PS(W, x)                                                                                       \
    do {                                                                                                   \
        x = _mm##W##_max_ps(_mm##W##_min_ps(x, _mm##W##_set1_ps(88.3762626647949f)),                      \
                            _mm##W##_set1_ps(-88.3762626647949f));                                         \
        const __m##W fx = _mm##W##_floor_ps(                                                              \
            _mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504088896341f), _mm##W##_set1_ps(0.5f)));        \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                    \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                                 \
        __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                    \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                  \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                  \
        y = _mm##W##_add_ps(_mm##W##_fmadd_ps(y, _mm##W##_mul_ps(x, x), x), _mm##W##_set1_ps(1.0f));       \
        const __m##W##i e = _mm##W##_slli_epi32(                                                          \
            _mm##W##_add_epi32(_mm##W##_cvttps_epi32(fx), _mm##W##_set1_epi32(127)), 23);                 \
        x = _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                               \
    } while (0)

__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    EXP_PS(256, x);
    return x;
}

__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    EXP_PS(512, x);
    return x;
}

/* GELU of a W-bit vector v, x * sigmoid(2 z) as gelu_scalar: the same operations at either width. */
#define GELU_PS(W, v)                                                                                      \
    _mm##W##_div_ps(v, _mm##W##_add_ps(_mm##W##_set1_ps(1.0f),                                            \
                                       exp##W(_mm##W##_sub_ps(                                             \
                                           _mm##W##_setzero_ps(),                                          \
                                           _mm##W##_mul_ps(_mm##W##_set1_ps(1.5957691216057308f),          \
                                                           _mm##W##_fmadd_ps(_mm##W##_mul_ps(              \
                                                               _mm##W##_set1_ps(0.044715f), v),            \
                                                               _mm##W##_mul_ps(v, v), v))))))

/* Every element goes through the same vector code (the last partial vector masked), so a value's
 * result does not depend on where a thread's slice happened to start, nor on the vector width. */
__attribute__((target("avx2,fma"))) static void gelu_avx2(float *x, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 v = _mm256_maskload_ps(x + i, mask);
        _mm256_maskstore_ps(x + i, mask, GELU_PS(256, v));
    }
}

__attribute__((target("avx512f"))) static void gelu_avx512(float *x, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
        _mm512_mask_storeu_ps(x + i, mask, GELU_PS(512, v));
    }
}
#endif

static void gelu(const Model *m, float *x, int n) {
#ifdef NS_X86
    if (m->avx512) {
        gelu_avx512(x, n);
        return;
    }
    if (m->avx2) {
        gelu_avx2(x, n);
        return;
    }
#endif
    (void)m;
    gelu_scalar(x, n);
}
