/* Per-operator tracing (issue 62, `record --trace-ops`): every graph node the CPU backend computes,
 * its entry on each engine thread, and the end of each graph. Compiled and attached on its own
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
 *   ggml_graph_compute return: every graph thread has passed the graph's last barrier.
 * A node runs on a thread from its entry to the thread's next node entry, or to the end of its
 * graph: the consumer pairs them (the barrier after each node is inside ggml-cpu's loop, inlined
 * in some builds, so it is no probe point).
 *
 * Build-time constants: TARGET_TGID, T_OP T_NAME (offsets in struct ggml_tensor), P_ITH (in struct
 * ggml_compute_params), OP_PAGES (pages of the ring).
 */
#include <uapi/linux/ptrace.h>

#define OP_NAME_LEN 48

enum op_kind { OP_NODE = 0, OP_FUSED = 1, OP_GRAPH_END = 2 };

struct op_rec {
    u64 ts;     /* bpf_ktime_get_ns: CLOCK_MONOTONIC, the steps' clock */
    u64 node;   /* the ggml_tensor's address (0 for OP_GRAPH_END) */
    u32 tid;
    s32 ith;    /* the thread's index in the graph (ggml_compute_params.ith) */
    s32 op;     /* enum ggml_op */
    u32 kind;   /* enum op_kind */
    char name[OP_NAME_LEN];
};

BPF_RINGBUF_OUTPUT(ops, OP_PAGES);
BPF_ARRAY(lost, u64, 1);

static __always_inline struct op_rec *reserve(u32 tid, u32 kind) {
    struct op_rec *r = ops.ringbuf_reserve(sizeof(struct op_rec));
    if (!r) {
        int k = 0;
        u64 *n = lost.lookup(&k);
        if (n)
            __sync_fetch_and_add(n, 1);
        return 0;
    }
    r->ts = bpf_ktime_get_ns();
    r->tid = tid;
    r->kind = kind;
    r->node = 0;
    r->ith = -1;
    r->op = -1;
    return r;
}

static __always_inline int node_enter(struct pt_regs *ctx, u32 kind) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    struct op_rec *r = reserve((u32)id, kind);
    if (!r)
        return 0;
    u64 params = PT_REGS_PARM1(ctx), node = PT_REGS_PARM2(ctx);
    r->node = node;
    bpf_probe_read_user(&r->ith, sizeof(s32), (void *)(params + P_ITH));
    bpf_probe_read_user(&r->op, sizeof(s32), (void *)(node + T_OP));
    if (bpf_probe_read_user(r->name, OP_NAME_LEN, (void *)(node + T_NAME)))
        r->name[0] = 0;
    ops.ringbuf_submit(r, 0);
    return 0;
}

int op_node_enter(struct pt_regs *ctx) { return node_enter(ctx, OP_NODE); }

int op_fused_enter(struct pt_regs *ctx) { return node_enter(ctx, OP_FUSED); }

int op_graph_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    struct op_rec *r = reserve((u32)id, OP_GRAPH_END);
    if (!r)
        return 0;
    r->name[0] = 0;
    ops.ringbuf_submit(r, 0);
    return 0;
}
