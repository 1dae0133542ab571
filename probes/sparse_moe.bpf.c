/* MoE routing: which experts each row was sent to (expert ids), with which gate weights, and
 * optionally the router's probabilities of every expert. Appended after sparse_common.bpf.c and
 * sparse_activation.bpf.c by the loader when routes or router probabilities are captured, or when
 * activations are read at the MoE multiply (ACT_AT_MUL).
 *
 * Where (cheapest places that see the engine's own values, read when they are fresh):
 *   ggml_compute_forward_get_rows entry, node "ffn_moe_weights-L": src[0] = router probabilities of
 *     all experts, src[1] = the selected expert ids (the engine's top-k, in its order) when they
 *     are not read at the multiply;
 *   ggml_compute_forward_mul entry, node "ffn_moe_weighted-L": src[1] = the gate weights as applied
 *     (after normalisation and scaling, whatever the model does); with IDS_AT_MUL the expert ids
 *     from its src[0], the down projection (its ids source), and with ACT_AT_MUL the activation
 *     rows the experts ran on (the down projection's input), counted by every thread with
 *     sparse_activation.bpf.c's machinery (act_rows, act_state, act_tail).
 */

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
        events.ringbuf_submit(e, rb_wake());
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
        events.ringbuf_submit(e, rb_wake());
        row0 += nr;
    }
    if (row0 < rows)
        count(3, rows - row0);
}

/* Expert ids or weights of a one-row micro-batch's layer into the aggregate: a constant-size read
 * of AGG_MAX_K values (a size the verifier must track would split its paths); k > AGG_MAX_K or an
 * unreadable row falls back to a record. Returns 1 when stored. */
static __always_inline int agg_store_layer(struct ev_step_agg *a, s32 layer, u64 data, u32 k, int is_ids) {
    if (layer < 0 || layer >= AGG_LAYERS || k == 0 || k > AGG_MAX_K)
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

#if defined(CAPTURE_ROUTES) || defined(CAPTURE_PROBS)
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
        struct ev_step_agg *a = agg_active();
        if (a && rows == 1 && agg_store_row(a, node, rd64(ids + T_DATA), k, 1))
            return 0;
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

/* does [a, a + na) overlap [b, b + nb)? */
static __always_inline int overlaps(u64 a, u64 na, u64 b, u64 nb) { return a < b + nb && b < a + na; }

/* A multiply's gate weights (`hw`: its src[1]), into the aggregate or a record. */
static __always_inline void moe_weights(struct ev_step_agg *ag, s32 layer, u64 node, u64 *hw) {
    if (!hw)
        return;
    u32 k = (u32)TH(hw, T_NE + 8), rows = (u32)TH(hw, T_NE + 16);
    u32 nb1 = (u32)TH(hw, T_NB + 8), nb2 = (u32)TH(hw, T_NB + 16);
    if (nb1 != 4) { /* weights not contiguous within a row: not a layout this probe reads */
        count(3, rows);
        return;
    }
    u64 wd = TH(hw, T_DATA);
    if (!(ag && rows == 1 && agg_store_layer(ag, layer, wd, k, 0)))
        emit_tensor(TAG_EXPERT_WEIGHTS, node, wd, rows, k, nb2, (u16)TH(hw, T_TYPE));
}

/* The expert ids at a multiply (`hi`: the down projection's ids source, a view of the argsort or
 * top_k result: k values per row, rows nb[1] apart), unless they overlap the multiply's output
 * [out, out + out_n); `rows_w` rows are counted as lost when there is no ids source. */
static __always_inline void moe_ids_at_mul(struct ev_step_agg *ag, s32 layer, u64 node, u64 *hi, u64 out, u64 out_n,
                                           u32 rows_w) {
    if (hi) {
        u32 k = (u32)TH(hi, T_NE), rows = (u32)TH(hi, T_NE + 8), nb1 = (u32)TH(hi, T_NB + 8);
        u64 idd = TH(hi, T_DATA);
        if (overlaps(idd, (u64)rows * nb1, out, out_n))
            count(3, rows);
        else if (!(ag && rows == 1 && agg_store_layer(ag, layer, idd, k, 1)))
            emit_tensor(TAG_EXPERT_IDS, node, idd, rows, k, nb1, (u16)TH(hi, T_TYPE));
    } else {
        count(3, rows_w);
    }
}

#if defined(CAPTURE_ROUTES) || defined(ACT_AT_MUL)
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
#if defined(AGG_STEPS) && defined(CAPTURE_LAYER_TIMES)
    {
        /* the layer's probe point, timed on every thread (kept only where none came earlier in
         * the layer: the GLU's, when its probe is attached too) */
        struct ev_step_agg *ag = agg_timing();
        if (ag)
            agg_layer_time(ag, layer, ith);
    }
#endif
    /* Thread 0 reads the routing; the other threads only count their share of the activations.
     * Where there are none to count (not captured, or a pass --act-every or a head-dropped
     * request leaves uncounted) they return before the tensor headers: three user reads a layer
     * that led nowhere. */
#ifdef ACT_AT_MUL
    if (ith != 0 && act_sampled_out())
        return 0;
#else
    if (ith != 0)
        return 0;
#endif
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
        struct ev_step_agg *ag = agg_active();
#if defined(IDS_AT_MUL) || defined(ACT_AT_MUL)
        u64 *hw = tensor_hdr(hb, 3, TH(hn, T_SRC + 8));
#else
        u32 z = 0;
        struct thdr_buf *hb = thdr.lookup(&z);
        u64 *hw = hb ? tensor_hdr(hb, 3, rd64(node + T_SRC + 8)) : 0;
#endif
        moe_weights(ag, layer, node, hw);
#ifdef IDS_AT_MUL
        moe_ids_at_mul(ag, layer, node, tensor_hdr(hb, 4, TH(he, T_SRC + 16)), out, out_n, rows_w);
#endif
    }
#endif /* CAPTURE_ROUTES */
#ifdef ACT_AT_MUL
    if (act_sampled_out())
        return 0;
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
#endif
    return 0;
}
#endif /* CAPTURE_ROUTES || ACT_AT_MUL */
