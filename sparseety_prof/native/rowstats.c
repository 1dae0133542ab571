/* Per-row logits statistics for sparseety_prof/logits.py (the C backend of row_stats).
 *
 * For each float32 row x[0..w) and chosen token t it computes, with m = max(x) and
 * lse = m + log(sum exp(x - m)):
 *   log_prob = x[t] - lse            (NaN when t is out of range)
 *   top-k ids, most likely first, ties broken by the lower id, and their x[i] - lse
 *   entropy  = lse - m - sum(exp(x - m) * (x - m)) / sum(exp(x - m))   (nats)
 *
 * One pass over the row instead of numpy's ten (row_pass): a 256-entry block is reduced to its
 * maximum with vector compares; only a block whose maximum beats the current k-th value is
 * scanned element by element for the top list (a handful of blocks per row on real logits); then,
 * while the block is in L1, sum exp(z) and sum exp(z) * z are added with a vectorised Cephes expf,
 * relative to the largest value so far, and moved exactly to a new maximum when one comes.
 * The row is only read, never written, and nothing global is written: the entry point is
 * thread-safe and runs with the GIL released (ctypes).
 *
 * The vector code is written once with GCC vector extensions, in the template half of this file,
 * and instantiated per x86-64 level at that level's native width: 16 floats for x86-64-v4
 * (AVX-512), 8 for -v3 (AVX2 + FMA), 4 for baseline SSE2. A width the target lacks is lowered
 * very badly (16-wide code built for AVX2 ran several times slower), so one generic width with
 * target_clones does not do. The entry point picks the best level the CPU supports on each call
 * (two loads of libgcc's cpu model), so the build stays portable: no -march=native. Other
 * architectures get the 4-wide generic build.
 *
 * No -ffast-math: it would let the compiler assume no infinities, and -inf logits (masked
 * tokens) are normal input here.
 */
#ifndef RS_TEMPLATE
/* ------------------------------------------------------------------ shared, scalar part */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h> /* for max_ps only; usable in each level's code through its target pragma */
#endif

#define RS_EXPORT __attribute__((visibility("default")))
#define RS_ABI_VERSION 2
#define RS_MAX_K 16
#define RS_INLINE static inline __attribute__((always_inline))
#define RS_CAT_(a, b) a##_##b
#define RS_CAT(a, b) RS_CAT_(a, b)

#define BLOCK 256 /* entries reduced to one maximum before comparing with the k-th value */
#define FLUSH 1024 /* float partial sums go to double every FLUSH entries */
/* Blocks read ahead. The logits rows lie in the ring's 4 KiB pages, and the hardware prefetcher
 * stops at each page's end: with the exp work in the same loop, too few loads are in flight to
 * hide the next page's misses. The `logits` stage of `scripts/replay_drains.py replay` (real rows
 * where they lie) chose 2 blocks ahead, against 0, 1 and 4 and the two-pass code before. */
#define PREFETCH_BLOCKS 2
#define EXP_LO (-87.0f)

/* Insert (v, id) into the sorted top list of length k, known to beat its last entry. Ids arrive in
 * increasing order, so an equal value never moves ahead of an earlier one: ties keep the lower id. */
RS_INLINE void top_insert(float *tv, int64_t *ti, int k, float v, int64_t id) {
    int j = k - 1;
    while (j > 0 && tv[j - 1] < v) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        j--;
    }
    tv[j] = v;
    ti[j] = id;
}

/* Seed the list with the first k entries (sorted, stable), so that -inf entries, which never beat
 * anything, still fill it: a row of -inf but one still has k alternatives, the lowest ids. */
RS_INLINE void top_seed(const float *x, int k, float *tv, int64_t *ti) {
    for (int i = 0; i < k; i++) {
        int j = i;
        while (j > 0 && tv[j - 1] < x[i]) {
            tv[j] = tv[j - 1];
            ti[j] = ti[j - 1];
            j--;
        }
        tv[j] = x[i];
        ti[j] = i;
    }
}

/* One row's outputs from the top list and the two sums s = sum exp(z), s1 = sum exp(z) z over
 * z = x - m, m = tv[0] = max(x). */
RS_INLINE void row_finish(const float *x, int64_t w, int64_t t, int k, const float *tv, const int64_t *ti,
                          double s, double s1, double *log_prob, int64_t *top_ids, double *top_lp,
                          double *entropy) {
    double md = (double)tv[0];
    if (!isfinite(md)) {
        /* all -inf, or +inf somewhere: no distribution (numpy's answer is NaN too) */
        s = NAN;
    }
    double lse_z = log(s); /* log-sum-exp of z; NaN when the row holds a NaN */
    /* x - m in double is exact for float32 inputs (numpy rounds it to float32 first) */
    *log_prob = (t >= 0 && t < w) ? ((double)x[t] - md) - lse_z : NAN;
    for (int j = 0; j < k; j++) {
        top_ids[j] = ti[j];
        top_lp[j] = ((double)tv[j] - md) - lse_z;
    }
    /* H = -sum p log p with log p = z - lse_z: lse_z - s1 / s */
    *entropy = lse_z - s1 / s;
}

typedef void (*rs_block_fn)(const float *const *rows, int64_t n, int64_t w, const int64_t *tokens, int k,
                            double *log_prob, int64_t *top_ids, double *top_lp, double *entropy);

/* ------------------------------------------------------------------ one instance per level */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define RS_ISA v4
#define VL 16
#define RS_TEMPLATE
#include "rowstats.c" /* this file again, as the template */
#undef RS_TEMPLATE
#undef VL
#undef RS_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define RS_ISA v3
#define VL 8
#define RS_TEMPLATE
#include "rowstats.c" /* this file again, as the template */
#undef RS_TEMPLATE
#undef VL
#undef RS_ISA
#pragma GCC pop_options
#endif

/* baseline: SSE2 on x86-64, whatever the compiler's defaults are elsewhere */
#define RS_ISA base
#define VL 4
#define RS_TEMPLATE
#include "rowstats.c" /* this file again, as the template */
#undef RS_TEMPLATE
#undef VL
#undef RS_ISA

/* The level `level` asks for (0: the best this CPU has; 4: x86-64-v4, 3: -v3, 1: baseline),
 * or NULL when the CPU lacks it. libgcc's constructor fills the cpu model at load time; reading it
 * is two loads. */
static rs_block_fn pick(int level) {
#if defined(__x86_64__)
    int v4 = __builtin_cpu_supports("x86-64-v4");
    int v3 = __builtin_cpu_supports("x86-64-v3");
    if ((level == 0 || level == 4) && v4) return rowstats_block_v4;
    if (level == 4) return NULL;
    if ((level == 0 || level == 3) && v3) return rowstats_block_v3;
    if (level == 3) return NULL;
#endif
    return (level == 0 || level == 1) ? rowstats_block_base : NULL;
}

/* All rows of a block in one call, so the ctypes overhead is paid once per block.
 *   rows      float32 [n][w], C-contiguous (only read)
 *   tokens    int64 [n]
 *   log_prob  float64 [n];  top_ids int64 [n][k];  top_lp float64 [n][k];  entropy float64 [n]
 *   level     0 for the best the CPU has; 4, 3 or 1 to force one (tests)
 * k must be in 1..min(w, RS_MAX_K). Returns 0; -1 for bad arguments, -2 for a level this CPU
 * lacks (nothing written then). A row whose maximum is +inf or -inf (all entries -inf), or that
 * holds a NaN, gives NaN log-probs and entropy, as the numpy implementation does. */
RS_EXPORT int sparseety_rowstats(const float *rows, int64_t n, int64_t w, const int64_t *tokens, int64_t k,
                                 double *log_prob, int64_t *top_ids, double *top_lp, double *entropy,
                                 int level) {
    if (n < 0 || w <= 0 || k < 1 || k > w || k > RS_MAX_K) return -1;
    rs_block_fn fn = pick(level);
    if (fn == NULL) return -2;
    enum { PTRS = 64 };
    const float *ptrs[PTRS];
    for (int64_t r0 = 0; r0 < n; r0 += PTRS) {
        int64_t m = n - r0 < PTRS ? n - r0 : PTRS;
        for (int64_t j = 0; j < m; j++) ptrs[j] = rows + (r0 + j) * w;
        fn(ptrs, m, w, tokens + r0, (int)k, log_prob + r0, top_ids + r0 * k, top_lp + r0 * k, entropy + r0);
    }
    return 0;
}

/* The same for rows anywhere in memory: rows[r] points at row r's w floats (only read). The
 * consumer passes the logits records where they lie (no copy into a block first: each copy of a
 * 128 KiB row is a pass over memory the engine is contending for). */
RS_EXPORT int sparseety_rowstats_ptrs(const float *const *rows, int64_t n, int64_t w, const int64_t *tokens,
                                      int64_t k, double *log_prob, int64_t *top_ids, double *top_lp,
                                      double *entropy, int level) {
    if (n < 0 || w <= 0 || k < 1 || k > w || k > RS_MAX_K) return -1;
    rs_block_fn fn = pick(level);
    if (fn == NULL) return -2;
    fn(rows, n, w, tokens, (int)k, log_prob, top_ids, top_lp, entropy);
    return 0;
}

RS_EXPORT int sparseety_rowstats_abi(void) { return RS_ABI_VERSION; }

/* The level sparseety_rowstats(level=0) runs at: 4, 3 or 1 (baseline; also non-x86). */
RS_EXPORT int sparseety_rowstats_level(void) {
    rs_block_fn fn = pick(0);
#if defined(__x86_64__)
    if (fn == rowstats_block_v4) return 4;
    if (fn == rowstats_block_v3) return 3;
#endif
    return fn == rowstats_block_base ? 1 : 0;
}

#else /* RS_TEMPLATE ------------------------------------------------------------------------ */
/* Vector part, included once per level with RS_ISA (name suffix) and VL (floats per vector). */
#define F(name) RS_CAT(name, RS_ISA)
typedef float F(vf) __attribute__((vector_size(VL * 4)));
typedef int32_t F(vi) __attribute__((vector_size(VL * 4)));
/* the same vector with 4-byte alignment: loads straight from the row, at any offset */
typedef float F(vf_u) __attribute__((vector_size(VL * 4), aligned(4)));
#define vf F(vf)
#define vi F(vi)
#define vf_u F(vf_u)
#define vload F(vload)
#define vsplat F(vsplat)
#define vsel F(vsel)
#define vmax F(vmax)
#define hmax F(hmax)
#define hsum_d F(hsum_d)
#define vexp F(vexp)
#define exp_range F(exp_range)
#define row_pass F(row_pass)

RS_INLINE vf vload(const float *p) { return *(const vf_u *)p; }
RS_INLINE vf vsplat(float a) { return (vf){0} + a; }
/* lanes of a where mask is all ones, of b elsewhere (C has no vector ?:) */
RS_INLINE vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
/* a > b ? a : b, so b when either is NaN. That is exactly x86's maxps, one instruction where GCC
 * makes three of the generic form. */
#if defined(__x86_64__) && VL == 16
RS_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
#elif defined(__x86_64__) && VL == 8
RS_INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
#elif defined(__x86_64__) && VL == 4
RS_INLINE vf vmax(vf a, vf b) { return _mm_max_ps(a, b); }
#else
RS_INLINE vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
#endif

/* The largest lane, by halving: log2(VL) shuffles and maxes (a lane-by-lane loop, once per block,
 * cost as much as the block's compares). A NaN lane may be dropped, as vmax drops it. */
RS_INLINE float hmax(vf v) {
#if VL == 16
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif VL == 8
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#elif VL == 4
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2));
#else
#error "hmax: VL must be 4, 8 or 16"
#endif
    return v[0];
}

RS_INLINE double hsum_d(vf v) {
    double s = 0.0;
    for (int i = 0; i < VL; i++) s += (double)v[i];
    return s;
}

/* exp(zc) with zc = max(z, -87), for z <= 0; returns zc too, for the entropy sum.
 * Below -87, exp(z) < 1.7e-38 of the largest term (exp(0) = 1): using exp(-87) instead changes
 * neither sum, keeps the result a normal float (subnormals are slow, and 2^n below would need
 * n < -126), and makes -inf give a finite (z, exp z) pair, so exp(z) * z is ~0, never 0 * -inf = NaN.
 * A NaN z stays NaN in both (the compare is false for it), so a NaN in the row shows up as NaN.
 * Cephes expf: n = round(z / ln2), r = z - n ln2 in two parts, degree-5 polynomial: ~1 ulp. */
RS_INLINE vf vexp(vf z, vf *zc_out) {
    vf zc = vmax(vsplat(EXP_LO), z);
    /* round to nearest by adding 1.5 * 2^23: the low mantissa bits of t are then n itself */
    const vf magic = vsplat(12582912.0f);
    vf t = zc * 1.44269504088896341f + magic;
    vf fx = t - magic;
    vi n = (vi)t - (vi)magic;
    vf r = zc - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    vf y = vsplat(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    /* Cephes writes the end as y r^2 + r + 1; full Horner is one operation less, same accuracy */
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    /* zc >= -87 keeps n >= -126, so 2^n is a normal float */
    *zc_out = zc;
    return y * (vf)((n + 127) << 23);
}

/* Sum exp(x - m) and exp(x - m)(x - m) over x[lo..hi) into the vector accumulators, one vector at
 * a time, the last one padded with -inf, whose terms are exp(-87)-small like any other very
 * negative z (the few entries the blocks of row_pass do not cover). */
RS_INLINE void exp_range(const float *x, int64_t lo, int64_t hi, vf mv, vf *a, vf *b) {
    for (int64_t i = lo; i < hi; i += VL) {
        vf v;
        if (i + VL <= hi) {
            v = vload(x + i);
        } else {
            v = vsplat(-INFINITY);
            for (int64_t j = i; j < hi; j++) v[j - i] = x[j];
        }
        vf zc;
        vf e = vexp(v - mv, &zc);
        *a += e;
        *b += e * zc;
    }
}

/* One pass over the row: its top k (tv, ti; tv[0] = max(x)) and s = sum exp(x - M),
 * s1 = sum exp(x - M)(x - M) with M = tv[0] (when the row holds no NaN).
 *
 * The row is read once, a BLOCK of entries at a time: its maximum is taken with vector compares
 * (four independent chains hide the compare latency); only a block whose maximum beats the k-th
 * value is scanned element by element for the top list (a handful of blocks per row on real
 * logits); then, while the block is in L1, its exp terms are added relative to m, the largest
 * value met so far. When a block raises m to m', the sums move to it exactly:
 *   sum e^(x-m') = e^d sum e^(x-m),  sum e^(x-m')(x-m') = e^d (s1 + d s),  d = m - m' < 0
 * (a couple of times per row on real logits, in double). Reading the row twice (top-k, then the
 * sums) cost twice the memory traffic on rows that the probes just wrote from another core.
 *
 * Float partial sums live in vector lanes (four chains, for latency) for at most FLUSH entries,
 * then go to double: each lane adds at most 64 terms in float, so the relative error stays ~1e-7
 * even over 256k entries. While m is -inf (every entry so far masked) no term is added: those
 * entries weigh exp(-inf) = 0 next to any finite maximum. The k seed entries and the tail past
 * the last whole block are added at the end, relative to the final maximum. */
RS_INLINE void row_pass(const float *x, int64_t w, int k, float *tv, int64_t *ti, double *s_out,
                        double *s1_out) {
    top_seed(x, k, tv, ti);
    float m = tv[0];
    double s = 0.0, s1 = 0.0;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t pending = 0; /* entries in the float accumulators */
#define RS_SPILL()                                   \
    do {                                             \
        s += hsum_d((a0 + a1) + (a2 + a3));          \
        s1 += hsum_d((b0 + b1) + (b2 + b3));         \
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = (vf){0}; \
        pending = 0;                                 \
    } while (0)
#define RS_RAISE(to)                                          \
    do {                                                      \
        RS_SPILL();                                           \
        if (m > -INFINITY) { /* else nothing was added yet */ \
            double d = (double)m - (double)(to);              \
            double e = exp(d);                                \
            s1 = e * (s1 + d * s);                            \
            s = e * s;                                        \
        }                                                     \
        m = (to);                                             \
    } while (0)
    int64_t i = k;
    for (; i + BLOCK <= w; i += BLOCK) {
        const float *p = x + i;
        if (i + (PREFETCH_BLOCKS + 1) * BLOCK <= w) {
            for (int j = 0; j < BLOCK; j += 16) __builtin_prefetch(p + PREFETCH_BLOCKS * BLOCK + j);
        }
        vf m0 = vload(p), m1 = vload(p + VL), m2 = vload(p + 2 * VL), m3 = vload(p + 3 * VL);
        for (int j = 4 * VL; j < BLOCK; j += 4 * VL) {
            m0 = vmax(m0, vload(p + j));
            m1 = vmax(m1, vload(p + j + VL));
            m2 = vmax(m2, vload(p + j + 2 * VL));
            m3 = vmax(m3, vload(p + j + 3 * VL));
        }
        float bm = hmax(vmax(vmax(m0, m1), vmax(m2, m3)));
        if (bm > tv[k - 1]) {
            for (int j = 0; j < BLOCK; j++)
                if (p[j] > tv[k - 1]) top_insert(tv, ti, k, p[j], i + j);
        }
        if (bm > m) RS_RAISE(bm);
        if (!(m > -INFINITY)) continue; /* all -inf so far (or a NaN maximum: NaN whatever is added) */
        const vf mv = vsplat(m);
        for (int j = 0; j < BLOCK; j += 4 * VL) {
            vf e, zc;
            e = vexp(vload(p + j) - mv, &zc);
            a0 += e;
            b0 += e * zc;
            e = vexp(vload(p + j + VL) - mv, &zc);
            a1 += e;
            b1 += e * zc;
            e = vexp(vload(p + j + 2 * VL) - mv, &zc);
            a2 += e;
            b2 += e * zc;
            e = vexp(vload(p + j + 3 * VL) - mv, &zc);
            a3 += e;
            b3 += e * zc;
        }
        pending += BLOCK;
        if (pending >= FLUSH) RS_SPILL();
    }
    int64_t tail = i;
    for (; i < w; i++)
        if (x[i] > tv[k - 1]) top_insert(tv, ti, k, x[i], i);
    if (tv[0] > m) RS_RAISE(tv[0]); /* the maximum was in the tail */
    RS_SPILL();
#undef RS_RAISE
#undef RS_SPILL
    if (m > -INFINITY) {
        vf a = {0}, b = {0};
        const vf mv = vsplat(m);
        exp_range(x, 0, k, mv, &a, &b);
        exp_range(x, tail, w, mv, &a, &b);
        s += hsum_d(a);
        s1 += hsum_d(b);
    }
    *s_out = s;
    *s1_out = s1;
}

__attribute__((noinline)) static void F(rowstats_block)(const float *const *rows, int64_t n, int64_t w,
                                                         const int64_t *tokens, int k, double *log_prob,
                                                         int64_t *top_ids, double *top_lp, double *entropy) {
    for (int64_t r = 0; r < n; r++) {
        const float *x = rows[r];
        float tv[RS_MAX_K];
        int64_t ti[RS_MAX_K];
        double s, s1;
        row_pass(x, w, k, tv, ti, &s, &s1);
        row_finish(x, w, tokens[r], k, tv, ti, s, s1, &log_prob[r], &top_ids[r * k], &top_lp[r * k],
                   &entropy[r]);
    }
}

#undef vf
#undef vi
#undef vf_u
#undef vload
#undef vsplat
#undef vsel
#undef vmax
#undef hmax
#undef hsum_d
#undef vexp
#undef exp_range
#undef row_pass
#undef F
#endif /* RS_TEMPLATE */
