/* Who took the CPU (issue 62): where each engine thread's time went during each step, from the
 * scheduler's tracepoints, aggregated here per thread and emitted once per (step, thread).
 *
 * Every engine thread has a slot (`thr`, found through `tid_slot`) holding its scheduling state
 * (on CPU, runnable, sleeping, stopped) and since when. Each state change adds the time spent in
 * the state left to that state's total. A runnable thread waits for one CPU (where it was
 * preempted, or woken onto): each switch on that CPU charges the time since the last to the task
 * switched out, which held it meanwhile: the recorder, the engine's own threads, or another
 * process (the three with most time named, per step). One waiting engine thread per CPU is
 * followed (the latest): time the CPU was idle, or another engine thread waited for it too, or
 * the thread was moved to another CPU, is runnable time charged to nobody named.
 *
 * Steps are the engine's micro-batches, delimited by the same function the token probes trap
 * (process_ubatch): this program attaches its own entry and return handlers to it, which the
 * kernel runs on the same trap. At a step's start every slot's totals restart; at its end each
 * thread that did more than sleep leaves one record in `waits`. So the cost is one ring record
 * per active thread per step, and the tracepoints' filter (the engine's process first) on every
 * switch and wakeup of the machine.
 *
 * The state changes of one thread happen on the CPUs it runs and is woken on, a step's end on
 * the engine's main thread: the slots are updated without locks (tracing programs cannot take a
 * bpf_spin_lock), so a change racing with a step's end may be split at a slightly different
 * instant; no time is counted twice (durations from a `since` later than now count as zero).
 *
 * Compiled on its own (capture/sched_waits.py), with
 *   TARGET_TGID    the engine's process id
 *   RECORDER_TGID  the recorder's process id (its threads' share counted apart)
 *   MAX_THREADS    slots (threads of the engine counted; more are left out, counted: lost[0])
 *   MAX_CPUS       CPUs (at least the machine's possible CPUs)
 *   WAIT_PAGES     pages of the record ring (a full ring loses records, counted: lost[1])
 */
#include <uapi/linux/ptrace.h>

#define ST_ON 0
#define ST_RUN 1
#define ST_SLEEP 2
#define ST_STOP 3
#define ST_GONE 4 /* the thread exited: never counted again */
#define N_CAND 3  /* the processes named per (step, thread): those that held the CPU longest */

/* the sched_switch tracepoint's prev_state, as the kernel reports it (TASK_REPORT bits) */
#define REPORT_STOPPED 0x4
#define REPORT_TRACED 0x8
#define REPORT_MAX 0x100 /* switched out by preemption, whatever its state */

struct thr {
    u32 tid;
    u32 state;
    u64 since;
    u64 ns[4]; /* per ST_*, this step */
    u64 rec_ns; /* runnable while the recorder's threads held the CPU */
    u64 eng_ns; /* ... the engine's own other threads */
    u64 oth_ns; /* ... any other process, or the CPU idle (a wakeup's latency) */
    u32 cand_tgid[N_CAND];
    u32 idx; /* this slot's index */
    u32 wait_cpu; /* the CPU it waits for, while runnable (cpu_wait) */
    u32 pad;
    u64 cand_ns[N_CAND];
    char cand_comm[N_CAND][16];
};

struct wait_rec {
    u64 t_start; /* the step's start and end as this program saw them (CLOCK_MONOTONIC) */
    u64 t_end;
    u32 step_tid; /* the thread that ran the step */
    u32 tid;
    u64 on_ns;
    u64 run_ns;
    u64 sleep_ns;
    u64 stop_ns;
    u64 rec_ns;
    u64 eng_ns;
    u64 oth_ns;
    u32 top_tgid; /* the process that held the CPU longest while this thread waited (0: none) */
    u32 pad;
    u64 top_ns;
    char top_comm[16];
};

struct step_now {
    u64 t_start;
    u32 tid;
    u32 open;
};

/* the engine thread waiting for each CPU (the latest to be preempted there or woken onto it):
 * every switch on that CPU charges the time since the last to the task switched out */
struct cpu_wait {
    u32 slot; /* its slot + 1; 0: none */
    u32 pad;
    u64 since;
};

BPF_ARRAY(thr, struct thr, MAX_THREADS);
BPF_ARRAY(cpu_wait, struct cpu_wait, MAX_CPUS);
BPF_HASH(tid_slot, u32, u32, MAX_THREADS);
BPF_ARRAY(nslots, u32, 1);
BPF_ARRAY(step, struct step_now, 1);
BPF_ARRAY(lost, u64, 2);
BPF_RINGBUF_OUTPUT(waits, WAIT_PAGES);

static __always_inline void lose(int k) {
    u64 *n = lost.lookup(&k);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* the time since the state began added to its total; the new state from `now` */
static __always_inline void move_to(struct thr *t, u64 now, u32 state) {
    u32 old = t->state;
    u64 since = t->since;
    if (old < 4 && now > since)
        __sync_fetch_and_add(&t->ns[old], now - since);
    t->since = now;
    if (old != ST_GONE)
        t->state = state;
}

static __always_inline struct thr *slot_of(u32 tid) {
    u32 *i = tid_slot.lookup(&tid);
    if (!i)
        return 0;
    u32 k = *i;
    return thr.lookup(&k);
}

/* a slot for a thread of the engine seen for the first time, in `state` from now */
static __always_inline struct thr *new_slot(u32 tid, u32 state, u64 now) {
    int z = 0;
    u32 *n = nslots.lookup(&z);
    if (!n)
        return 0;
    /* not atomic (an atomic add's result needs a newer BPF instruction set than BCC emits): two
     * threads first seen at the same instant may share a slot, the later keeping it. Threads are
     * seeded at load and made one at a time by their creator, so this is rare. */
    u32 k = *n;
    if (k >= MAX_THREADS) {
        lose(0);
        return 0;
    }
    *n = k + 1;
    struct thr *t = thr.lookup(&k);
    if (!t)
        return 0;
    __builtin_memset(t, 0, sizeof(*t));
    t->tid = tid;
    t->idx = k;
    t->state = state;
    t->since = now;
    tid_slot.update(&tid, &k);
    return t;
}

static __always_inline u32 state_of(long prev_state) {
    if (prev_state & REPORT_MAX || prev_state == 0)
        return ST_RUN;
    if (prev_state & (REPORT_STOPPED | REPORT_TRACED))
        return ST_STOP;
    return ST_SLEEP;
}

/* `ns` of a runnable wait during which process `tgid` (named `comm`) held the CPU */
static __always_inline void charge(struct thr *t, u64 ns, u32 tgid, const char *comm) {
    if (tgid == RECORDER_TGID)
        __sync_fetch_and_add(&t->rec_ns, ns);
    else if (tgid == TARGET_TGID)
        __sync_fetch_and_add(&t->eng_ns, ns);
    else
        __sync_fetch_and_add(&t->oth_ns, ns);
    if (tgid == 0) /* the CPU was idle: a wakeup's latency, nobody's to name */
        return;
    int low = 0;
#pragma unroll
    for (int i = 0; i < N_CAND; i++) {
        if (t->cand_tgid[i] == tgid) {
            t->cand_ns[i] += ns;
            return;
        }
        if (t->cand_ns[i] < t->cand_ns[low])
            low = i;
    }
    /* an empty candidate has 0 ns: the lowest; a full list loses its smallest to a larger wait */
    if (t->cand_ns[low] < ns) {
        t->cand_tgid[low] = tgid;
        t->cand_ns[low] = ns;
        __builtin_memcpy(t->cand_comm[low], comm, 16);
    }
}

/* thread `t` waits for CPU `cpu` from `now` */
static __always_inline void waits_for(u32 cpu, struct thr *t, u64 now) {
    struct cpu_wait *w = cpu_wait.lookup(&cpu);
    if (w) {
        w->slot = t->idx + 1;
        w->since = now;
        t->wait_cpu = cpu;
    }
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 id = bpf_get_current_pid_tgid(); /* the task switched out */
    u32 tgid = id >> 32;
    u64 now = 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct cpu_wait *w = cpu_wait.lookup(&cpu);
    if (w && w->slot) { /* an engine thread waits for this CPU: the task leaving had it */
        u32 k = w->slot - 1;
        struct thr *t = thr.lookup(&k);
        if (t && t->state == ST_RUN && t->wait_cpu == cpu) {
            now = bpf_ktime_get_ns();
            /* from the step's start at the earliest: what came before is the last step's */
            int z = 0;
            struct step_now *s = step.lookup(&z);
            u64 from = w->since;
            if (s && s->t_start > from)
                from = s->t_start;
            if (now > from) {
                char comm[16];
                __builtin_memcpy(comm, args->prev_comm, 16);
                charge(t, now - from, args->prev_pid ? tgid : 0, comm);
            }
            w->since = now;
        } else {
            w->slot = 0; /* it runs, sleeps or stopped, or waits for another CPU now */
        }
    }
    if (tgid == TARGET_TGID) {
        if (!now)
            now = bpf_ktime_get_ns();
        u32 prev = args->prev_pid;
        u32 st = state_of(args->prev_state);
        struct thr *t = slot_of(prev);
        if (!t)
            t = new_slot(prev, st, now);
        else
            move_to(t, now, st);
        if (t && st == ST_RUN)
            waits_for(cpu, t, now);
    }
    u32 next = args->next_pid;
    if (next == 0)
        return 0;
    struct thr *n = slot_of(next);
    if (!n)
        return 0;
    if (!now)
        now = bpf_ktime_get_ns();
    if (w && w->slot == n->idx + 1)
        w->slot = 0;
    move_to(n, now, ST_ON);
    return 0;
}

static __always_inline void woken(u32 tid, u32 cpu) {
    struct thr *t = slot_of(tid);
    if (t && (t->state == ST_SLEEP || t->state == ST_STOP)) {
        u64 now = bpf_ktime_get_ns();
        move_to(t, now, ST_RUN);
        waits_for(cpu, t, now);
    }
}

TRACEPOINT_PROBE(sched, sched_wakeup) {
    woken(args->pid, args->target_cpu);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new) {
    /* a thread the engine just made: runnable from now */
    if ((bpf_get_current_pid_tgid() >> 32) == TARGET_TGID && !slot_of(args->pid)) {
        u64 now = bpf_ktime_get_ns();
        struct thr *t = new_slot(args->pid, ST_RUN, now);
        if (t)
            waits_for(args->target_cpu, t, now);
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != TARGET_TGID)
        return 0;
    struct thr *t = slot_of((u32)id);
    if (t)
        move_to(t, bpf_ktime_get_ns(), ST_GONE);
    return 0;
}

/* Every slot brought to `now`; with `emit`, each thread that was on CPU, runnable or stopped
 * during the step leaves its record; the totals restart either way. CLOSE_CHUNK slots per
 * program, the next ones by a tail call to close_more (the verifier walks each loop's every
 * iteration: one loop over MAX_THREADS slots is beyond what it accepts). */
#define CLOSE_CHUNK 32

struct close_ctx {
    u64 now;
    u64 t_start;
    u32 step_tid;
    u32 emit;
    u32 n;
    u32 next; /* the first slot the next chunk closes */
};

BPF_PERCPU_ARRAY(close_at, struct close_ctx, 1); /* a tail call keeps the CPU */
BPF_PROG_ARRAY(close_tail, 1);

static __always_inline int close_slot(u32 k, struct close_ctx *c) {
    if (k >= c->n)
        return 1;
    u32 key = k;
    struct thr *t = thr.lookup(&key);
    if (!t)
        return 1;
    move_to(t, c->now, t->state);
    u64 busy = t->ns[ST_ON] + t->ns[ST_RUN] + t->ns[ST_STOP];
    if (c->emit && busy) {
        struct wait_rec *r = waits.ringbuf_reserve(sizeof(struct wait_rec));
        if (r) {
            r->t_start = c->t_start;
            r->t_end = c->now;
            r->step_tid = c->step_tid;
            r->tid = t->tid;
            r->on_ns = t->ns[ST_ON];
            r->run_ns = t->ns[ST_RUN];
            r->sleep_ns = t->ns[ST_SLEEP];
            r->stop_ns = t->ns[ST_STOP];
            r->rec_ns = t->rec_ns;
            r->eng_ns = t->eng_ns;
            r->oth_ns = t->oth_ns;
            int top = 0;
#pragma unroll
            for (int i = 1; i < N_CAND; i++)
                if (t->cand_ns[i] > t->cand_ns[top])
                    top = i;
            r->top_tgid = t->cand_ns[top] ? t->cand_tgid[top] : 0;
            r->pad = 0;
            r->top_ns = t->cand_ns[top];
            __builtin_memcpy(r->top_comm, t->cand_comm[top], 16);
            waits.ringbuf_submit(r, 0);
        } else {
            lose(1);
        }
    }
    __builtin_memset(t->ns, 0, sizeof(t->ns));
    t->rec_ns = t->eng_ns = t->oth_ns = 0;
    __builtin_memset(t->cand_tgid, 0, sizeof(t->cand_tgid));
    __builtin_memset(t->cand_ns, 0, sizeof(t->cand_ns));
    return 0;
}

/* CLOSE_CHUNK slots from c->next, then the rest by a tail call */
static __always_inline void close_chunk(struct pt_regs *ctx, struct close_ctx *c) {
    u32 first = c->next;
#pragma unroll
    for (u32 i = 0; i < CLOSE_CHUNK; i++) {
        if (close_slot(first + i, c))
            return;
    }
    c->next = first + CLOSE_CHUNK;
    if (c->next < c->n && c->next < MAX_THREADS)
        close_tail.call(ctx, 0);
}

static __always_inline void close_slots(struct pt_regs *ctx, u64 now, struct step_now *s, int emit) {
    int z = 0;
    u32 *np = nslots.lookup(&z);
    struct close_ctx *c = close_at.lookup(&z);
    if (!c)
        return;
    c->now = now;
    c->t_start = s->t_start;
    c->step_tid = s->tid;
    c->emit = emit;
    c->n = np ? *np : 0;
    c->next = 0;
    close_chunk(ctx, c);
}

int close_more(struct pt_regs *ctx) {
    int z = 0;
    struct close_ctx *c = close_at.lookup(&z);
    if (c)
        close_chunk(ctx, c);
    return 0;
}

int step_enter(struct pt_regs *ctx) {
    int z = 0;
    struct step_now *s = step.lookup(&z);
    if (!s)
        return 0;
    u64 now = bpf_ktime_get_ns();
    close_slots(ctx, now, s, 0); /* the time between steps is nobody's */
    s->t_start = now;
    s->tid = (u32)bpf_get_current_pid_tgid();
    s->open = 1;
    return 0;
}

int step_return(struct pt_regs *ctx) {
    int z = 0;
    struct step_now *s = step.lookup(&z);
    if (!s || !s->open || s->tid != (u32)bpf_get_current_pid_tgid())
        return 0;
    close_slots(ctx, bpf_ktime_get_ns(), s, 1);
    s->open = 0;
    return 0;
}
