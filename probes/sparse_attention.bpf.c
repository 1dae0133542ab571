/* Attention: how many cells of the KQ mask each output row attends (cells not -inf), per mask.
 * Appended after sparse_common.bpf.c (and the other decisions' files) by the loader when
 * attention is captured.
 *
 * Where: ggml_compute_forward_soft_max / flash_attn_ext entry, nodes "kq_soft_max-L" /
 * "__fattn__-L": the KQ mask the layer applies, counted for the micro-batch's output rows; with
 * CAPTURE_KVMASK also where the engine writes each mask (set_input_kq_mask), which lets the
 * consumer detach the per-layer probes once it knows which mask each layer applies.
 */

/* indices the verifier can bound (see idx_agg_layer) */
static __always_inline u64 idx_att_slot(u64 i) {
    asm volatile("%[i] &= 15" : [i] "+r"(i));
    return i;
}
static __always_inline u64 idx_att_row(u64 i) {
    asm volatile("%[i] &= 7" : [i] "+r"(i));
    return i;
}
_Static_assert(ATT_MAX_ROWS == 8, "idx_att_*() mask with literals");

/* ubatch_info (token_probes.bpf.c) gives the micro-batch of the thread that runs graph thread 0.
 * att_seen remembers the masks already counted in that micro-batch: layers of one kind (full or
 * sliding-window) share one mask tensor, so it is counted once per micro-batch, not per layer. */
struct att_seen {
    u64 serial;
    u64 mask[2];
};
BPF_HASH(att_seen, u32, struct att_seen, 4096);

/* One attention node into the aggregate, in the order the nodes ran: its mask, its layer from its
 * name (-1 when unnamed), its count and flags. Returns 1 when stored. */
static __always_inline int agg_add_attn(struct ev_step_agg *ag, u64 mask, const char *name, u32 count, u32 flags) {
    u32 n = ag->att_n;
    if (n >= AGG_LAYERS)
        return 0;
    s32 layer = name[0] ? name_number(name) : -1;
    if (layer >= AGG_LAYERS)
        return 0; /* a layer the record's numbering stops short of: sent as its own record */
    u64 i = idx_agg_layer((u64)n);
    ag->att_mask[i] = mask;
    ag->att_layer[i] = layer;
    ag->att_count[i] = count;
    ag->att_flags[i] = flags;
    ag->att_n = n + 1;
    return 1;
}

/* Send the counts of one attention node: into the aggregate of the one-row micro-batch this
 * thread is running (the record was scratch), else as its own record. The sequence number is
 * taken here: a discarded scratch record must not leave a gap the consumer counts as a loss. */
static __always_inline int attn_finish(struct ev_attn *e, u64 serial) {
    struct ev_step_agg *ag = agg_active();
    if (ag && ag->serial == serial && !(e->flags & ATT_FLAG_NO_UBATCH)) {
        char nm[NAME_LEN];
        __builtin_memcpy(nm, e->name, NAME_LEN);
        if (agg_add_attn(ag, e->mask, nm, e->attended[0], e->flags | (e->n_counted ? 0 : ATT_FLAG_UNCOUNTED))) {
            events.ringbuf_discard(e, BPF_RB_NO_WAKEUP);
            return 0;
        }
    }
    e->h.seq = next_seq();
    events.ringbuf_submit(e, rb_wake());
    return 0;
}

/* Count the mask rows of the micro-batch's output rows (the last ATT_MAX_ROWS of its last
 * ATT_ROW_SCAN rows) into e->row / e->attended, and send e. `ub` is the llama_ubatch.
 * want_type: 0 = F32 mask (soft_max), 1 = F16 mask (flash attention). A constant per caller, so
 * each program holds one counting loop (the verifier's budget covers one, not both). */
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
     * straight into the aggregate, without a ring record or the mask's other fields. (An #ifdef
     * rather than agg_active() alone: the map lookups before its test would stay in programs
     * compiled without the aggregate.) */
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
