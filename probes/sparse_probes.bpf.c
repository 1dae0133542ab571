/* Sparse-decision probes on ggml's CPU graph ops (appended to token_probes.bpf.c by the loader).
 *
 * Build-time constants (sparseety_prof/bpf_loader.py, per engine build):
 *   T_TYPE T_NE T_NB T_SRC T_DATA T_NAME   offsets in struct ggml_tensor
 *   P_ITH P_NTH                            offsets in struct ggml_compute_params
 *   ACT_BELOW_BITS                         IEEE-754 bits of the activation threshold (> 0)
 *   CAPTURE_ROUTES CAPTURE_PROBS CAPTURE_ACT CAPTURE_MASKS CAPTURE_ATTN   features compiled in
 *
 *   IDS_AT_MUL ACT_AT_MUL HAVE_TASK_STORAGE            read points (sparse.MoePlan), kernel feature
 *
 * Where (cheapest places that see the engine's own values, read when they are fresh):
 *   ggml_compute_forward_mul entry, node "ffn_moe_weighted-L": src[1] = the gate weights as applied
 *     (after normalisation and scaling, whatever the model does); with IDS_AT_MUL the expert ids
 *     from its src[0], the down projection (its ids source), and with ACT_AT_MUL the activation
 *     rows the experts ran on (the down projection's input), counted by every thread;
 *   ggml_compute_forward_get_rows entry, node "ffn_moe_weights-L": src[0] = router probabilities of
 *     all experts, src[1] = the selected expert ids (the engine's top-k, in its order) when they
 *     are not read at the multiply;
 *   ggml_compute_forward_glu return, nodes "ffn_*": the FFN activation, counted by each thread over
 *     the rows it computed (integer-only: zero and below-threshold tests on the float bits), when
 *     not read at the multiply;
 *   ggml_compute_forward_soft_max / flash_attn_ext entry, nodes "kq_soft_max-L" / "__fattn__-L":
 *     the KQ mask the layer applies, counted for the micro-batch's output rows.
 * Entry probes read inputs of the node (complete: every thread passed the previous barrier) on
 * thread 0 only. Names are matched on 8-byte words: no string helpers, no loops.
 */

#if defined(CAPTURE_ROUTES) || defined(CAPTURE_PROBS) || defined(CAPTURE_ACT) || defined(CAPTURE_ATTN)

/* Per-CPU scratch for the blocks being tested (and the output flags of a micro-batch). 2 KiB
 * plus one block: any read size masked with 2047 stays inside it. */
#define SCRATCH_WORDS 320
BPF_PERCPU_ARRAY(scratch, struct { u64 v[SCRATCH_WORDS]; }, 1);

/* A read size the verifier can bound. The AND is written in asm: clang drops a C `&` it can
 * prove redundant and may then pass the unclamped register, which the verifier rejects. */
static __always_inline u64 read_size(u64 n) {
    asm volatile("%[n] &= 2047" : [n] "+r"(n));
    return n;
}
/* Array indices the verifier can bound: an AND in asm survives clang's range reasoning (it
 * drops `& 31` when it knows the value is small, but the verifier does not know that). */
static __always_inline u64 idx_act_row(u64 i) {
    asm volatile("%[i] &= 31" : [i] "+r"(i));
    return i;
}
static __always_inline u64 idx_att_slot(u64 i) {
    asm volatile("%[i] &= 15" : [i] "+r"(i));
    return i;
}
static __always_inline u64 idx_att_row(u64 i) {
    asm volatile("%[i] &= 7" : [i] "+r"(i));
    return i;
}
_Static_assert(ACT_MAX_ROWS == 32 && ATT_MAX_ROWS == 8, "idx_*() mask with literals");

_Static_assert(SCRATCH_WORDS * 8 >= 2048 && BLOCK_WORDS * 8 <= 2048 && ATT_ROW_SCAN <= 2048,
               "reads masked with 2047 must fit the scratch buffer");

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

#ifdef AGG_STEPS
/* The one-row micro-batch being gathered, or NULL (then the probes send records). */
static __always_inline struct ev_step_agg *agg_active(void) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    return a && a->active ? a : 0;
}

static __always_inline u64 idx_agg_layer(u64 i) {
    asm volatile("%[i] &= 127" : [i] "+r"(i));
    return i;
}
_Static_assert(AGG_MAX_LAYERS == 128 && NAME_LEN == 32, "idx_agg_layer(), name_layer() mask with literals");

/* The layer number after the last '-' of a node name ("ffn_moe_swiglu-12" -> 12); -1 if none. */
static __always_inline s32 name_layer(const char *name) {
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
        asm volatile("%[i] &= 31" : [i] "+r"(i)); /* NAME_LEN - 1, kept from clang (see read_size) */
        char c = name[i];
        if (c < '0' || c > '9')
            break;
        v = (v < 0 ? 0 : v * 10) + (c - '0');
    }
    return v < AGG_MAX_LAYERS ? v : -1;
}

/* Expert ids or weights of a one-row micro-batch's layer into the aggregate: a constant-size read
 * of AGG_MAX_K values (a size the verifier must track would split its paths); k > AGG_MAX_K or an
 * unreadable row falls back to a record. Returns 1 when stored. */
static __always_inline int agg_store_layer(struct ev_step_agg *a, s32 layer, u64 data, u32 k, int is_ids) {
    if (layer < 0 || layer >= AGG_MAX_LAYERS || k == 0 || k > AGG_MAX_K)
        return 0;
    u64 l = idx_agg_layer((u64)layer);
    if (is_ids) {
        if (bpf_probe_read_user(&a->ids[l][0], AGG_MAX_K * 4, (void *)data))
            return 0;
        a->k_ids[l] = k;
    } else {
        if (bpf_probe_read_user(&a->wts[l][0], AGG_MAX_K * 4, (void *)data))
            return 0;
        a->k_wts[l] = k;
    }
    return 1;
}

/* the same, the layer taken from the node's name */
static __always_inline int agg_store_row(struct ev_step_agg *a, u64 node, u64 data, u32 k, int is_ids) {
    char name[NAME_LEN] = {};
    bpf_probe_read_user(name, NAME_LEN, (void *)(node + T_NAME));
    return agg_store_layer(a, name_layer(name), data, k, is_ids);
}
#endif

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

#if defined(CAPTURE_ROUTES) || defined(CAPTURE_PROBS)
/* Copy `rows` rows of `row_stride` bytes from `data` into tensor records (small when it fits). */
static __always_inline void emit_tensor(u16 tag, u64 node, u64 data, u32 rows, u32 ne0, u32 row_stride,
                                        u16 type) {
    if (!data || !row_stride || !rows)
        return;
    u64 total = (u64)rows * row_stride;
    if (total <= TENSOR_BYTES_S) {
        u64 seq = next_seq();
        struct ev_tensor_s *e = events.ringbuf_reserve(sizeof(struct ev_tensor_s));
        if (!e) {
            count(1, 1);
            return;
        }
        fill_hdr(&e->t.h, EV_TENSOR, 0, seq);
        bpf_probe_read_user(e->t.name, NAME_LEN, (void *)(node + T_NAME));
        e->t.tag = tag;
        e->t.type = type;
        e->t.row0 = 0;
        e->t.n_rows = rows;
        e->t.rows_total = rows;
        e->t.ne0 = ne0;
        e->t.row_stride = row_stride;
        e->t.n_bytes = (u32)total;
        e->t.pad = 0;
        u32 n = (u32)total & (TENSOR_BYTES_S * 2 - 1);
        if (n > TENSOR_BYTES_S)
            n = TENSOR_BYTES_S;
        bpf_probe_read_user(e->data, n, (void *)data);
        events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
        return;
    }
    u32 per = TENSOR_BYTES_L / row_stride; /* whole rows per large record */
    if (per == 0) {
        count(3, rows);
        return;
    }
    u32 row0 = 0;
    for (int c = 0; c < MAX_TENSOR_CHUNKS; c++) {
        if (row0 >= rows)
            break;
        u32 nr = rows - row0;
        if (nr > per)
            nr = per;
        u64 seq = next_seq();
        struct ev_tensor_l *e = events.ringbuf_reserve(sizeof(struct ev_tensor_l));
        if (!e) {
            count(1, 1);
            row0 += nr;
            continue;
        }
        fill_hdr(&e->t.h, EV_TENSOR, 0, seq);
        bpf_probe_read_user(e->t.name, NAME_LEN, (void *)(node + T_NAME));
        e->t.tag = tag;
        e->t.type = type;
        e->t.row0 = row0;
        e->t.n_rows = nr;
        e->t.rows_total = rows;
        e->t.ne0 = ne0;
        e->t.row_stride = row_stride;
        u32 n = nr * row_stride;
        e->t.n_bytes = n;
        e->t.pad = 0;
        n &= (TENSOR_BYTES_L * 2 - 1);
        if (n > TENSOR_BYTES_L)
            n = TENSOR_BYTES_L;
        bpf_probe_read_user(e->data, n, (void *)(data + (u64)row0 * row_stride));
        events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
        row0 += nr;
    }
    if (row0 < rows)
        count(3, rows - row0);
}

/* get_rows node "ffn_moe_weights-L" = get_rows(probs [1, n_expert, n_tokens], selected [k, n_tokens]) */
int moe_get_rows_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    if (compute_ith(params) != 0)
        return 0;
    u64 name[2] = {};
    bpf_probe_read_user(name, sizeof(name), (void *)(node + T_NAME));
    if (name[0] != 0x5f656f6d5f6e6666ULL /* "ffn_moe_" */ || name[1] != 0x2d73746867696577ULL /* "weights-" */)
        return 0;
#if defined(CAPTURE_ROUTES) && !defined(IDS_AT_MUL)
    u64 ids = rd64(node + T_SRC + 8);
    if (ids) {
        /* a view of the argsort (or top_k) result: k values per row, rows nb[1] apart */
        u32 k = (u32)rd64(ids + T_NE), rows = (u32)rd64(ids + T_NE + 8), nb1 = (u32)rd64(ids + T_NB + 8);
#ifdef AGG_STEPS
        struct ev_step_agg *a = agg_active();
        if (a && rows == 1 && agg_store_row(a, node, rd64(ids + T_DATA), k, 1))
            return 0;
#endif
        emit_tensor(TAG_EXPERT_IDS, node, rd64(ids + T_DATA), rows, k, nb1, (u16)rd32(ids + T_TYPE));
    }
#endif
#ifdef CAPTURE_PROBS
    u64 probs = rd64(node + T_SRC);
    if (probs) {
        u32 n_exp = (u32)rd64(probs + T_NE + 8), rows = (u32)rd64(probs + T_NE + 16);
        u32 nb2 = (u32)rd64(probs + T_NB + 16);
        emit_tensor(TAG_ROUTER_PROBS, node, rd64(probs + T_DATA), rows, n_exp, nb2, (u16)rd32(probs + T_TYPE));
    }
#endif
    return 0;
}

#endif /* CAPTURE_ROUTES || CAPTURE_PROBS */

#ifdef CAPTURE_ACT
struct act_args {
    u64 node; /* 0: no GLU node in flight on this thread */
    s32 ith;
    s32 nth;
};
PER_THREAD(act_args, struct act_args);

int glu_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    u32 w = 0;
    bpf_probe_read_user(&w, sizeof(w), (void *)(node + T_NAME));
    if (w != 0x5f6e6666 /* "ffn_" */)
        return 0;
#ifdef HAVE_TASK_STORAGE
    struct act_args *a = act_args.task_storage_get(CURRENT_TASK, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
#else
    struct act_args zero = {};
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct act_args *a = act_args.lookup_or_try_init(&tid, &zero);
#endif
    if (!a)
        return 0;
    thread_split(params, &a->ith, &a->nth);
    a->node = node;
    return 0;
}

#ifdef CAPTURE_MASKS
#define ACT_LOOP_BLOCKS (ACT_BLOCKS / 2) /* building the mask doubles the verifier's work per block */
#define ACT_EV struct ev_act_mask
#define ACT_KIND EV_ACT_MASK
#define ACT_A(e) (&(e)->a)
#else
#define ACT_LOOP_BLOCKS ACT_BLOCKS
#define ACT_EV struct ev_act
#define ACT_KIND EV_ACT
#define ACT_A(e) (e)
#endif

/* State of one thread's GLU rows across tail calls: each program run counts what its verifier
 * budget allows (ACT_LOOP_BLOCKS blocks, ACT_MAX_ROWS rows), emits a record and tail-calls the
 * next run (up to the kernel's 33 tail calls). Tail calls stay on this CPU, so per-CPU state is
 * safe. */
struct act_state {
    u64 node;
    u64 data;
    u64 nb1;
    u32 ne0;
    u32 ne1;
    u32 nr;
    u32 ir;  /* next row to count */
    u32 ir1; /* end of this thread's rows */
    u32 ith;
};
BPF_PERCPU_ARRAY(act_state, struct act_state, 1);
BPF_PROG_ARRAY(act_tail, 1);
/* The record a run fills: per-CPU, copied into the ring only when it is sent. A one-row
 * micro-batch only adds its totals to the aggregate, and both engine threads count at the same
 * moment: a ring reservation each would contend on the ring's lock for nothing. */
BPF_PERCPU_ARRAY(act_rec, ACT_EV, 1);

/* Send a filled activation record (its sequence number taken now). */
static __always_inline void act_send(ACT_EV *e, struct ev_act *r) {
    r->h.seq = next_seq();
    if (events.ringbuf_output(e, sizeof(ACT_EV), BPF_RB_NO_WAKEUP))
        count(1, 1);
}

static __always_inline int act_chunk(struct pt_regs *ctx, struct act_state *st) {
    u64 node = st->node, data = st->data, nb1 = st->nb1;
    u32 ne0 = st->ne0, ir0 = st->ir, ir1 = st->ir1;
    if (ir0 >= ir1)
        return 0;
    u32 zero = 0;
    ACT_EV *e = act_rec.lookup(&zero);
    if (!e)
        return 0;
    struct ev_act *r = ACT_A(e);
    fill_hdr(&r->h, ACT_KIND, 0, 0);
    bpf_probe_read_user(r->name, NAME_LEN, (void *)(node + T_NAME));
    r->ne0 = ne0;
    r->ne1 = st->ne1;
    r->ir0 = ir0;
    r->nr_total = st->nr;
    r->ith = st->ith;
    r->flags = 0;
    r->pad = 0;
    r->n_rows = 0;
    if (ne0 & 1) {
        r->flags |= ACT_FLAG_ODD_WIDTH;
        count(3, ir1 - ir0);
        act_send(e, r);
        return 0;
    }
    void *sc = scratch.lookup(&zero);
    if (!sc)
        return 0;
    u64 *v = (u64 *)sc;
    /* flat loop over blocks of BLOCK_WORDS float pairs: row rr = b / bpr, its block cb = b % bpr */
    u32 pairs_per_row = ne0 / 2;
    u32 bpr = (pairs_per_row + BLOCK_WORDS - 1) / BLOCK_WORDS;
    u32 rows_here = ir1 - ir0; /* this record's rows: from st->ir */
    if (rows_here > ACT_MAX_ROWS)
        rows_here = ACT_MAX_ROWS;
    u32 n_blocks = rows_here * bpr;
    u32 done_rows = 0;
    /* Counts accumulate in the record, not in registers: clang turns the bit tests into
     * branches, and register accumulators with different ranges on each side would give the
     * verifier a new state per iteration (quadratic work); values in ring-buffer memory are not
     * tracked, so both sides of every test prune to one path. */
    for (u32 b = 0; b < ACT_LOOP_BLOCKS; b++) {
        if (b >= n_blocks)
            break;
        u32 rr = b / bpr, cb = b - rr * bpr;
        u64 ri = idx_act_row(rr);
        if (cb == 0) {
            r->zeros[ri] = 0;
            r->below[ri] = 0;
        }
        /* Reads have a constant size: a size the verifier must track precisely makes every
         * value it derives from precise too, and the paths then never merge. The last block of a
         * row is read ending at the row's end (pairs counted by an earlier block are skipped). */
        u64 p0 = (u64)cb * BLOCK_WORDS, start, vlo, vhi;
        if (p0 + BLOCK_WORDS <= pairs_per_row) {
            start = p0;
            vlo = 0;
            vhi = BLOCK_WORDS;
        } else if (pairs_per_row >= BLOCK_WORDS) {
            start = pairs_per_row - BLOCK_WORDS;
            vlo = p0 - start;
            vhi = BLOCK_WORDS;
        } else { /* a row shorter than a block: read past its end, count only its pairs */
            start = 0;
            vlo = 0;
            vhi = pairs_per_row;
        }
        if (bpf_probe_read_user(v, BLOCK_WORDS * 8, (void *)(data + (u64)(ir0 + rr) * nb1 + start * 8))) {
            r->flags |= ACT_FLAG_FAULT; /* unreadable (end of a mapping): rows stay uncounted */
            break;
        }
#ifdef CAPTURE_MASKS
        u32 wb = (b * 2) & (ACT_BLOCKS * 2 - 1);
        e->bits[wb] = 0;
        e->bits[wb + 1] = 0;
#endif
        u64 span = vhi - vlo;
        if (span != BLOCK_WORDS) {
            /* the words of this block that are not its own (counted by the block before, or past
             * a short row's end) are zeroed: they then count as neither non-zero nor not-below */
            for (u32 p = 0; p < BLOCK_WORDS; p++)
                v[p] &= -IS_LESS((u64)p - vlo, span); /* vlo <= p < vhi, one unsigned compare */
        }
        /* Both floats of a word at once (SWAR): with each lane's magnitude OR 2^31, a lane-wise
         * subtraction cannot borrow across lanes, and a lane's top bit stays set iff |x| >= the
         * subtrahend: 1 tests "non-zero", ACT_BELOW_BITS "not below". The top bits, shifted to
         * bits 0 and 32, add up per lane in one register (at most BLOCK_WORDS per lane). The sums
         * stay in registers for the block and are stored once: straight-line arithmetic, no
         * branch the verifier would have to follow. */
        u64 cnz = 0, cnb = 0;
        for (u32 p = 0; p < BLOCK_WORDS; p++) {
            u64 ax = (v[p] & 0x7fffffff7fffffffULL) | 0x8000000080000000ULL;
            u64 nz = ax - 0x0000000100000001ULL;
            u64 nb = ax - ((ACT_BELOW_BITS << 32) | ACT_BELOW_BITS);
            cnz += (nz >> 31) & 0x0000000100000001ULL;
            cnb += (nb >> 31) & 0x0000000100000001ULL;
#ifdef CAPTURE_MASKS
            e->bits[wb + (p >> 5)] |= (((nz >> 31) & 1) | ((nz >> 63) << 1)) << ((p & 31) * 2);
#endif
        }
        u32 lanes = (u32)span * 2;
        r->zeros[ri] += lanes - (u32)((cnz & 0xffffffff) + (cnz >> 32));
        r->below[ri] += lanes - (u32)((cnb & 0xffffffff) + (cnb >> 32));
        if (cb + 1 == bpr) /* row complete */
            done_rows = rr + 1;
    }
    r->n_rows = done_rows;
    st->ir = ir0 + done_rows;
#ifdef AGG_STEPS
    /* a one-row micro-batch: add this run's totals to the aggregate; the record was scratch */
    struct ev_step_agg *ag = agg_active();
    char nm[NAME_LEN];
    __builtin_memcpy(nm, r->name, NAME_LEN);
    s32 layer = ag ? name_layer(nm) : -1;
    if (ag && layer >= 0 && done_rows > 0 && !(r->flags & ACT_FLAG_FAULT)) {
        u32 tz = 0, tb = 0;
        for (u32 i = 0; i < ACT_MAX_ROWS; i++) {
            if (i >= done_rows)
                break;
            u64 ii = idx_act_row(i);
            tz += r->zeros[ii];
            tb += r->below[ii];
        }
        u64 l = idx_agg_layer((u64)layer);
        __sync_fetch_and_add(&ag->act_zero[l], tz);
        __sync_fetch_and_add(&ag->act_below[l], tb);
        __sync_fetch_and_add(&ag->act_rows[l], done_rows);
        ag->act_nr[l] = st->nr;
        ag->act_ne0[l] = ne0;
        ag->act_slots[l] = (r->name[4] == 'm' && r->name[5] == 'o' && r->name[6] == 'e') ? st->ne1 : 1;
        if (st->ir < ir1) {
            act_tail.call(ctx, 0);
            count(3, ir1 - st->ir);
        }
        return 0;
    }
#endif
    if (done_rows == 0 || (r->flags & ACT_FLAG_FAULT)) {
        r->flags |= ACT_FLAG_BUDGET; /* a row longer than the block budget, or unreadable */
        count(3, ir1 - ir0 - done_rows);
        act_send(e, r);
        return 0;
    }
    act_send(e, r);
    if (st->ir < ir1) {
        act_tail.call(ctx, 0);
        count(3, ir1 - st->ir); /* only reached when the tail call failed (chain limit) */
    }
    return 0;
}

/* A thread's share of a node's rows, split as ggml-cpu splits unary/GLU ops: rows [ir0, ir1)
 * with dr = ceil(nr / nth), ir0 = dr * ith. */
static __always_inline void act_rows(struct act_state *st, u64 node, u64 data, u64 nb1, u32 ne0, u32 ne1, u32 nr,
                                     s32 ith, s32 nth) {
    u32 dr = (nr + nth - 1) / nth;
    u32 ir0 = dr * ith;
    st->node = node;
    st->data = data;
    st->nb1 = nb1;
    st->ne0 = ne0;
    st->ne1 = ne1;
    st->nr = nr;
    st->ir = ir0;
    st->ir1 = ir0 + dr < nr ? ir0 + dr : nr;
    st->ith = (u32)ith;
}

/* At the return of the GLU op each thread counts the rows it computed (act_rows). Blocks of
 * BLOCK_WORDS float pairs are read into a per-CPU scratch buffer and tested on their bits:
 * zero  <=> (bits & 0x7fffffff) == 0;  below <=> (bits & 0x7fffffff) < ACT_BELOW_BITS. */
int glu_return(struct pt_regs *ctx) {
#ifdef HAVE_TASK_STORAGE
    struct act_args *ap = act_args.task_storage_get(CURRENT_TASK, 0, 0);
#else
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct act_args *ap = act_args.lookup(&tid);
#endif
    if (!ap || !ap->node)
        return 0;
    struct act_args a = *ap;
    ap->node = 0;
    u64 node = a.node;
    u32 zero = 0;
    struct act_state *st = act_state.lookup(&zero);
    if (!st)
        return 0;
    /* the node's shape, strides and data pointer in one read */
    struct thdr_buf *hb = thdr.lookup(&zero);
    u64 *h = hb ? tensor_hdr(hb, 0, node) : 0;
    if (!h)
        return 0;
    u32 ne0 = (u32)TH(h, T_NE);
    u32 nr = (u32)(TH(h, T_NE + 8) * TH(h, T_NE + 16) * TH(h, T_NE + 24));
    u64 data = TH(h, T_DATA);
    if (a.nth <= 0 || a.ith < 0 || !data || ne0 == 0)
        return 0;
    act_rows(st, node, data, TH(h, T_NB + 8), ne0, (u32)TH(h, T_NE + 8), nr, a.ith, a.nth);
    return act_chunk(ctx, st);
}

/* The next run of a thread's rows (tail call target). */
int glu_continue(struct pt_regs *ctx) {
    u32 zero = 0;
    struct act_state *st = act_state.lookup(&zero);
    if (!st)
        return 0;
    return act_chunk(ctx, st);
}
#endif /* CAPTURE_ACT */

#if defined(CAPTURE_ROUTES) || defined(ACT_AT_MUL)
/* does [a, a + na) overlap [b, b + nb)? */
static __always_inline int overlaps(u64 a, u64 na, u64 b, u64 nb) { return a < b + nb && b < a + na; }

/* The multiply "ffn_moe_weighted-L" = mul(experts [n_embd, k, n_tokens], weights [1, k, n_tokens]).
 * Its src[1] holds the gate weights as applied (after whatever normalisation and scaling the
 * model does). Its src[0] is the down projection, mul_mat_id(down_exps, act, ids) (or its bias
 * add, add_id(down, bias, ids)): with IDS_AT_MUL the expert ids are read from that ids source,
 * with ACT_AT_MUL each thread counts its share of the activation rows `act` (the GLU output the
 * experts ran on), instead of probing get_rows and the GLU op. Both are intact at this entry:
 * the multiply is the down projection's only consumer and comes right after it; a multiply
 * whose output overlaps them (so another thread could already be writing it) is not read, and
 * its rows are counted as lost. */
int moe_mul_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    u64 name[3] = {};
    bpf_probe_read_user(name, sizeof(name), (void *)(node + T_NAME));
    if (name[0] != 0x5f656f6d5f6e6666ULL /* "ffn_moe_" */ || name[1] != 0x6465746867696577ULL /* "weighted" */ ||
        (name[2] & 0xff) != '-')
        return 0;
    s32 ith = 0, nth = 0;
    thread_split(params, &ith, &nth);
    /* the layer: up to three digits after "ffn_moe_weighted-" (bytes 1-3 of the third word) */
    s32 layer = -1;
    for (int j = 1; j <= 3; j++) {
        u8 c = (u8)(name[2] >> (8 * j));
        if (c < '0' || c > '9')
            break;
        layer = (layer < 0 ? 0 : layer * 10) + (c - '0');
    }
#if defined(IDS_AT_MUL) || defined(ACT_AT_MUL)
    u32 z = 0;
    struct thdr_buf *hb = thdr.lookup(&z);
    if (!hb)
        return 0;
    u64 *hn = tensor_hdr(hb, 0, node);
    if (!hn)
        return 0;
    u64 out = TH(hn, T_DATA), out_n = TH(hn, T_NB + 24) * TH(hn, T_NE + 24);
    u32 rows_w = (u32)(TH(hn, T_NE + 16)); /* tokens of the micro-batch */
    /* the down projection: "ffn_moe_down-L", or "ffn_moe_down_biased-L" whose src[0] it is */
    u64 *he = tensor_hdr(hb, 1, TH(hn, T_SRC));
    u64 *hd = 0;
    if (he && TH_NAME_W(he, 0) == 0x5f656f6d5f6e6666ULL /* "ffn_moe_" */ &&
        (TH_NAME_W(he, 1) & 0xffffffffULL) == 0x6e776f64 /* "down" */) {
        if (((TH_NAME_W(he, 1) >> 32) & 0xff) == '_')
            hd = tensor_hdr(hb, 2, TH(he, T_SRC));
        else
            hd = he;
    }
    if (!hd) { /* not the layout read here: nothing is invented, the rows are counted as lost */
        if (ith == 0)
            count(3, rows_w);
        return 0;
    }
#endif
#ifdef CAPTURE_ROUTES
    if (ith == 0) {
#ifdef AGG_STEPS
        struct ev_step_agg *ag = agg_active();
#endif
#if defined(IDS_AT_MUL) || defined(ACT_AT_MUL)
        u64 *hw = tensor_hdr(hb, 3, TH(hn, T_SRC + 8));
#else
        u32 z = 0;
        struct thdr_buf *hb = thdr.lookup(&z);
        u64 *hw = hb ? tensor_hdr(hb, 3, rd64(node + T_SRC + 8)) : 0;
#endif
        if (hw) {
            u32 k = (u32)TH(hw, T_NE + 8), rows = (u32)TH(hw, T_NE + 16);
            u32 nb1 = (u32)TH(hw, T_NB + 8), nb2 = (u32)TH(hw, T_NB + 16);
            if (nb1 != 4) { /* weights not contiguous within a row: not a layout this probe reads */
                count(3, rows);
            } else {
                u64 wd = TH(hw, T_DATA);
#ifdef AGG_STEPS
                if (!(ag && rows == 1 && agg_store_layer(ag, layer, wd, k, 0)))
#endif
                    emit_tensor(TAG_EXPERT_WEIGHTS, node, wd, rows, k, nb2, (u16)TH(hw, T_TYPE));
            }
        }
#ifdef IDS_AT_MUL
        /* a view of the argsort (or top_k) result: k values per row, rows nb[1] apart */
        u64 *hi = tensor_hdr(hb, 4, TH(he, T_SRC + 16));
        if (hi) {
            u32 k = (u32)TH(hi, T_NE), rows = (u32)TH(hi, T_NE + 8), nb1 = (u32)TH(hi, T_NB + 8);
            u64 idd = TH(hi, T_DATA);
            if (overlaps(idd, (u64)rows * nb1, out, out_n)) {
                count(3, rows);
            } else {
#ifdef AGG_STEPS
                if (!(ag && rows == 1 && agg_store_layer(ag, layer, idd, k, 1)))
#endif
                    emit_tensor(TAG_EXPERT_IDS, node, idd, rows, k, nb1, (u16)TH(hi, T_TYPE));
            }
        } else {
            count(3, rows_w);
        }
#endif
    }
#endif /* CAPTURE_ROUTES */
#ifdef ACT_AT_MUL
    /* the activations: mul_mat_id's src[1], a GLU node "ffn_moe_<op>-L" */
    u64 act = TH(hd, T_SRC + 8);
    u64 *ha = tensor_hdr(hb, 3, act); /* the weights' slot: done with it */
    if (!ha || (u32)TH_NAME_W(ha, 0) != 0x5f6e6666 /* "ffn_" */)
        return 0;
    u32 ne0 = (u32)TH(ha, T_NE);
    u32 nr = (u32)(TH(ha, T_NE + 8) * TH(ha, T_NE + 16) * TH(ha, T_NE + 24));
    u64 data = TH(ha, T_DATA), nb1 = TH(ha, T_NB + 8);
    if (nth <= 0 || ith < 0 || !data || ne0 == 0)
        return 0;
    if (overlaps(data, nb1 * nr, out, out_n)) {
        if (ith == 0)
            count(3, nr);
        return 0;
    }
    struct act_state *st = act_state.lookup(&z);
    if (!st)
        return 0;
    act_rows(st, act, data, nb1, ne0, (u32)TH(ha, T_NE + 8), nr, ith, nth);
    /* counted by the continuation program: verified on its own, not once per path through the
     * routing code above */
    act_tail.call(ctx, 0);
    count(3, st->ir1 - st->ir); /* only reached when the tail call failed */
    return 0;
#else
    return 0;
#endif
}
#endif /* CAPTURE_ROUTES || ACT_AT_MUL */

#ifdef CAPTURE_ATTN
/* ubatch_info (token_probes.bpf.c) gives the micro-batch of the thread that runs graph thread 0.
 * att_seen remembers the masks already counted in that micro-batch: layers of one kind (full or
 * sliding-window) share one mask tensor, so it is counted once per micro-batch, not per layer. */
struct att_seen {
    u64 serial;
    u64 mask[2];
};
BPF_HASH(att_seen, u32, struct att_seen, 4096);

/* want_type: 0 = F32 mask (soft_max), 1 = F16 mask (flash attention). A constant per caller, so
 * each program holds one counting loop (the verifier's budget covers one, not both). */
/* Send the counts of one attention node: into the aggregate of the one-row micro-batch this
 * thread is running (the record was scratch), else as its own record. The sequence number is
 * taken here: a discarded scratch record must not leave a gap the consumer counts as a loss. */
#ifdef AGG_STEPS
/* One attention node into the aggregate, in the order the nodes ran: its mask, its layer from its
 * name (-1 when unnamed), its count and flags. Returns 1 when stored. */
static __always_inline int agg_add_attn(struct ev_step_agg *ag, u64 mask, const char *name, u32 count, u32 flags) {
    u32 n = ag->att_n;
    if (n >= AGG_MAX_LAYERS)
        return 0;
    u64 i = idx_agg_layer((u64)n);
    ag->att_mask[i] = mask;
    ag->att_layer[i] = name[0] ? name_layer(name) : -1;
    ag->att_count[i] = count;
    ag->att_flags[i] = flags;
    ag->att_n = n + 1;
    return 1;
}
#endif

static __always_inline int attn_finish(struct ev_attn *e, u64 serial) {
#ifdef AGG_STEPS
    struct ev_step_agg *ag = agg_active();
    if (ag && ag->serial == serial && !(e->flags & ATT_FLAG_NO_UBATCH)) {
        char nm[NAME_LEN];
        __builtin_memcpy(nm, e->name, NAME_LEN);
        if (agg_add_attn(ag, e->mask, nm, e->attended[0], e->flags | (e->n_counted ? 0 : ATT_FLAG_UNCOUNTED))) {
            events.ringbuf_discard(e, BPF_RB_NO_WAKEUP);
            return 0;
        }
    }
#endif
    e->h.seq = next_seq();
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

/* Count the mask rows of the micro-batch's output rows (the last ATT_MAX_ROWS of its last
 * ATT_ROW_SCAN rows) into e->row / e->attended, and send e. `ub` is the llama_ubatch. */
static __always_inline int attn_count(struct ev_attn *e, u64 mdata, u64 nb1, u64 ub, u64 serial, const s32 want_type) {
    u32 zero = 0;
    void *sc = scratch.lookup(&zero);
    if (!sc) {
        return attn_finish(e, serial);
    }
    u64 *v = (u64 *)sc;
    /* output rows, last first: read the micro-batch's output flags (its last ATT_ROW_SCAN rows) */
    u32 n_tok = 0;
    u64 outp = 0;
    bpf_probe_read_user(&n_tok, sizeof(n_tok), (void *)(ub + UB_N_TOKENS));
    bpf_probe_read_user(&outp, sizeof(outp), (void *)(ub + UB_OUTPUT));
    u32 scan = n_tok < ATT_ROW_SCAN ? n_tok : ATT_ROW_SCAN;
    u32 base = n_tok - scan;
    if (!outp || scan == 0) {
        return attn_finish(e, serial);
    }
    /* constant-size read (see glu_return); flags beyond n_tokens are never looked at */
    if (bpf_probe_read_user(v, ATT_ROW_SCAN, (void *)(outp + base))) {
        e->flags |= ATT_FLAG_BUDGET;
        return attn_finish(e, serial);
    }
    u8 *flags = (u8 *)v;
    /* the last ATT_MAX_ROWS output rows among the last ATT_ROW_SCAN rows, latest first;
     * branch-free (a flag test per row would double the verifier's paths per row) */
    u32 rows[ATT_MAX_ROWS * 2] = {};
    u64 n_out = 0, total_out = 0;
    for (u32 i = 0; i < ATT_ROW_SCAN; i++) {
        u64 in = IS_LESS(i, scan);
        u32 r = (scan - 1 - i) & (ATT_ROW_SCAN - 1);
        u64 f = in & IS_ZERO(flags[r]) ^ in;
        rows[idx_att_slot(n_out)] = base + r;
        u64 take = f & IS_LESS(n_out, ATT_MAX_ROWS);
        n_out += take;
        total_out += f;
    }
    if (total_out > n_out)
        e->flags |= ATT_FLAG_BUDGET;
    /* count: flat loop over blocks of BLOCK_WORDS words of the output rows' mask rows */
    const u32 esz = want_type == 1 ? 2 : 4;
    u32 per_word = 8 / esz;
    u32 wpr = e->n_kv / per_word; /* words per mask row */
    if (e->n_kv % per_word) { /* never seen (KV sizes are padded): not counted rather than guessed */
        e->flags |= ATT_FLAG_BUDGET;
        count(4, n_out);
        return attn_finish(e, serial);
    }
    u32 bpr = (wpr + BLOCK_WORDS - 1) / BLOCK_WORDS;
    if (bpr == 0) {
        return attn_finish(e, serial);
    }
    u32 n_blocks = n_out * bpr;
    u32 done = 0;
    /* counts accumulate in the record (see glu_return for why) */
    for (u32 b = 0; b < ATT_BLOCKS; b++) {
        if (b >= n_blocks)
            break;
        u32 ri = b / bpr, cb = b - ri * bpr;
        u64 rix = idx_att_row(ri);
        u32 row = rows[rix];
        if (cb == 0) {
            e->row[rix] = row;
            e->attended[rix] = 0;
        }
        /* constant-size reads, the last block ending at the row's end (see glu_return); words
         * [vlo, vhi) of the block are this block's (whole words: n_kv % cells-per-word == 0) */
        u64 w0 = (u64)cb * BLOCK_WORDS, start = w0;
        if (w0 + BLOCK_WORDS > wpr)
            start = wpr >= BLOCK_WORDS ? wpr - BLOCK_WORDS : 0;
        u64 vlo = w0 - start, vhi = wpr - start < BLOCK_WORDS ? wpr - start : BLOCK_WORDS;
        u64 span = vhi - vlo;
        if (bpf_probe_read_user(v, BLOCK_WORDS * 8, (void *)(mdata + (u64)row * nb1 + start * 8))) {
            e->flags |= ATT_FLAG_BUDGET;
            break;
        }
        /* attended <=> the cell is not -inf. SWAR over the word's lanes: y = x XOR -inf is 0 in a
         * masked lane; a lane is non-zero iff its top bit or (its other bits OR top) - 1 has the
         * top bit set, which no borrow can carry across lanes. */
        if (esz == 4) {
            for (u32 p = 0; p < BLOCK_WORDS; p++) {
                u64 y = v[p] ^ 0xff800000ff800000ULL;
                u64 t = ((y & 0x7fffffff7fffffffULL) | 0x8000000080000000ULL) - 0x0000000100000001ULL;
                u64 m = (t | y) & 0x8000000080000000ULL;
                e->attended[rix] += (u32)(IS_LESS((u64)p - vlo, span) * (((m >> 31) & 1) + (m >> 63)));
            }
        } else {
            for (u32 p = 0; p < BLOCK_WORDS; p++) {
                u64 y = v[p] ^ 0xfc00fc00fc00fc00ULL;
                u64 t = ((y & 0x7fff7fff7fff7fffULL) | 0x8000800080008000ULL) - 0x0001000100010001ULL;
                u64 m = (t | y) & 0x8000800080008000ULL;
                e->attended[rix] += (u32)(IS_LESS((u64)p - vlo, span) *
                                          (((m >> 15) & 1) + ((m >> 31) & 1) + ((m >> 47) & 1) + (m >> 63)));
            }
        }
        if (cb + 1 == bpr)
            done = ri + 1;
    }
    e->n_counted = done;
    if (done < n_out) {
        e->flags |= ATT_FLAG_BUDGET;
        count(4, n_out - done);
    }
    return attn_finish(e, serial);
}

/* A ring record for one mask, its fields from the mask tensor's header `h` (NULL: no mask),
 * counts filed under `key`; the caller names it. */
static __always_inline struct ev_attn *attn_record(u64 *h, u64 key, u32 flags) {
    struct ev_attn *e = events.ringbuf_reserve(sizeof(struct ev_attn));
    if (!e) {
        count(1, 1);
        return 0;
    }
    fill_hdr(&e->h, EV_ATTN, 0, 0);
    e->attended[0] = 0;
    e->mask = key;
    e->n_kv = h ? (u32)TH(h, T_NE) : 0;
    e->n_rows = h ? (u32)(TH(h, T_NE + 8) * TH(h, T_NE + 16) * TH(h, T_NE + 24)) : 0;
    e->n_counted = 0;
    e->flags = flags | (h && (s32)TH(h, T_TYPE) == 1 ? ATT_FLAG_F16 : 0);
    return e;
}

/* An attention node: `mask_t` is the mask tensor it applies, `key` the data pointer its counts
 * are filed under (the mask's own, or the F32 mask a flash-attention cast was made from). */
static __always_inline int attn_common(struct pt_regs *ctx, u64 node, u64 mask_t, u64 key, const s32 want_type) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
#ifdef AGG_STEPS
    /* The common case, a layer of a one-row micro-batch whose mask an earlier layer counted:
     * straight into the aggregate, without a ring record or the mask's other fields. */
    {
        struct ubatch_info *u = ubatch_info.lookup(&tid);
        struct att_seen *seen = att_seen.lookup(&tid);
        struct ev_step_agg *ag = agg_active();
        if (u && seen && ag && key && seen->serial == u->serial && ag->serial == u->serial &&
            (seen->mask[0] == key || seen->mask[1] == key)) {
            char nm[NAME_LEN] = {};
            bpf_probe_read_user(nm, NAME_LEN, (void *)(node + T_NAME));
            u32 f16 = rd32(mask_t + T_TYPE) == 1 ? ATT_FLAG_F16 : 0;
            if (agg_add_attn(ag, key, nm, 0, ATT_FLAG_CACHED | ATT_FLAG_UNCOUNTED | f16))
                return 0;
        }
    }
#endif
    u32 z = 0;
    struct thdr_buf *hb = thdr.lookup(&z);
    u64 *h = hb ? tensor_hdr(hb, 0, mask_t) : 0;
    struct ev_attn *e = attn_record(h, key, 0);
    if (!e)
        return 0;
    bpf_probe_read_user(e->name, NAME_LEN, (void *)(node + T_NAME));
    u64 mdata = h ? TH(h, T_DATA) : 0;
    s32 mtype = h ? (s32)TH(h, T_TYPE) : -1;
    u64 nb1 = h ? TH(h, T_NB + 8) : 0;
    struct ubatch_info *ui = ubatch_info.lookup(&tid);
    if (!ui) {
        e->flags |= ATT_FLAG_NO_UBATCH;
        return attn_finish(e, 0);
    }
    struct att_seen *sn = att_seen.lookup(&tid);
    if (sn && sn->serial == ui->serial && (sn->mask[0] == key || sn->mask[1] == key)) {
        e->flags |= ATT_FLAG_CACHED;
        return attn_finish(e, ui->serial);
    }
    struct att_seen ns = {};
    ns.serial = ui->serial;
    ns.mask[0] = key;
    if (sn && sn->serial == ui->serial)
        ns.mask[1] = sn->mask[0];
    att_seen.update(&tid, &ns);
    if (!mdata || mtype != want_type) {
        return attn_finish(e, ui->serial);
    }
    return attn_count(e, mdata, nb1, ui->ub, ui->serial, want_type);
}

/* soft_max node "kq_soft_max-L": src[1] = KQ mask (F32 or F16) */
int softmax_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    if (compute_ith(params) != 0)
        return 0;
    u64 name[2] = {};
    bpf_probe_read_user(name, sizeof(name), (void *)(node + T_NAME));
    if (name[0] != 0x5f74666f735f716bULL /* "kq_soft_" */ || (name[1] & 0xffffffff) != 0x2d78616d /* "max-" */)
        return 0;
    u64 mask_t = rd64(node + T_SRC + 8);
    return attn_common(ctx, node, mask_t, mask_t ? rd64(mask_t + T_DATA) : 0, 0);
}

/* flash_attn_ext node ("__fattn__-L" or unnamed): src[3] = KQ mask (F16) */
int fattn_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    if (compute_ith(params) != 0)
        return 0;
    /* Every flash-attention node is an attention layer; builds that leave it unnamed (xllamacpp
     * 2026.10) are matched by order in the consumer, named ones ("__fattn__-L") by name. */
    u64 mask_t = rd64(node + T_SRC + 24);
    u64 key = mask_t ? rd64(mask_t + T_DATA) : 0;
#ifdef CAPTURE_KVMASK
    /* A mask the engine wrote as F32 reaches flash attention through a cast to F16 (same cells,
     * -inf stays -inf): its counts are filed under the F32 mask's data, where kvmask_return
     * counted it too, so the consumer can tell which of those masks this layer applies. */
    u64 src0 = mask_t ? rd64(mask_t + T_SRC) : 0;
    if (src0 && rd32(src0 + T_TYPE) == 0 && rd64(src0 + T_NE) == rd64(mask_t + T_NE))
        key = rd64(src0 + T_DATA);
#endif
    return attn_common(ctx, node, mask_t, key, 1);
}

#ifdef CAPTURE_KVMASK
/* llama_kv_cache::set_input_kq_mask(this, dst, ubatch, causal_attn): the engine writes the KQ
 * mask of a micro-batch into `dst` once, before the graph runs, for every layer that applies it
 * (one call per kind of mask: full attention, sliding window). Counted at its return, this is
 * the same mask the soft_max / flash-attention nodes read, for two probe hits per micro-batch
 * instead of two per layer and thread. Which layers apply which call's mask is learned from
 * the graph-op probes (the consumer detaches those once it knows). A call is named by its
 * order within the micro-batch: "kq_mask-<n>", n = 0, 1, ... */
struct kvm_args {
    u64 dst; /* 0: no call in flight on this thread */
    u64 ub;
    u64 serial; /* micro-batch of the calls counted in n */
    u32 n;
    u32 pad;
};
PER_THREAD(kvm_args, struct kvm_args);
BPF_PROG_ARRAY(kvm_tail, 1);

int kvmask_enter(struct pt_regs *ctx) {
#ifdef HAVE_TASK_STORAGE
    struct kvm_args *a = kvm_args.task_storage_get(CURRENT_TASK, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
#else
    struct kvm_args zero = {};
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct kvm_args *a = kvm_args.lookup_or_try_init(&tid, &zero);
#endif
    if (!a)
        return 0;
    a->dst = PT_REGS_PARM2(ctx);
    a->ub = PT_REGS_PARM3(ctx);
    return 0;
}

static __always_inline int kvmask_count(const s32 want_type) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
#ifdef HAVE_TASK_STORAGE
    struct kvm_args *a = kvm_args.task_storage_get(CURRENT_TASK, 0, 0);
#else
    struct kvm_args *a = kvm_args.lookup(&tid);
#endif
    if (!a || !a->dst)
        return 0;
    u64 dst = a->dst, ub = a->ub;
    a->dst = 0;
    struct ubatch_info *ui = ubatch_info.lookup(&tid);
    if (!ui || !ub) /* not inside a micro-batch: no output rows to count */
        return 0;
    if (a->serial != ui->serial) {
        a->serial = ui->serial;
        a->n = 0;
    }
    u32 slot = a->n;
    a->n = slot + 1;
    u32 z = 0;
    struct thdr_buf *hb = thdr.lookup(&z);
    u64 *h = hb ? tensor_hdr(hb, 0, dst) : 0;
    if (!h || slot > 9)
        return 0;
    s32 mtype = (s32)TH(h, T_TYPE);
    u64 mdata = TH(h, T_DATA);
    struct ev_attn *e = attn_record(h, mdata, ATT_FLAG_KV_MASK);
    if (!e)
        return 0;
    u64 *nm = (u64 *)e->name;
    nm[0] = 0x2d6b73616d5f716bULL; /* "kq_mask-" */
    nm[1] = '0' + slot;
    nm[2] = 0;
    nm[3] = 0;
    if (!mdata || mtype != want_type)
        return attn_finish(e, ui->serial);
    return attn_count(e, mdata, TH(h, T_NB + 8), ub, ui->serial, want_type);
}

/* F32 masks counted here; an F16 one (builds that write the mask as F16) by kvmask_f16: one
 * counting loop per program (the verifier's budget) */
int kvmask_return(struct pt_regs *ctx) {
#ifdef HAVE_TASK_STORAGE
    struct kvm_args *a = kvm_args.task_storage_get(CURRENT_TASK, 0, 0);
#else
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct kvm_args *a = kvm_args.lookup(&tid);
#endif
    if (!a || !a->dst)
        return 0;
    if (rd32(a->dst + T_TYPE) == 1)
        kvm_tail.call(ctx, 0);
    return kvmask_count(0);
}

int kvmask_f16(struct pt_regs *ctx) { return kvmask_count(1); }
#endif /* CAPTURE_KVMASK */
#endif /* CAPTURE_ATTN */

#endif /* any sparse capture */
