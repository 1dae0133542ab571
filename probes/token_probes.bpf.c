/* Token-boundary probes for llama.cpp engines (BCC; compiled at attach time).
 *
 * Build-time constants (set by sparseety_prof/capture/bpf_loader.py with -D, per engine build):
 *   UB_N_TOKENS UB_TOKEN UB_POS UB_N_SEQ_ID UB_SEQ_ID UB_OUTPUT  offsets in struct llama_ubatch
 *   N_VOCAB                                                      floats per logits row
 *   RB_PAGES                                                     ring buffer size in pages
 *
 * The sparse-decision files (sparse_common.bpf.c, then one per decision captured) and
 * server_probes.bpf.c are appended to this text by the loader (BCC rewrites map accesses and
 * exports programs only in the main source text, so they cannot be #included).
 *
 * Cost discipline: everything here copies raw bits; no floating point, no per-token maps
 * beyond the per-thread argument stash needed to pair entry and return probes. Records are
 * submitted without waking the reader (rb_wake(): BPF_RB_NO_WAKEUP): a wakeup per record costs
 * the engine an interrupt each time, while the reader drains on its own clock anyway. The one
 * exception is the ring watch (sparseety_prof/session/ring_watch.py), which sleeps in epoll on the
 * ring instead of polling it: the consumer arms it after each drain with the record sequence number
 * at which the ring will be about RING_WAKE_FILL full (ring_watch[0], from its mean record size),
 * and the first record submitted past that number wakes it, once, and disarms it. (The kernel's
 * backlog itself, bpf_ringbuf_query, needs the map's address, which BCC 0.26 cannot give.)
 */
#include <uapi/linux/ptrace.h>
#include "events.h"

BPF_RINGBUF_OUTPUT(events, RB_PAGES);

/* counters[0] = next record sequence number, [1] = records dropped (reserve failed),
 * [2] = ubatch rows not copied (micro-batch larger than MAX_UB_TOK),
 * [3] = sparse-decision rows not captured (beyond a record or counting budget),
 * [4] = attention output rows not counted (beyond ATT_MAX_ROWS / ATT_BLOCKS),
 * [5] = logits rows not copied: every output of their decode drew "drop" (head sampling, HEAD_KEEP_BELOW),
 * [6] = logits rows copied whose decode's outputs drew both keep and drop (head sampling) */
BPF_ARRAY(counters, u64, 8);

struct sampler_state {
    u64 ctx;
    s32 idx;
    u32 kind;
    u32 depth;
};
BPF_HASH(in_sampler, u32, struct sampler_state, 4096);

struct logits_args {
    u64 ctx;
    s32 idx;
};
BPF_HASH(logits_args, u32, struct logits_args, 4096);
/* the micro-batch a thread is running (process_ubatch entry to return) */
struct ubatch_info {
    u64 lctx;
    u64 ub;
    u64 serial; /* sequence number of its EV_UBATCH record */
};
BPF_HASH(ubatch_info, u32, struct ubatch_info, 4096);



/* State a thread keeps from a function's entry to its return: task-local storage where the kernel
 * has it for tracing programs (5.11+; the loader defines HAVE_TASK_STORAGE), a lookup in the task
 * itself and several times cheaper than a hash map update and delete per call; else a hash map
 * keyed by thread id. (BCC rewrites map calls only outside macros: users write both forms.) */
#ifdef HAVE_TASK_STORAGE
#define PER_THREAD(name, type) BPF_TASK_STORAGE(name, type)
#define CURRENT_TASK ((struct task_struct *)bpf_get_current_task_btf())
#else
#define PER_THREAD(name, type) BPF_HASH(name, u32, type, 4096)
#endif

static __always_inline u64 next_seq(void) {
    int k = 0;
    u64 *v = counters.lookup(&k);
    return v ? __sync_fetch_and_add(v, 1) : 0;
}

/* ring_watch[0]: the record sequence number from which a record wakes the ring watch; 0 when
 * disarmed. Two producers on two CPUs may both see it and both wake the watch: one wakeup too
 * many, no harm, and no atomic exchange needed (older kernels' verifiers lack it). */
BPF_ARRAY(ring_watch, u64, 1);

/* The flags a record is submitted with: a wakeup only for the first record past the mark (two
 * array reads otherwise). */
static __always_inline u64 rb_wake(void) {
    int k = 0;
    u64 *at = ring_watch.lookup(&k);
    if (!at || !*at)
        return BPF_RB_NO_WAKEUP;
    u64 *next = counters.lookup(&k);
    if (!next || *next < *at)
        return BPF_RB_NO_WAKEUP;
    *at = 0;
    return BPF_RB_FORCE_WAKEUP;
}

static __always_inline void count(int k, u64 n) {
    u64 *v = counters.lookup(&k);
    if (v)
        __sync_fetch_and_add(v, n);
}

static __always_inline void fill_hdr(struct ev_hdr *h, u16 kind, u64 ctx, u64 seq) {
    h->seq = seq;
    h->ts_ns = bpf_ktime_get_ns();
    h->ctx = ctx;
    h->tid = (u32)bpf_get_current_pid_tgid();
    h->kind = kind;
    h->flags = 0;
}

static __always_inline void emit_small(u16 kind, u64 ctx, s32 a, s32 b, s32 c, u64 ptr) {
    u64 seq = next_seq();
    struct ev_small *e = events.ringbuf_reserve(sizeof(struct ev_small));
    if (!e) {
        count(1, 1);
        return;
    }
    fill_hdr(&e->h, kind, ctx, seq);
    e->a = a;
    e->b = b;
    e->c = c;
    e->pad = 0;
    e->ptr = ptr;
    events.ringbuf_submit(e, rb_wake());
}

#ifdef AGG_STEPS
/* The one-row micro-batch being gathered (see struct ev_step_agg). */
BPF_ARRAY(step_agg, struct ev_step_agg, 1);
#ifdef ACT_EVERY
BPF_ARRAY(act_passes, u64, 1); /* one-row passes begun (--act-every) */
#endif

/* t0: the step's start, its EV_UBATCH record's timestamp (the layer times count from it). */
static __always_inline void agg_begin(u32 n_tokens, u64 serial, u64 t0) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    if (!a)
        return;
    if (a->active) { /* another micro-batch is running: neither can be attributed */
        a->overlap = 1;
        return;
    }
    /* every pass: its layer times (sent in this record; a pass of several rows sends nothing else
     * in it, its sparse probes send their own records). Without them (--no-layer-times) the
     * slots stay as the map made them: zero */
#ifdef CAPTURE_LAYER_TIMES
    for (int i = 0; i < AGG_LAYERS; i++) {
        for (int t = 0; t < LT_THREADS; t++)
            a->lt_off[t][i] = 0;
        asm volatile("" ::: "memory"); /* keeps clang from turning the loop into memset() */
    }
    for (int t = 0; t < LT_THREADS; t++)
        a->lt_tid[t] = 0;
#endif
    a->t0_ns = t0;
    a->lt_lost = 0;
    a->serial = serial;
    a->overlap = 0;
    if (n_tokens != 1) {
#ifdef CAPTURE_LAYER_TIMES
        a->active = AGG_TIMES_ONLY;
#endif
        return; /* without layer times a pass of several rows has nothing to send here */
    }
    for (int i = 0; i < AGG_LAYERS; i++) {
        a->k_ids[i] = 0;
        a->k_wts[i] = 0;
        a->act_zero[i] = 0;
        a->act_below[i] = 0;
        a->act_rows[i] = 0;
        a->act_nr[i] = 0;
        asm volatile("" ::: "memory"); /* keeps clang from turning the loop into memset() */
    }
    a->att_n = 0;
    a->active = 1;
#ifdef ACT_EVERY
    /* --act-every: the activations of one one-row pass in ACT_EVERY are counted; the others are
     * gathered as usual (routing, attention) with active = 2, which the activation probes skip.
     * Passes are counted here, not by record sequence numbers: a step's records are a fixed
     * number, which would alias with ACT_EVERY. */
    u64 *n = act_passes.lookup(&k);
    if (n) {
        u64 c = *n; /* one pass at a time (an overlap is not gathered): no atomic needed */
        *n = c + 1;
        if (c % ACT_EVERY)
            a->active = 2;
    }
#endif
}

static __always_inline void agg_end(u64 serial, u64 lctx) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    if (!a || !a->active || a->serial != serial)
        return;
    fill_hdr(&a->h, EV_STEP_AGG, lctx, next_seq());
    if (events.ringbuf_output(a, sizeof(*a), rb_wake()))
        count(1, 1);
    a->active = 0;
}

#ifdef HEAD_KEEP_BELOW
/* The one-row pass `serial` is of a request head sampling dropped: its activations are not
 * counted (active = 2, as --act-every's uncounted passes: counting them is the costliest probe
 * work per token), its routing is (the always-on aggregates' expert load). */
static __always_inline void agg_head_drop(u64 serial) {
    int k = 0;
    struct ev_step_agg *a = step_agg.lookup(&k);
    if (a && a->active == 1 && a->serial == serial)
        a->active = 2;
}
#endif
#endif

#ifdef HEAD_KEEP_BELOW
/* ---- head sampling in the probes (--policy head:RATE alone: session/policy.py probe_head_rate)
 * For a request head sampling drops, the probes copy no logits row: 97% of a decode step's bytes,
 * and the consumer's costliest per-token work. Each (context, sequence) draws keep or drop at its
 * output rows, as micro-batches list them (whatever the decode's entry point: llama_batch or
 * llama_batch_ext): bpf_get_prandom_u32() below HEAD_KEEP_BELOW (RATE * 2^32) keeps. It draws
 * again when the row's position does not continue the sequence's last output (the next
 * position, or the same one): a new prompt, or a sequence cut back, starts a new request. Each
 * draw is sent (EV_HEAD_DRAW); the consumer keeps a request when the draw its first token saw kept
 * it (correlate/request_tokens.py). A sampler's row is copied unless every output of the decode
 * drew drop (head_keeps): with one sequence per decode (llama-cpp-python and most front ends)
 * exactly the kept requests' rows; on a server whose decode mixes slots, a dropped request's
 * row is copied when a kept one shares its decode, and dropped with its request by the consumer.
 * Up to HEAD_OUTS outputs per decode, found among the last HEAD_SCAN rows of each micro-batch
 * (where prompts have theirs): a decode with more is copied whole. */
#define HEAD_OUTS 64
#define HEAD_SCAN 64
_Static_assert((HEAD_OUTS & (HEAD_OUTS - 1)) == 0 && (UB_SMALL_TOK & (UB_SMALL_TOK - 1)) == 0 &&
                   (MAX_UB_TOK & (MAX_UB_TOK - 1)) == 0,
               "head sampling masks its indices: powers of two");
/* i & mask in asm: clang checks a bound on one copy of an index and indexes with another, which
 * the verifier cannot follow; the AND on the register used survives (see idx_agg_layer) */
#define HEAD_MASK(i, mask) asm volatile("%[v] &= %[m]" : [v] "+r"(i) : [m] "i"(mask))
struct head_rows {
    u32 n_out;  /* outputs listed */
    u32 n_keep; /* of which drew keep */
    u32 overflow; /* more outputs than listed: the decode is copied whole */
    u32 pad;
    s32 seq[HEAD_OUTS];
    s32 pos[HEAD_OUTS];
};
BPF_HASH(head_rows, u64, struct head_rows, 1024);
BPF_PERCPU_ARRAY(head_zero, struct head_rows, 1); /* never written: a zero value to insert */
struct head_key {
    u64 ctx;
    s32 seq;
    u32 pad;
};
struct head_seq {
    s32 last_pos; /* position of the sequence's last sampled row */
    u32 keep;
};
/* least recently used sequences make room: one forgotten draws again at its next row */
BPF_TABLE("lru_hash", struct head_key, struct head_seq, head_seqs, 16384);
/* A pass of several rows that is all a dropped request's or requests' (head_drops_pass): its
 * activations are not counted (act_sampled_out), as a one-row pass's are not (agg_head_drop), and
 * its end record says so (EV_UBATCH_END a = 1: the consumer counts it). The pass's serial, 0 when
 * none. One value for the process: a pass that overlaps another (a second context) resets it, and
 * its records cannot be attributed to either pass anyway. */
BPF_ARRAY(head_pass_drop, u64, 1);

/* Whether a micro-batch of n > 1 rows, ub_out of them outputs (listed in `hr` from out0, none of
 * which drew keep), is all dropped requests' rows: every row an output (a server's decode step
 * over slots whose requests all drew drop), or every row one sequence's and that sequence's alone
 * (`one_seq`: the rows' sequence, -1 when they are not one's: HEAD_ROW below) and its outputs
 * drew drop: a dropped request's prompt. Any other prompt row may be a kept request's. */
static __always_inline int head_drops_pass(struct head_rows *hr, u32 out0, u32 n, u32 ub_out, s32 one_seq) {
    if (n <= 1 || !ub_out)
        return 0;
    if (ub_out == n)
        return 1;
    u64 o = out0;
    if (o >= HEAD_OUTS || one_seq < 0)
        return 0;
    HEAD_MASK(o, HEAD_OUTS - 1);
    return hr->seq[o] == one_seq;
}

/* A decode call begins: its outputs are listed afresh. */
static __always_inline void head_decode(u64 lctx) {
    struct head_rows *h = head_rows.lookup(&lctx);
    if (h) {
        h->n_out = 0;
        h->n_keep = 0;
        h->overflow = 0;
        return;
    }
    int k = 0;
    struct head_rows *z = head_zero.lookup(&k);
    if (z)
        head_rows.update(&lctx, z);
}

/* The output rows of micro-batch record `e` (ROWS rows) into `h` (a macro, as the two records
 * differ in their array sizes only; the caller looks `h` up: BCC takes no map call in a macro). */
#define HEAD_OUTPUTS(h, e, ROWS)                                                             \
    do {                                                                                        \
        u32 m = e->n_copied;                                                                    \
        u32 lo = m > HEAD_SCAN ? m - HEAD_SCAN : 0;                                             \
        for (u32 j = 0; j < HEAD_SCAN; j++) {                                                   \
            u64 i = lo + j;                                                                     \
            if (i >= m || i >= (ROWS))                                                          \
                break;                                                                          \
            HEAD_MASK(i, (ROWS) - 1);                                                           \
            if (!e->output[i])                                                                  \
                continue;                                                                       \
            u64 o = h->n_out;                                                                   \
            if (o >= HEAD_OUTS) {                                                               \
                h->overflow = 1;                                                                \
                break;                                                                          \
            }                                                                                   \
            HEAD_MASK(o, HEAD_OUTS - 1);                                                        \
            h->seq[o] = e->seq[i];                                                              \
            h->pos[o] = e->pos[i];                                                              \
            h->n_out = o + 1;                                                                   \
        }                                                                                       \
    } while (0)

/* The draw of output o of the decode listed in h: the sequence's last one when the row continues
 * it, else a new one, sent (EV_HEAD_DRAW). */
static __always_inline u32 head_draw(u64 lctx, s32 seq, s32 pos) {
    struct head_key k = {};
    k.ctx = lctx;
    k.seq = seq;
    struct head_seq *s = head_seqs.lookup(&k);
    if (s && (pos == s->last_pos + 1 || pos == s->last_pos)) {
        s->last_pos = pos;
        return s->keep;
    }
    struct head_seq d = {};
    d.last_pos = pos;
    d.keep = (u64)bpf_get_prandom_u32() < (u64)HEAD_KEEP_BELOW;
    head_seqs.update(&k, &d);
    emit_small(EV_HEAD_DRAW, lctx, seq, (s32)d.keep, pos, 0);
    return d.keep;
}

/* Whether the logits row a sampler reads in context lctx is copied: when every output of the
 * context's decode drew keep. None did: not copied. Some did: copied, and counted (counters[6]),
 * as which output the sampler's index names is not known here (a split by sequence reorders the
 * micro-batches' rows); the consumer drops it with its request. */
static __always_inline int head_keeps(u64 lctx) {
    struct head_rows *h = head_rows.lookup(&lctx);
    if (!h || h->n_out == 0 || h->n_keep == h->n_out || h->overflow)
        return 1;
    if (h->n_keep == 0) {
        count(5, 1);
        return 0;
    }
    count(6, 1);
    return 1;
}
#endif

/* ---- decode call boundaries: llama_context::decode(const llama_batch &) and, in builds that
 * have it, decode(const llama_batch_ext &), which the first may call. Entry probes only: a
 * return probe on a function that spans the whole forward pass cost 6-9% tokens/s with two
 * engine threads (measured), and a decode ends where the next one begins anyway.
 * decode_pending marks "a public decode began and no micro-batch ran yet": an ext decode
 * entered then is the same call, nested. */
BPF_HASH(decode_pending, u32, u8, 4096);

int decode_public_enter(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u8 one = 1;
    decode_pending.update(&tid, &one);
    s32 n = -1, tok0 = -1, pos0 = -1;
    u64 b = PT_REGS_PARM2(ctx);
    /* public struct llama_batch (stable C API): n_tokens@0 token@8 pos@24.
     * Read to verify the private micro-batch layout against it. */
    u64 p = 0;
    bpf_probe_read_user(&n, sizeof(n), (void *)b);
    bpf_probe_read_user(&p, sizeof(p), (void *)(b + 8));
    if (p)
        bpf_probe_read_user(&tok0, sizeof(tok0), (void *)p);
    p = 0;
    bpf_probe_read_user(&p, sizeof(p), (void *)(b + 24));
    if (p)
        bpf_probe_read_user(&pos0, sizeof(pos0), (void *)p);
    emit_small(EV_DECODE_BEGIN, PT_REGS_PARM1(ctx), n, tok0, pos0, b);
#ifdef HEAD_KEEP_BELOW
    head_decode(PT_REGS_PARM1(ctx));
#endif
    return 0;
}

int decode_ext_enter(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (decode_pending.lookup(&tid)) {
        decode_pending.delete(&tid);
        return 0;
    }
    emit_small(EV_DECODE_BEGIN, PT_REGS_PARM1(ctx), -1, -1, -1, PT_REGS_PARM2(ctx));
#ifdef HEAD_KEEP_BELOW
    head_decode(PT_REGS_PARM1(ctx));
#endif
    return 0;
}

/* ---- micro-batch = one forward pass: llama_context::process_ubatch(const llama_ubatch &, ...) */
#ifdef HEAD_KEEP_BELOW
/* The rows' sequence ids checked as UBATCH_FILL copies them, for head_drops_pass: head_bad stays 0
 * while every row has one sequence id (its n_seq_id is 1) and it is the first row's (head_first).
 * Branch-free: the verifier walks the copy loop once per row, and a branch on a value read would
 * double the states it walks; the loop's counter is exact, so `i == 0` is no branch to it. */
#define HEAD_ROWS_BEGIN(ub) bpf_probe_read_user(&head_nsid, sizeof(head_nsid), (void *)((ub) + UB_N_SEQ_ID))
#define HEAD_ROW(i, off, s)                                                                    \
    do {                                                                                        \
        if ((i) == 0)                                                                           \
            head_first = (s);                                                                   \
        s32 c_ = 0;                                                                             \
        bpf_probe_read_user(&c_, sizeof(c_), (void *)(head_nsid + ((u64)(off) + (i)) * 4));     \
        head_bad |= (u32)((s) ^ head_first) | (u32)(c_ ^ 1);                                     \
    } while (0)
#else
#define HEAD_ROWS_BEGIN(ub)
#define HEAD_ROW(i, off, s)
#endif
/* Fill a micro-batch record `e` of ROWS rows (struct ev_ubatch or ev_ubatch_s: the same fields)
 * from the llama_ubatch at `ub` with `n` rows. A macro, as the two records differ in their array
 * sizes only, which the verifier needs as constants (BCC does not take map calls in a macro: the
 * caller submits). */
#define UBATCH_FILL(e, ROWS, ub, n)                                                             \
    do {                                                                                        \
        u32 m = (n) < (ROWS) ? (n) : (ROWS);                                                    \
        /* A micro-batch larger than the record (a long prompt with n_ubatch > 1024): copy its  \
         * LAST rows, where the rows that produce logits are. */                                \
        u32 off = (n) - m;                                                                      \
        e->n_tokens = (n);                                                                      \
        e->n_copied = m;                                                                        \
        e->row_offset = off;                                                                    \
        e->pad = 0;                                                                             \
        if (off) {                                                                              \
            e->h.flags |= UB_FLAG_TRUNCATED;                                                    \
            count(2, off);                                                                      \
        }                                                                                       \
        u64 tok = 0, pos = 0, sid = 0, out = 0;                                                 \
        bpf_probe_read_user(&tok, sizeof(tok), (void *)((ub) + UB_TOKEN));                      \
        bpf_probe_read_user(&pos, sizeof(pos), (void *)((ub) + UB_POS));                        \
        bpf_probe_read_user(&sid, sizeof(sid), (void *)((ub) + UB_SEQ_ID));                     \
        bpf_probe_read_user(&out, sizeof(out), (void *)((ub) + UB_OUTPUT));                     \
        u32 sz = m * 4;                                                                         \
        if (sz > (ROWS) * 4)                                                                    \
            sz = (ROWS) * 4;                                                                    \
        if (tok)                                                                                \
            bpf_probe_read_user(e->token, sz, (void *)(tok + (u64)off * 4));                    \
        else                                                                                    \
            e->h.flags |= UB_FLAG_NO_TOKENS;                                                    \
        if (pos)                                                                                \
            bpf_probe_read_user(e->pos, sz, (void *)(pos + (u64)off * 4));                      \
        u32 osz = m;                                                                            \
        if (osz > (ROWS))                                                                       \
            osz = (ROWS);                                                                       \
        if (out)                                                                                \
            bpf_probe_read_user(e->output, osz, (void *)(out + off));                           \
        HEAD_ROWS_BEGIN(ub);                                                                    \
        for (u32 i = 0; i < (ROWS); i++) {                                                      \
            if (i >= m || !sid)                                                                 \
                break;                                                                          \
            u64 p = 0;                                                                          \
            s32 s = -1;                                                                         \
            bpf_probe_read_user(&p, sizeof(p), (void *)(sid + ((u64)off + i) * 8));             \
            if (p)                                                                              \
                bpf_probe_read_user(&s, sizeof(s), (void *)p);                                  \
            e->seq[i] = s;                                                                      \
            HEAD_ROW(i, off, s);                                                                \
        }                                                                                       \
    } while (0)

int ubatch_enter(struct pt_regs *ctx) {
    u64 lctx = PT_REGS_PARM1(ctx);
    u64 ub = PT_REGS_PARM2(ctx);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    decode_pending.delete(&tid);
    u64 seq = next_seq();
    u64 t0 = 0; /* the micro-batch record's timestamp */
    u32 n = 0;
    bpf_probe_read_user(&n, sizeof(n), (void *)(ub + UB_N_TOKENS));
#ifdef HEAD_KEEP_BELOW
    /* the decode's outputs so far: this micro-batch lists its own after them, then draws them */
    struct head_rows *hr = head_rows.lookup(&lctx);
    u32 out0 = hr ? hr->n_out : 0, keep0 = hr ? hr->n_keep : 0;
    u64 head_nsid = 0;   /* HEAD_ROW: the micro-batch's n_seq_id array */
    s32 head_first = -1; /* its first row's sequence */
    u32 head_bad = n > MAX_UB_TOK; /* a row not one sequence's, or not copied (so not checked) */
#endif
    if (n <= UB_SMALL_TOK) {
        struct ev_ubatch_s *e = events.ringbuf_reserve(sizeof(struct ev_ubatch_s));
        if (!e) {
            count(1, 1);
            return 0;
        }
        fill_hdr(&e->h, EV_UBATCH, lctx, seq);
        t0 = e->h.ts_ns;
        UBATCH_FILL(e, UB_SMALL_TOK, ub, n);
#ifdef HEAD_KEEP_BELOW
        if (hr)
            HEAD_OUTPUTS(hr, e, UB_SMALL_TOK);
#endif
        events.ringbuf_submit(e, rb_wake());
    } else {
        struct ev_ubatch *e = events.ringbuf_reserve(sizeof(struct ev_ubatch));
        if (!e) {
            count(1, 1);
            return 0;
        }
        fill_hdr(&e->h, EV_UBATCH, lctx, seq);
        t0 = e->h.ts_ns;
        UBATCH_FILL(e, MAX_UB_TOK, ub, n);
#ifdef HEAD_KEEP_BELOW
        if (hr)
            HEAD_OUTPUTS(hr, e, MAX_UB_TOK);
#endif
        events.ringbuf_submit(e, rb_wake());
    }
#ifdef HEAD_KEEP_BELOW
    u32 ub_out = 0, ub_keep = 0; /* this micro-batch's outputs, and how many drew keep */
    u32 drops = 0; /* several rows, all dropped requests' (one row: the aggregate's, or counted as
                    * before without it: the one-row fast paths) */
    if (hr) {
        for (u64 j = 0; j < HEAD_OUTS; j++) {
            u64 o = out0 + j;
            if (o >= hr->n_out || o >= HEAD_OUTS)
                break;
            HEAD_MASK(o, HEAD_OUTS - 1);
            hr->n_keep += head_draw(lctx, hr->seq[o], hr->pos[o]);
        }
        ub_out = hr->n_out - out0;
        ub_keep = hr->n_keep - keep0;
        if (!ub_keep && !hr->overflow)
            drops = head_drops_pass(hr, out0, n, ub_out, head_bad ? -1 : head_first);
    }
    {
        int k = 0;
        u64 *pd = head_pass_drop.lookup(&k);
        if (pd)
            *pd = drops ? seq : 0;
    }
#endif
    struct ubatch_info ui = {};
    ui.lctx = lctx;
    ui.ub = ub;
    ui.serial = seq;
    ubatch_info.update(&tid, &ui);
#ifdef AGG_STEPS
    agg_begin(n, seq, t0);
#ifdef HEAD_KEEP_BELOW
    if (ub_out && !ub_keep)
        agg_head_drop(seq);
#endif
#else
    (void)t0; /* the layer times' start: only the aggregate record keeps it */
#endif
    return 0;
}

int ubatch_return(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct ubatch_info *ui = ubatch_info.lookup(&tid);
    if (!ui)
        return 0;
#ifdef AGG_STEPS
    agg_end(ui->serial, ui->lctx); /* before the end record: the consumer needs it first */
#endif
    s32 uncounted = 0; /* a = 1: the pass's activations were left uncounted (head_pass_drop) */
#ifdef HEAD_KEEP_BELOW
    int k = 0;
    u64 *pd = head_pass_drop.lookup(&k);
    if (pd && *pd && *pd == ui->serial) {
        uncounted = 1;
        *pd = 0;
    }
#endif
    emit_small(EV_UBATCH_END, ui->lctx, uncounted, 0, 0, PT_REGS_RC(ctx));
    ubatch_info.delete(&tid);
    return 0;
}

/* ---- sampler calls: llama_sampler_sample(smpl, ctx, idx) / common_sampler_sample(gsmpl, ctx, idx, ..)
 * Only the outermost sampler call on a thread counts (one may call the other). */
static __always_inline int sampler_enter(struct pt_regs *ctx, u32 kind) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct sampler_state *st = in_sampler.lookup(&tid);
    if (st) {
        st->depth++;
        return 0;
    }
    struct sampler_state s = {};
    s.ctx = PT_REGS_PARM2(ctx);
    s.idx = (s32)PT_REGS_PARM3(ctx);
    s.kind = kind;
    s.depth = 0;
    in_sampler.update(&tid, &s);
    emit_small(EV_SAMPLE_BEGIN, s.ctx, s.idx, kind, 0, 0);
    return 0;
}

static __always_inline int sampler_return(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct sampler_state *st = in_sampler.lookup(&tid);
    if (!st)
        return 0;
    if (st->depth > 0) {
        st->depth--;
        return 0;
    }
    emit_small(EV_SAMPLE_END, st->ctx, (s32)PT_REGS_RC(ctx), st->kind, st->idx, 0);
    in_sampler.delete(&tid);
    return 0;
}

int llama_sampler_enter(struct pt_regs *ctx) { return sampler_enter(ctx, SAMPLER_LLAMA); }
int common_sampler_enter(struct pt_regs *ctx) { return sampler_enter(ctx, SAMPLER_COMMON); }
int any_sampler_return(struct pt_regs *ctx) { return sampler_return(ctx); }

/* ---- the logits row a sampler reads: llama_get_logits_ith(ctx, i) -> float* ----------- */
int logits_enter(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (!in_sampler.lookup(&tid))
        return 0; /* rows read outside a sampler call (n_probs, user code) are not token rows */
    struct logits_args a = {};
    a.ctx = PT_REGS_PARM1(ctx);
    a.idx = (s32)PT_REGS_PARM2(ctx);
    logits_args.update(&tid, &a);
    return 0;
}

static __always_inline int emit_chunk(u64 lctx, s32 idx, u32 c, u64 row, u32 n) {
    u64 seq = next_seq();
    struct ev_logits *e = events.ringbuf_reserve(sizeof(struct ev_logits));
    if (!e) {
        count(1, 1);
        return -1;
    }
    fill_hdr(&e->h, EV_LOGITS, lctx, seq);
    e->idx = idx;
    e->chunk = c;
    e->n_vals = n;
    e->n_vocab = N_VOCAB;
    if (n > LOGITS_CHUNK)
        n = LOGITS_CHUNK;
    bpf_probe_read_user(e->vals, n * 4, (void *)(row + (u64)c * LOGITS_CHUNK * 4));
    events.ringbuf_submit(e, rb_wake());
    return 0;
}

int logits_return(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct logits_args *a = logits_args.lookup(&tid);
    if (!a)
        return 0;
    u64 lctx = a->ctx;
    s32 idx = a->idx;
    logits_args.delete(&tid);
    u64 row = PT_REGS_RC(ctx);
    if (!row)
        return 0;
#ifdef HEAD_KEEP_BELOW
    if (!head_keeps(lctx))
        return 0;
#endif
    for (u32 c = 0; c < N_VOCAB / LOGITS_CHUNK && c < MAX_LOGITS_CHUNKS; c++)
        emit_chunk(lctx, idx, c, row, LOGITS_CHUNK);
#if N_VOCAB % LOGITS_CHUNK
    emit_chunk(lctx, idx, N_VOCAB / LOGITS_CHUNK, row, N_VOCAB % LOGITS_CHUNK);
#endif
    return 0;
}

/* ---- cache clears mark request boundaries ----------------------------------------------- */
int seq_rm_enter(struct pt_regs *ctx) {
    emit_small(EV_SEQ_RM, PT_REGS_PARM1(ctx), (s32)PT_REGS_PARM2(ctx), (s32)PT_REGS_PARM3(ctx),
               (s32)PT_REGS_PARM4(ctx), 0);
    return 0;
}

int mem_clear_enter(struct pt_regs *ctx) {
    emit_small(EV_MEM_CLEAR, PT_REGS_PARM1(ctx), 0, 0, 0, 0);
    return 0;
}
