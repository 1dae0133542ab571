/* Layout discovery: raw copies of what the engine passes to its decode loop, from which the
 * consumer (sparseety_prof/layout_discovery.py) infers the private `struct llama_ubatch` layout
 * of a build it has no verified table entry for. Attached for a few forward passes before the
 * recording probes, then detached.
 *
 * Nothing here assumes a layout: the micro-batch record holds the struct's first DSC_STRUCT bytes,
 * and for every 8-byte word of them, read as a pointer, the first DSC_BYTES bytes it points to
 * and the first DSC_DEREF int32s that its first DSC_DEREF words point to (a `llama_seq_id **`).
 * The public `struct llama_batch` (llama.h, stable) and the sampled tokens are the anchors the
 * inferred layout must agree with.
 */
#include <uapi/linux/ptrace.h>

#define DSC_STRUCT 256
#define DSC_SLOTS (DSC_STRUCT / 8)
#define DSC_BYTES 256
#define DSC_DEREF 16
#define DSC_BATCH_ROWS 64

enum dsc_kind { DSC_UBATCH = 1, DSC_BATCH = 2, DSC_SAMPLE = 3 };

struct dsc_hdr {
    __u64 serial; /* order of the records of one process */
    __u64 ctx;    /* llama_context* */
    __u32 tid;
    __u32 kind;
};

struct dsc_ubatch {
    struct dsc_hdr h;
    __u8 raw[DSC_STRUCT];
    __u8 pointee[DSC_SLOTS][DSC_BYTES];
    __s32 deref[DSC_SLOTS][DSC_DEREF];
    __u32 pointee_ok;            /* bit k: word k was a readable pointer */
    __u32 raw_ok;                /* the struct itself was readable */
    __u16 deref_ok[DSC_SLOTS];   /* bit j: entry j of pointee k was a readable pointer */
};

/* llama_batch (llama.h): n_tokens@0 token@8 embd@16 pos@24 n_seq_id@32 seq_id@40 logits@48 */
struct dsc_batch {
    struct dsc_hdr h;
    __s32 n_tokens;
    __u32 has; /* bit 0 token, 1 pos, 2 logits, 3 seq_id */
    __s32 token[DSC_BATCH_ROWS];
    __s32 pos[DSC_BATCH_ROWS];
    __s32 seq[DSC_BATCH_ROWS];
    __s8 logits[DSC_BATCH_ROWS];
};

struct dsc_sample {
    struct dsc_hdr h;
    __s32 token;
    __u32 pad;
};

BPF_RINGBUF_OUTPUT(dsc_events, 256); /* 1 MiB: more than DSC_BUDGET micro-batch records */
BPF_ARRAY(dsc_serial, __u64, 1);
BPF_ARRAY(dsc_drops, __u64, 1);
/* Micro-batch records the consumer still takes before its next poll (it refills this): a busy
 * engine must not overflow the ring between two polls. A record skipped or dropped still takes
 * its serial number, so the consumer sees the gap and links no anchor across it. */
BPF_ARRAY(dsc_budget, __u64, 1);

static __always_inline __u64 dsc_next(void) {
    int k = 0;
    __u64 *v = dsc_serial.lookup(&k);
    return v ? __sync_fetch_and_add(v, 1) : 0;
}


/* Reserve a record of `size` bytes (a constant once inlined) and fill its header; NULL, counted in
 * dsc_drops, when the ring is full. */
static __always_inline void *dsc_reserve(__u64 size, __u32 kind, __u64 ctx) {
    __u64 serial = dsc_next();
    struct dsc_hdr *h = dsc_events.ringbuf_reserve(size);
    if (!h) {
        int k = 0;
        __u64 *d = dsc_drops.lookup(&k);
        if (d)
            __sync_fetch_and_add(d, 1);
        return 0;
    }
    h->serial = serial;
    h->ctx = ctx;
    h->tid = (__u32)bpf_get_current_pid_tgid();
    h->kind = kind;
    return h;
}

/* llama_context::process_ubatch(this, const llama_ubatch &, ...): rsi = the micro-batch */
int dsc_ubatch(struct pt_regs *ctx) {
    __u64 ub = PT_REGS_PARM2(ctx);
    int k0 = 0;
    __u64 *budget = dsc_budget.lookup(&k0);
    if (!budget || *budget == 0) {
        dsc_next(); /* skipped: a gap in the serials */
        return 0;
    }
    __sync_fetch_and_add(budget, -1);
    struct dsc_ubatch *e = dsc_reserve(sizeof(struct dsc_ubatch), DSC_UBATCH, PT_REGS_PARM1(ctx));
    if (!e)
        return 0;
    e->raw_ok = bpf_probe_read_user(e->raw, DSC_STRUCT, (void *)ub) == 0;
    e->pointee_ok = 0;
    for (int k = 0; k < DSC_SLOTS; k++) {
        __u64 p = *(__u64 *)&e->raw[k * 8];
        e->deref_ok[k] = 0;
        if (!e->raw_ok || p < 4096 || bpf_probe_read_user(e->pointee[k], DSC_BYTES, (void *)p) != 0)
            continue;
        e->pointee_ok |= 1u << k;
        for (int j = 0; j < DSC_DEREF; j++) {
            __u64 q = *(__u64 *)&e->pointee[k][j * 8];
            if (q >= 4096 && bpf_probe_read_user(&e->deref[k][j], 4, (void *)q) == 0)
                e->deref_ok[k] |= 1u << j;
        }
    }
    dsc_events.ringbuf_submit(e, 0);
    return 0;
}

/* llama_context::decode(this, const llama_batch &): rsi = the public batch */
int dsc_batch(struct pt_regs *ctx) {
    __u64 b = PT_REGS_PARM2(ctx);
    struct dsc_batch *e = dsc_reserve(sizeof(struct dsc_batch), DSC_BATCH, PT_REGS_PARM1(ctx));
    if (!e)
        return 0;
    __u64 f[7] = {};
    e->has = 0;
    e->n_tokens = 0;
    if (bpf_probe_read_user(f, sizeof(f), (void *)b) != 0) {
        dsc_events.ringbuf_submit(e, 0);
        return 0;
    }
    e->n_tokens = (__s32)f[0];
    __u32 n = (__u32)f[0];
    __u32 m = n < DSC_BATCH_ROWS ? n : DSC_BATCH_ROWS;
    if (f[1] && bpf_probe_read_user(e->token, sizeof(e->token), (void *)f[1]) == 0)
        e->has |= 1;
    if (f[3] && bpf_probe_read_user(e->pos, sizeof(e->pos), (void *)f[3]) == 0)
        e->has |= 2;
    if (f[6] && bpf_probe_read_user(e->logits, sizeof(e->logits), (void *)f[6]) == 0)
        e->has |= 4;
    if (f[5]) {
        e->has |= 8;
        for (__u32 i = 0; i < DSC_BATCH_ROWS; i++) {
            __u32 j = i & (DSC_BATCH_ROWS - 1); /* a bound the verifier sees, whatever the compiler does */
            __u64 p = 0;
            e->seq[j] = -1;
            if (i < m && bpf_probe_read_user(&p, sizeof(p), (void *)(f[5] + j * 8)) == 0 && p)
                bpf_probe_read_user(&e->seq[j], 4, (void *)p);
        }
    }
    dsc_events.ringbuf_submit(e, 0);
    return 0;
}

/* llama_sampler_sample / common_sampler_sample return: the sampled token id */
int dsc_sample(struct pt_regs *ctx) {
    struct dsc_sample *e = dsc_reserve(sizeof(struct dsc_sample), DSC_SAMPLE, 0);
    if (!e)
        return 0;
    e->token = (__s32)PT_REGS_RC(ctx);
    e->pad = 0;
    dsc_events.ringbuf_submit(e, 0);
    return 0;
}

/* ggml_compute_forward_get_rows(const struct ggml_compute_params *, struct ggml_tensor *): the
 * first DSC_PARAMS bytes of the params, on every compute thread, for the ggml_compute_params
 * offsets (ith, nth). Their own ring and count: they take no micro-batch serial number. */
#define DSC_PARAMS 16
#define DSC_PARAMS_MAX 2048
struct dsc_params {
    __u32 tid;
    __u32 ok;
    __u8 raw[DSC_PARAMS];
};
BPF_RINGBUF_OUTPUT(dsc_params_events, 16);
BPF_ARRAY(dsc_params_sent, __u64, 1);

int dsc_params(struct pt_regs *ctx) {
    int k = 0;
    __u64 *sent = dsc_params_sent.lookup(&k);
    if (!sent || *sent >= DSC_PARAMS_MAX)
        return 0;
    __sync_fetch_and_add(sent, 1);
    struct dsc_params *e = dsc_params_events.ringbuf_reserve(sizeof(struct dsc_params));
    if (!e)
        return 0;
    e->tid = (__u32)bpf_get_current_pid_tgid();
    e->ok = bpf_probe_read_user(e->raw, DSC_PARAMS, (void *)PT_REGS_PARM1(ctx)) == 0;
    dsc_params_events.ringbuf_submit(e, 0);
    return 0;
}
