/* Sparse-decision probes on ggml's CPU graph ops: what the decisions' files share. The loader
 * (sparseety_prof/capture/bpf_loader.py, probe_files) appends this file to token_probes.bpf.c when
 * any decision is captured, then the file of each decision captured:
 *   sparse_activation.bpf.c   activation sparsity: zero / near-zero counts of the FFN activations
 *   sparse_moe.bpf.c          MoE routing: expert ids, gate weights, router probabilities
 *   sparse_attention.bpf.c    attention: KQ mask cells attended per output row
 * (BCC rewrites map accesses and exports programs only in its main text: the files are
 * concatenated, not #included). Activations come before MoE: the MoE multiply's probe counts
 * activations with the activation file's machinery when they are read there (ACT_AT_MUL).
 *
 * Build-time constants (the loader, per engine build and capture):
 *   T_TYPE T_NE T_NB T_SRC T_DATA T_NAME   offsets in struct ggml_tensor
 *   P_ITH P_NTH                            offsets in struct ggml_compute_params
 *   ACT_BELOW_BITS                         IEEE-754 bits of the activation threshold (> 0)
 *   CAPTURE_ROUTES CAPTURE_PROBS CAPTURE_ACT CAPTURE_MASKS CAPTURE_ATTN CAPTURE_KVMASK
 *                                          features captured (what the files' #ifs test within)
 *   IDS_AT_MUL ACT_AT_MUL                  MoE read points (capture/plans.py MoePlan)
 *   AGG_STEPS                              one aggregate record per one-row micro-batch
 *   CAPTURE_LAYER_TIMES                    its probe points timed (off: --no-layer-times)
 *   HAVE_TASK_STORAGE                      per-thread state in task storage (token_probes.bpf.c)
 *
 * Entry probes read inputs of the node (complete: every thread passed the previous barrier) on
 * thread 0 only. Names are matched on 8-byte words: no string helpers, no loops.
 */

/* Per-CPU scratch for the blocks being tested and the output flags of a micro-batch: every read
 * into it has a constant size (a size the verifier must track splits its paths), the largest a
 * block of BLOCK_WORDS words. */
#define SCRATCH_WORDS 320
BPF_PERCPU_ARRAY(scratch, struct { u64 v[SCRATCH_WORDS]; }, 1);
_Static_assert(BLOCK_WORDS <= SCRATCH_WORDS && ATT_ROW_SCAN <= SCRATCH_WORDS * 8,
               "constant-size reads must fit the scratch buffer");

/* u64 arithmetic on values below 2^32: (a - 1) >> 63 is 1 iff a == 0; (a - b) >> 63 is 1 iff a < b.
 * Branch-free tests keep the verifier on one path per loop iteration. The shift is written in
 * asm: clang recognises the idiom and turns it back into a compare-and-branch, and each branch
 * then doubles the paths the verifier walks. */
static __always_inline u64 sign_bit(u64 d) {
    asm volatile("%[d] >>= 63" : [d] "+r"(d));
    return d;
}
#define IS_ZERO(a) sign_bit((u64)(a) - 1)
#define IS_LESS(a, b) sign_bit((u64)(a) - (u64)(b))

static __always_inline u64 rd64(u64 addr) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

static __always_inline s32 rd32(u64 addr) {
    s32 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The fields of a ggml_tensor the probes use, [T_TYPE, T_NAME + NAME_LEN), in one read: a
 * bpf_probe_read_user costs about the same for 8 bytes as for 300. Per-CPU slots, one per
 * tensor a probe looks at. */
#define TH_LO T_TYPE
#define TH_WORDS ((T_NAME + NAME_LEN - T_TYPE + 7) / 8)
#define TH_SLOTS 5
_Static_assert(T_TYPE < T_NE && T_NE < T_NB && T_NB < T_SRC && T_SRC < T_DATA && T_DATA < T_NAME,
               "ggml_tensor field order");
_Static_assert(T_TYPE % 8 == 0 && T_NE % 8 == 0 && T_NB % 8 == 0 && T_SRC % 8 == 0 && T_DATA % 8 == 0 &&
                   T_NAME % 8 == 0 && TH_WORDS <= 40,
               "tensor header words");
struct thdr_buf {
    u64 w[TH_SLOTS][40];
};
BPF_PERCPU_ARRAY(thdr, struct thdr_buf, 1);
#define TH(h, off) ((h)[((off) - TH_LO) / 8])
#define TH_NAME_W(h, i) ((h)[(T_NAME - TH_LO) / 8 + (i)])

static __always_inline u64 *tensor_hdr(struct thdr_buf *b, const int slot, u64 t) {
    u64 *h = b->w[slot];
    if (!t || bpf_probe_read_user(h, TH_WORDS * 8, (void *)(t + TH_LO)))
        return 0;
    return h;
}

/* ---- the aggregate of a one-row micro-batch (struct ev_step_agg, token_probes.bpf.c) -------- */
#ifdef AGG_STEPS
/* The one-row micro-batch being gathered, or NULL (then the probes send records). */
static __always_inline struct ev_step_agg *agg_active(void) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    return a && a->active && a->active != AGG_TIMES_ONLY ? a : 0;
}

/* The micro-batch whose layer times are gathered (every one, whatever its rows), or NULL. */
static __always_inline struct ev_step_agg *agg_timing(void) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    return a && a->active ? a : 0;
}
#else
/* Not compiled in (router probabilities or masks captured, or no routes or activations): every
 * probe sends its records, and the aggregate's paths fold away at compile time. */
static __always_inline struct ev_step_agg *agg_active(void) { return 0; }
#endif

/* The pass running leaves its activations uncounted: a one-row pass (active = 2) by --act-every
 * (agg_begin), or because its request drew drop in head sampling (agg_head_drop); a pass of
 * several rows whose every row's request drew drop (head_pass_drop). The activation probes
 * return at once. */
static __always_inline int act_sampled_out(void) {
#if defined(AGG_STEPS) && (defined(ACT_EVERY) || defined(HEAD_KEEP_BELOW))
    struct ev_step_agg *a = agg_active();
    if (a && a->active == 2)
        return 1;
#endif
#ifdef HEAD_KEEP_BELOW
    int k = 0;
    u64 *pd = head_pass_drop.lookup(&k);
    if (pd && *pd)
        return 1;
#endif
    return 0;
}

/* Array indices the verifier can bound: an AND in asm survives clang's range reasoning (it drops
 * a C `&` when it knows the value is small, but the verifier does not know that). */
#define AGG_STR_(x) #x
#define AGG_STR(x) AGG_STR_(x)
static __always_inline u64 idx_agg_layer(u64 i) {
    asm volatile("%[i] &= " AGG_STR(AGG_LAYER_MASK) : [i] "+r"(i));
    return i;
}
_Static_assert(AGG_LAYER_MASK + 1 == AGG_LAYERS && (AGG_LAYERS & AGG_LAYER_MASK) == 0 && AGG_LAYERS <= AGG_MAX_LAYERS,
               "AGG_LAYERS: a power of two up to AGG_MAX_LAYERS, AGG_LAYER_MASK its mask");
_Static_assert(NAME_LEN == 32, "name_layer() masks with a literal");

/* The number after the last '-' of a node name ("ffn_moe_swiglu-12" -> 12, up to three digits);
 * -1 if none. */
static __always_inline s32 name_number(const char *name) {
    s32 dash = -1;
    for (int i = 0; i < NAME_LEN; i++) {
        if (name[i] == 0)
            break;
        if (name[i] == '-')
            dash = i;
    }
    if (dash < 0)
        return -1;
    s32 v = -1;
    for (int j = 1; j <= 3; j++) {
        u64 i = (u64)(dash + j);
        asm volatile("%[i] &= 31" : [i] "+r"(i)); /* NAME_LEN - 1, kept from clang (see idx_agg_layer) */
        char c = name[i];
        if (c < '0' || c > '9')
            break;
        v = (v < 0 ? 0 : v * 10) + (c - '0');
    }
    return v;
}

/* The same, as an index into the aggregate record's per-layer arrays: -1 when none, or past them. */
static __always_inline s32 name_layer(const char *name) {
    s32 v = name_number(name);
    return v < AGG_LAYERS ? v : -1;
}

/* ---- layer times: the probe points of a micro-batch, timed (struct ev_step_agg) ------------- */
#ifdef AGG_STEPS
static __always_inline u64 idx_lt_thread(u64 i) {
    asm volatile("%[i] &= " AGG_STR(LT_THREAD_MASK) : [i] "+r"(i));
    return i;
}
_Static_assert(LT_THREAD_MASK + 1 == LT_THREADS && (LT_THREADS & LT_THREAD_MASK) == 0,
               "LT_THREADS: a power of two, LT_THREAD_MASK its mask");

/* Graph thread `ith` reached a probe point of model layer `layer` (a node's name number, -1:
 * none): the first such time in the pass is kept, as ns after the pass began. Each slot is
 * written by its own thread only (a thread index is one thread's within a pass). What cannot be
 * kept is counted in lt_lost, never dropped unsaid. */
static __always_inline void agg_layer_time(struct ev_step_agg *a, s32 layer, s32 ith) {
#ifdef CAPTURE_LAYER_TIMES /* off (--no-layer-times): no clock read on the engine's thread */
    if (layer < 0)
        return; /* not a layer's node */
    u64 d = bpf_ktime_get_ns() - a->t0_ns;
    if (layer >= AGG_LAYERS || ith < 0 || ith >= LT_THREADS || d == 0 || d > 0xffffffffULL) {
        __sync_fetch_and_add(&a->lt_lost, 1);
        return;
    }
    u64 t = idx_lt_thread((u64)ith), l = idx_agg_layer((u64)layer);
    if (!a->lt_off[t][l]) {
        a->lt_off[t][l] = (u32)d;
        a->lt_tid[t] = (u32)bpf_get_current_pid_tgid();
    }
#endif
}
#endif

/* ---- graph nodes ----------------------------------------------------------------------------- */
/* thread index of a compute call: the probes that read inputs run on thread 0 only */
static __always_inline s32 compute_ith(u64 params) { return rd32(params + P_ITH); }

/* thread index and count of a compute call (one read where they are adjacent) */
static __always_inline void thread_split(u64 params, s32 *ith, s32 *nth) {
#if P_NTH == P_ITH + 4
    s32 th[2] = {};
    bpf_probe_read_user(th, sizeof(th), (void *)(params + P_ITH));
    *ith = th[0];
    *nth = th[1];
#else
    *ith = rd32(params + P_ITH);
    *nth = rd32(params + P_NTH);
#endif
}
