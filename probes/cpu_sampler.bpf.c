/* CPU sampler (issue 62): a software cpu-clock perf event on every CPU runs on_cpu_sample; the
 * samples of the engine's process (TARGET_TGID) are kept, the others return at once.
 *
 * Aggregated here, in the kernel: one count per (thread, user stack, kernel-or-not) in `counts`,
 * complete whatever the consumer does. Joining a sample to the step it fell in needs its time,
 * which no count keeps: each sample also leaves a 24-byte record in `samples` (time, thread,
 * stack id, kernel-or-not), which the consumer joins to the steps' windows. The records are few
 * (the rate times the engine's busy CPUs); a full ring only loses the join of those samples
 * (counted: lost[0]), never their counts.
 *
 * Compiled on its own (capture/cpu_sampler.py), with
 *   TARGET_TGID   the engine's process id
 *   STACK_SLOTS   entries of the stack map (stacks are never replaced: a full map loses stacks,
 *                 counted: lost[1])
 *   COUNT_SLOTS   entries of the count map (a full map: lost[2])
 *   SAMPLE_PAGES  pages of the sample ring
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf_perf_event.h>

struct sample_key {
    u32 tid;
    s32 stack_id; /* user stack in `stacks`, or a negative errno when it was not taken */
    u32 kernel;   /* 1: the CPU was in the kernel for the thread (a system call, a fault) */
    u32 pad;
};

struct sample_rec {
    u64 ts; /* bpf_ktime_get_ns: CLOCK_MONOTONIC, the steps' clock */
    u32 tid;
    s32 stack_id;
    u32 kernel;
    u32 pad;
};

BPF_STACK_TRACE(stacks, STACK_SLOTS);
BPF_HASH(counts, struct sample_key, u64, COUNT_SLOTS);
BPF_RINGBUF_OUTPUT(samples, SAMPLE_PAGES);
BPF_ARRAY(lost, u64, 3);

static __always_inline void lose(int k) {
    u64 *n = lost.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, 1);
}

int on_cpu_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    struct sample_key key = {};
    key.tid = (u32)id;
    /* kernel addresses are the upper half on x86-64 and arm64 */
    key.kernel = (s64)PT_REGS_IP(&ctx->regs) < 0;
    key.stack_id = stacks.get_stackid(&ctx->regs, BPF_F_USER_STACK);
    if (key.stack_id == -ENOMEM || key.stack_id == -EEXIST)
        lose(1);
    u64 zero = 0;
    u64 *n = counts.lookup_or_try_init(&key, &zero);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        lose(2);
    struct sample_rec *r = samples.ringbuf_reserve(sizeof(struct sample_rec));
    if (!r) {
        lose(0);
        return 0;
    }
    r->ts = bpf_ktime_get_ns();
    r->tid = key.tid;
    r->stack_id = key.stack_id;
    r->kernel = key.kernel;
    r->pad = 0;
    samples.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    return 0;
}
