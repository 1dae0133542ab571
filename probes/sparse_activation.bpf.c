/* Activation sparsity: how many values of the FFN activations (the GLU outputs) are zero or below
 * the threshold, per row. Appended after sparse_common.bpf.c by the loader when activations are
 * captured.
 *
 * Where: ggml_compute_forward_glu return, nodes "ffn_*": each thread counts the rows it computed
 * (integer-only: zero and below-threshold tests on the float bits); or, with ACT_AT_MUL, the MoE
 * multiply's probe (sparse_moe.bpf.c) hands each thread its share of the activation rows the
 * experts ran on, counted by the same machinery (act_rows, act_state, glu_continue).
 */

/* an index the verifier can bound (see idx_agg_layer) */
static __always_inline u64 idx_act_row(u64 i) {
    asm volatile("%[i] &= 31" : [i] "+r"(i));
    return i;
}
_Static_assert(ACT_MAX_ROWS == 32, "idx_act_row() masks with a literal");

struct act_args {
    u64 node; /* 0: no GLU node in flight on this thread */
    s32 ith;
    s32 nth;
};
PER_THREAD(act_args, struct act_args);

int glu_enter(struct pt_regs *ctx) {
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
#if defined(AGG_STEPS) && defined(CAPTURE_LAYER_TIMES)
    /* the whole name: a one-row pass times the layer's probe point here (agg_layer_time), on
     * every thread, whether or not its activations are counted */
    char name[NAME_LEN] = {};
    bpf_probe_read_user(name, NAME_LEN, (void *)(node + T_NAME));
    u32 w = 0;
    __builtin_memcpy(&w, name, sizeof(w));
#else
    u32 w = 0;
    bpf_probe_read_user(&w, sizeof(w), (void *)(node + T_NAME));
#endif
    if (w != 0x5f6e6666 /* "ffn_" */)
        return 0;
    s32 ith = 0, nth = 0;
    thread_split(params, &ith, &nth);
#if defined(AGG_STEPS) && defined(CAPTURE_LAYER_TIMES)
    struct ev_step_agg *ag = agg_timing();
    if (ag)
        agg_layer_time(ag, name_number(name), ith);
#endif
    if (act_sampled_out())
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
    a->ith = ith;
    a->nth = nth;
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
    if (events.ringbuf_output(e, sizeof(ACT_EV), rb_wake()))
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
