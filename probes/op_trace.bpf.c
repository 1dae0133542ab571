/* Per-operator tracing (issue 62, `record --trace-ops`): every graph node the CPU backend computes,
 * its entry and exit on each engine thread. Compiled and attached on its own
 * (sparseety_prof/capture/op_trace.py), and put in and taken out by the duty cycle: detached
 * between windows, so that the engine runs without these traps then.
 *
 * Where:
 *   ggml_cpu_extra_compute_forward(params, node) entry: ggml-cpu's ggml_compute_forward (static)
 *     calls it first for every node it computes (not for a node of op NONE or an empty one), on
 *     every thread of the graph: the node's entry on that thread;
 *   ggml_compute_forward_rms_norm_mul_fused(params, rms_norm, mul) entry, where the build has it:
 *     ggml-cpu computes an RMS_NORM node and the MUL right after it in one kernel, without
 *     ggml_compute_forward (ggml_cpu_try_fuse_ops): the pair is one node, the RMS_NORM's, marked
 *     fused;
 *   ggml_barrier(threadpool) entry: the graph loop waits there after each node (and once more
 *     after the last), and some ops wait there inside (mul_mat after converting its input): the
 *     last barrier a thread enters before its next node is where that node ended for it.
 * A node is sent when the thread enters its next node, with the time of the last barrier entered
 * since its own entry as its end; a node with no barrier after it (taken out in between) is not
 * sent. The last node of a graph is sent when the thread enters the next graph's first node.
 *
 * Build-time constants: TARGET_TGID, T_OP T_NAME (offsets in struct ggml_tensor), P_ITH (in struct
 * ggml_compute_params), OP_PAGES (pages of the ring).
 */
#include <uapi/linux/ptrace.h>

#define OP_NAME_LEN 48

struct op_rec {
    u64 t_start; /* bpf_ktime_get_ns: CLOCK_MONOTONIC, the steps' clock */
    u64 t_end;
    u64 node;    /* the ggml_tensor's address */
    u32 tid;
    s32 ith;     /* the thread's index in the graph (ggml_compute_params.ith) */
    s32 op;      /* enum ggml_op */
    u32 fused;   /* 1: an RMS_NORM node computed with the MUL after it */
    char name[OP_NAME_LEN];
};

struct open_node {
    struct op_rec r; /* t_end: the last barrier entered since t_start, 0 while none */
};

BPF_HASH(open_nodes, u32, struct open_node, 4096);
BPF_RINGBUF_OUTPUT(ops, OP_PAGES);
BPF_ARRAY(lost, u64, 1);

static __always_inline void send(struct open_node *o) {
    if (!o->r.node || !o->r.t_end)
        return;
    struct op_rec *r = ops.ringbuf_reserve(sizeof(struct op_rec));
    if (!r) {
        int k = 0;
        u64 *n = lost.lookup(&k);
        if (n)
            __sync_fetch_and_add(n, 1);
        return;
    }
    __builtin_memcpy(r, &o->r, sizeof(struct op_rec));
    ops.ringbuf_submit(r, 0);
}

static __always_inline int node_enter(struct pt_regs *ctx, u32 fused) {
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    u32 tid = (u32)id;
    struct open_node zero = {};
    struct open_node *o = open_nodes.lookup_or_try_init(&tid, &zero);
    if (!o)
        return 0;
    send(o);
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    o->r.t_start = now;
    o->r.t_end = 0;
    o->r.node = node;
    o->r.tid = tid;
    o->r.ith = -1;
    o->r.op = -1;
    o->r.fused = fused;
    bpf_probe_read_user(&o->r.ith, sizeof(s32), (void *)(params + P_ITH));
    bpf_probe_read_user(&o->r.op, sizeof(s32), (void *)(node + T_OP));
    bpf_probe_read_user(o->r.name, OP_NAME_LEN, (void *)(node + T_NAME));
    return 0;
}

int op_node_enter(struct pt_regs *ctx) { return node_enter(ctx, 0); }

int op_fused_enter(struct pt_regs *ctx) { return node_enter(ctx, 1); }

int op_barrier_enter(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    u32 tid = (u32)id;
    struct open_node *o = open_nodes.lookup(&tid);
    if (o && o->r.node)
        o->r.t_end = bpf_ktime_get_ns();
    return 0;
}
