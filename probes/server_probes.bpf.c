/* ---- serving context: llama-server's request -> task -> slot chain (appended to
 * token_probes.bpf.c by the loader) ------------------------------------------------------------
 *
 * A client's request id travels through three hops, each seen on the thread that makes it:
 *   1. an HTTP worker thread reads the request from its socket (syscall tracepoints: this kernel
 *      has no kprobes, and the socket read is the one place the header is plain bytes);
 *   2. the same thread posts the request's task(s) to the server queue (server_queue::post);
 *   3. the main loop launches a task on a slot (launch_slot_with_task); the slot's id is the
 *      llama.cpp sequence id its tokens carry in every micro-batch.
 * The consumer joins the hops (sparseety_prof/serving.py). Only reads that start with an HTTP
 * request line are copied: bodies (prompts) are not, and the consumer keeps only the header
 * it was asked for.
 *
 * Build-time constants: SRV_TASK_ID (offset of server_task::id), SRV_SLOT_ID (server_slot::id),
 * SRV_TOKOUT_TOK (completion_token_output::tok); HTTP_READS and TARGET_TGID enable the socket
 * tracepoints for one process.
 */

static __always_inline s32 read_s32(u64 addr) {
    s32 v = -1;
    if (addr)
        bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

static __always_inline u64 read_u64(u64 addr) {
    u64 v = 0;
    if (addr)
        bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* server_queue::post(server_task&&, bool) */
int task_post_one(struct pt_regs *ctx) {
    u64 task = PT_REGS_PARM2(ctx);
    emit_small(EV_TASK_POST, 0, read_s32(task + SRV_TASK_ID), 1, 0, 0);
    return 0;
}

/* server_queue::post(std::vector<server_task>&&, bool): ids are assigned before posting */
int task_post_vec(struct pt_regs *ctx) {
    u64 vec = PT_REGS_PARM2(ctx);
    u64 begin = read_u64(vec), end = read_u64(vec + 8);
    emit_small(EV_TASK_POST, 0, read_s32(begin + SRV_TASK_ID), 0, 0, end - begin);
    return 0;
}

/* server_context_impl::launch_slot_with_task(server_slot&, server_task&&) */
int slot_launch(struct pt_regs *ctx) {
    u64 slot = PT_REGS_PARM2(ctx), task = PT_REGS_PARM3(ctx);
    emit_small(EV_SLOT_LAUNCH, 0, read_s32(slot + SRV_SLOT_ID), read_s32(task + SRV_TASK_ID), 0, slot);
    return 0;
}

/* server_context_impl::launch_slots_with_parent_task(server_slot& parent,
 *     std::vector<server_slot*>& children, server_task&&): the children's sequences are forks */
int slot_launch_parent(struct pt_regs *ctx) {
    u64 parent = PT_REGS_PARM2(ctx), vec = PT_REGS_PARM3(ctx), task = PT_REGS_PARM4(ctx);
    s32 pslot = read_s32(parent + SRV_SLOT_ID), tid = read_s32(task + SRV_TASK_ID);
    u64 begin = read_u64(vec), end = read_u64(vec + 8);
#pragma unroll
    for (int i = 0; i < MAX_CHILD_SLOTS; i++) {
        if (begin + 8 * (u64)i >= end)
            break;
        u64 child = read_u64(begin + 8 * (u64)i);
        emit_small(EV_SLOT_CHILD, 0, read_s32(child + SRV_SLOT_ID), tid, pslot, child);
    }
    return 0;
}

/* server_slot::release() */
int slot_release(struct pt_regs *ctx) {
    u64 slot = PT_REGS_PARM1(ctx);
    emit_small(EV_SLOT_RELEASE, 0, read_s32(slot + SRV_SLOT_ID), 0, 0, slot);
    return 0;
}

/* server_context_impl::process_token(completion_token_output&, server_slot&): the token the
 * server hands to a slot, i.e. which sequence a sample belongs to (exact even when the
 * micro-batch reordered rows by sequence) */
int slot_token(struct pt_regs *ctx) {
    u64 out = PT_REGS_PARM2(ctx), slot = PT_REGS_PARM3(ctx);
    emit_small(EV_SLOT_TOKEN, 0, read_s32(slot + SRV_SLOT_ID), read_s32(out + SRV_TOKOUT_TOK), 0, slot);
    return 0;
}

#ifdef HTTP_READS
struct http_args {
    u64 buf;
    s32 fd;
};
BPF_HASH(http_args, u32, struct http_args, 4096);

static __always_inline int http_enter(s32 fd, u64 buf) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    u32 tid = (u32)id;
    struct http_args a = {.buf = buf, .fd = fd};
    http_args.update(&tid, &a);
    return 0;
}

/* "GET ", "POST", "PUT ", "DELE", "PATC", "HEAD", "OPTI" as little-endian words */
static __always_inline int is_request_line(u32 w) {
    return w == 0x20544547 || w == 0x54534f50 || w == 0x20545550 || w == 0x454c4544 || w == 0x43544150 ||
           w == 0x44414548 || w == 0x4954504f;
}

static __always_inline int http_exit(void *ctx, long ret) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    u32 tid = (u32)id;
    struct http_args *a = http_args.lookup(&tid);
    if (!a)
        return 0;
    u64 buf = a->buf;
    s32 fd = a->fd;
    http_args.delete(&tid);
    if (ret < 4)
        return 0;
    u32 w = 0;
    bpf_probe_read_user(&w, sizeof(w), (void *)buf);
    if (!is_request_line(w))
        return 0;  /* a body or a later part of the stream: not copied */
    u64 seq = next_seq();
    struct ev_http *e = events.ringbuf_reserve(sizeof(struct ev_http));
    if (!e) {
        count(1, 1);
        return 0;
    }
    fill_hdr(&e->h, EV_HTTP_READ, 0, seq);
    e->fd = fd;
    e->len = (u32)ret;
    u32 n = ret > HTTP_BYTES ? HTTP_BYTES : (u32)ret;
    e->n_copied = n;
    e->pad = 0;
    e->buf = buf;
    /* a size in [1, HTTP_BYTES] the verifier can bound: the AND in asm survives clang */
    u64 m = (u64)n - 1;
    asm volatile("%[m] &= 4095" : [m] "+r"(m)); /* HTTP_BYTES - 1 */
    bpf_probe_read_user(e->data, m + 1, (void *)buf);
    events.ringbuf_submit(e, rb_wake());
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return http_enter((s32)args->fd, (u64)args->ubuf); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return http_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_read) { return http_enter((s32)args->fd, (u64)args->buf); }
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return http_exit(args, args->ret); }
#endif
