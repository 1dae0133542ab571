/* The ring watch's thread in C (sparseety_prof/session/ring_watch.py NativeRingWatch): it raises
 * the consumer's priority the moment the producers say the ring is filling, without Python's GIL.
 *
 * Why not in Python: to raise the priority a Python thread needs the GIL, and the consumer holds it
 * wherever the kernel stopped it. At nice 10 the consumer runs again within milliseconds and hands
 * the GIL over; under --sched idle (SCHED_IDLE) on cores the engine keeps busy it may not run for
 * seconds, and a Python watch then escalated 6 s late, after the ring had filled and dropped
 * records (docs/overhead.md, "How the consumer keeps up"). This thread never takes the GIL: it
 * sleeps in epoll on the ring's map fd (edge-triggered: woken by the producer that passes the armed
 * mark, rb_wake() in probes/token_probes.bpf.c), reads the two ring positions, and when the pending
 * share passes the threshold it makes the consumer's thread SCHED_OTHER (if it was SCHED_IDLE) at
 * `nice_to`, once until reset. The Python side learns of it at its next drain (the escalation
 * count) and keeps the rest of the rule (counting, the slice, relaxing).
 *
 * One wakeup per arming: a producer's wakeup that finds the ring below the threshold (the mark is an
 * estimate from the mean record size, and errs early before the first drain, when it assumes the
 * largest records) leaves it disarmed until the consumer's next drain rearms it. A consumer
 * starved of CPU does not drain, so nothing would wake the watch again while the ring filled: under
 * --sched idle the first drain's early wakeup was followed by 6-8 s of records lost. So after such
 * a wakeup the thread follows the ring, reading its positions every FOLLOW_MS, until the
 * consumer rearms it (sparseety_watch_armed; not merely moves its position: a starved consumer
 * releases part of the ring now and then, long before its drain ends) or it escalates. Each timer
 * wakeup costs a little CPU (docs/overhead.md): a few a second, and only between an early wakeup
 * and the next drain.
 *
 * With `max_gap_ms`, records never wait in the ring longer than about that for a consumer that does
 * not drain: every max_gap_ms the thread checks whether the consumer rearmed it since the last
 * check (it does after every drain), and escalates when it did not while records are pending. A
 * consumer under --sched idle on cores the engine keeps busy otherwise drains only when the ring
 * fills: with a sampling policy, tens of seconds apart (docs/overhead.md), so the live view and
 * the sinks saw rows that late. Once per max_gap_ms, a timer wakeup.
 *
 * With `all_threads`, the escalation raises every other thread of the process too (the recorder's:
 * Polars' pool and its Parquet writers' runtime run the consumer's frames and writes, and a thread
 * made while the consumer was low keeps the priority it inherited, so the raised consumer would
 * wait on a SCHED_IDLE worker; session/thread_priority.py).
 *
 * The thread takes SCHED_OTHER at nice 0 itself first: a thread inherits its creator's policy
 * and niceness, and a watch that stays SCHED_IDLE never runs when it is needed.
 *
 * Built by build.sh next to libringwalk.so; without it the Python watch is used.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RW_EXPORT __attribute__((visibility("default")))
#define RWATCH_ABI_VERSION 5
/* Between readings while following the ring (above): FOLLOW_MS, doubled after each reading that
 * finds the ring filled by less than FOLLOW_STEP of it since the last, up to FOLLOW_MAX_MS (a
 * consumer starved by a slow-filling ring read it over a thousand times at a fixed interval). At the
 * fastest fill measured, a ring a second, the longest wait leaves most of the ring past the
 * threshold to spare. */
#define FOLLOW_MS 20
#define FOLLOW_MAX_MS 250
#define FOLLOW_STEP 0.05

struct sparseety_watch {
    pthread_t thread;
    int epfd, stop_fd;
    const volatile uint64_t *prod, *cons; /* the ring's producer and consumer positions */
    uint64_t size;                        /* the ring's data bytes */
    double threshold;                     /* pending share that escalates */
    pid_t consumer_tid;
    int nice_to;
    int all_threads; /* escalate every thread of the process but this one, not the consumer's alone */
    int max_gap_ms;  /* escalate when no drain came for this long while records wait; 0: never */
    pid_t tid; /* the watch's own thread, once started */
    /* written by the watch's thread, read by the consumer's (atomics) */
    uint64_t wakeups, readings, escalations, polls; /* polls: timed readings while following */
    uint64_t gap_escalations; /* escalations for a drain overdue (max_gap_ms), of `escalations` */
    uint64_t arms; /* times the consumer rearmed the producers' wakeup (sparseety_watch_armed) */
    int escalated; /* set here when escalating, cleared by sparseety_watch_reset */
    int started;
};

RW_EXPORT int sparseety_watch_abi(void) { return RWATCH_ABI_VERSION; }

static void raise_thread(pid_t tid, int nice_to) {
    struct sched_param p = {0};
    /* the niceness first: a SCHED_IDLE thread made SCHED_OTHER keeps the niceness it had */
    setpriority(PRIO_PROCESS, (id_t)tid, nice_to);
    if (sched_getscheduler(tid) == SCHED_IDLE) sched_setscheduler(tid, SCHED_OTHER, &p);
}

static void escalate(struct sparseety_watch *w) {
    raise_thread(w->consumer_tid, w->nice_to);
    if (!w->all_threads) return;
    DIR *d = opendir("/proc/self/task");
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long tid = strtol(e->d_name, &end, 10);
        if (*end != '\0' || tid <= 0 || tid == w->tid || tid == w->consumer_tid) continue;
        raise_thread((pid_t)tid, w->nice_to);
    }
    closedir(d);
}

static uint64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static double pending_share(const struct sparseety_watch *w) {
    uint64_t prod = __atomic_load_n(w->prod, __ATOMIC_ACQUIRE);
    uint64_t cons = __atomic_load_n(w->cons, __ATOMIC_ACQUIRE);
    return prod > cons ? (double)(prod - cons) / (double)w->size : 0.0;
}

/* Escalate unless escalated already; `gap`: because a drain is overdue (counted apart too). */
static void escalate_once(struct sparseety_watch *w, int gap) {
    if (__atomic_exchange_n(&w->escalated, 1, __ATOMIC_ACQ_REL)) return;
    escalate(w);
    if (gap) __atomic_add_fetch(&w->gap_escalations, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&w->escalations, 1, __ATOMIC_RELEASE);
}

/* Whether the watch follows the ring after a reading, and how long until its next reading. */
struct sparseety_follow {
    int following;      /* reading the ring on a timer (since a wakeup below the threshold) */
    uint64_t arms_seen; /* the consumer's arms when the following began */
    int wait_ms;        /* until the next reading while following */
    double last;        /* the share pending at the last reading */
};

/* The follow rule, after a reading of `share` (woken by a producer, `woke`, or on the timer while
 * following), with `escalated` and the consumer's `arms` as they are now: escalated, it sleeps
 * (the consumer's drains rearm it); woken below the threshold, it follows the ring from FOLLOW_MS;
 * rearmed since, it sleeps again; else the wait doubles while the ring fills slowly. Pure, and
 * exported: tests/test_native_twins.py holds it equal to ring_watch.py's FollowRule. */
RW_EXPORT void sparseety_watch_follow(struct sparseety_follow *f, int woke, int escalated, uint64_t arms, double share) {
    if (escalated) {
        f->following = 0;
    } else if (woke) {
        f->following = 1; /* disarmed until the next arming */
        f->wait_ms = FOLLOW_MS;
        f->arms_seen = arms;
    } else if (arms != f->arms_seen) {
        f->following = 0;
    } else if (share - f->last < FOLLOW_STEP) {
        f->wait_ms = f->wait_ms * 2 < FOLLOW_MAX_MS ? f->wait_ms * 2 : FOLLOW_MAX_MS;
    } else {
        f->wait_ms = FOLLOW_MS;
    }
    f->last = share;
}

static void *run(void *arg) {
    struct sparseety_watch *w = arg;
    struct sched_param p = {0};
    pid_t self = (pid_t)syscall(SYS_gettid);
    if (sched_getscheduler(0) == SCHED_IDLE) sched_setscheduler(0, SCHED_OTHER, &p);
    setpriority(PRIO_PROCESS, (id_t)self, 0); /* root may; without CAP_SYS_NICE it stays low */
    __atomic_store_n(&w->tid, self, __ATOMIC_RELEASE);
    __atomic_store_n(&w->started, 1, __ATOMIC_RELEASE);
    struct epoll_event ev[2];
    struct sparseety_follow follow = {.wait_ms = FOLLOW_MS};
    uint64_t follow_at = 0; /* while following the ring: when the next reading is due; else 0 */
    /* the drain check (max_gap_ms): when it is due (0: never), and the arms at the last one */
    uint64_t check_at = w->max_gap_ms > 0 ? now_ms() + (uint64_t)w->max_gap_ms : 0;
    uint64_t arms_checked = __atomic_load_n(&w->arms, __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t due = follow_at && check_at ? (follow_at < check_at ? follow_at : check_at) : follow_at | check_at;
        uint64_t now = now_ms();
        int timeout = !due ? -1 : due > now ? (int)(due - now) : 0;
        int n = epoll_wait(w->epfd, ev, 2, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        for (int i = 0; i < n; i++)
            if (ev[i].data.fd == w->stop_fd) return NULL;
        now = now_ms();
        if (check_at && now >= check_at) {
            /* no drain since the last check (none rearmed the watch) and records waiting */
            uint64_t arms = __atomic_load_n(&w->arms, __ATOMIC_ACQUIRE);
            if (arms == arms_checked && pending_share(w) > 0.0) escalate_once(w, 1);
            arms_checked = arms;
            check_at = now + (uint64_t)w->max_gap_ms;
        }
        if (n == 0 && !(follow_at && now >= follow_at)) continue; /* the drain check's wakeup alone */
        __atomic_add_fetch(n > 0 ? &w->wakeups : &w->polls, 1, __ATOMIC_RELAXED);
        double share = pending_share(w);
        __atomic_add_fetch(&w->readings, 1, __ATOMIC_RELAXED);
        if (share > w->threshold) escalate_once(w, 0);
        sparseety_watch_follow(&follow, n > 0, __atomic_load_n(&w->escalated, __ATOMIC_ACQUIRE),
                               __atomic_load_n(&w->arms, __ATOMIC_ACQUIRE), share);
        follow_at = follow.following ? now + (uint64_t)follow.wait_ms : 0;
    }
}

/* Start watching: `wake_fd` the ring's map fd, `prod` and `cons` the addresses of its positions
 * (mapped by the caller, kept mapped until sparseety_watch_stop returns), `size` its data bytes;
 * past `threshold` raise `consumer_tid` to `nice_to` (and, with `all_threads`, every other thread
 * of the process but the watch's), and the same when records wait while no drain came for
 * `max_gap_ms` (0: never). NULL on failure (errno set). */
RW_EXPORT struct sparseety_watch *sparseety_watch_start(int wake_fd, const uint64_t *prod, const uint64_t *cons,
                                                        uint64_t size, double threshold, int consumer_tid,
                                                        int nice_to, int all_threads, int max_gap_ms) {
    struct sparseety_watch *w = calloc(1, sizeof(*w));
    if (w == NULL) return NULL;
    w->prod = prod;
    w->cons = cons;
    w->size = size ? size : 1;
    w->threshold = threshold;
    w->consumer_tid = consumer_tid;
    w->nice_to = nice_to;
    w->all_threads = all_threads;
    w->max_gap_ms = max_gap_ms > 0 ? max_gap_ms : 0;
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    w->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->epfd < 0 || w->stop_fd < 0) goto fail;
    struct epoll_event ring = {.events = EPOLLIN | EPOLLET, .data.fd = wake_fd};
    struct epoll_event stop = {.events = EPOLLIN, .data.fd = w->stop_fd};
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, wake_fd, &ring) || epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->stop_fd, &stop))
        goto fail;
    if (pthread_create(&w->thread, NULL, run, w) != 0) goto fail;
    return w;
fail: {
    int e = errno;
    if (w->epfd >= 0) close(w->epfd);
    if (w->stop_fd >= 0) close(w->stop_fd);
    free(w);
    errno = e;
    return NULL;
}
}

/* Stop the thread (before the ring is unmapped); its counters stay readable until
 * sparseety_watch_free. */
RW_EXPORT void sparseety_watch_stop(struct sparseety_watch *w) {
    if (w == NULL || w->epfd < 0) return;
    uint64_t one = 1;
    while (write(w->stop_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    pthread_join(w->thread, NULL);
    close(w->epfd);
    close(w->stop_fd);
    w->epfd = w->stop_fd = -1;
}

/* Stop the watch if it runs, then free it. */
RW_EXPORT void sparseety_watch_free(struct sparseety_watch *w) {
    if (w == NULL) return;
    sparseety_watch_stop(w);
    free(w);
}

/* The consumer escalated or relaxed by its own rule: `escalated` 1 keeps the watch from escalating
 * again (and counting it), 0 lets it escalate at the next wakeup past the threshold. */
RW_EXPORT void sparseety_watch_set_escalated(struct sparseety_watch *w, int escalated) {
    __atomic_store_n(&w->escalated, escalated ? 1 : 0, __ATOMIC_RELEASE);
}

/* The consumer armed the producers' wakeup again (after a drain): a watch following the ring
 * since a wakeup below the threshold goes back to sleeping until woken. */
RW_EXPORT void sparseety_watch_armed(struct sparseety_watch *w) { __atomic_add_fetch(&w->arms, 1, __ATOMIC_RELEASE); }

/* Counters: 0 wakeups, 1 readings, 2 escalations, 3 the watch's thread id (0 until started), 4 polls
 * (readings while following the ring), 5 escalations for a drain overdue (max_gap_ms). */
RW_EXPORT uint64_t sparseety_watch_counter(const struct sparseety_watch *w, int which) {
    switch (which) {
    case 0:
        return __atomic_load_n(&w->wakeups, __ATOMIC_RELAXED);
    case 1:
        return __atomic_load_n(&w->readings, __ATOMIC_RELAXED);
    case 2:
        return __atomic_load_n(&w->escalations, __ATOMIC_ACQUIRE);
    case 3:
        return __atomic_load_n(&w->started, __ATOMIC_ACQUIRE) ? (uint64_t)__atomic_load_n(&w->tid, __ATOMIC_ACQUIRE)
                                                                : 0;
    case 4:
        return __atomic_load_n(&w->polls, __ATOMIC_RELAXED);
    case 5:
        return __atomic_load_n(&w->gap_escalations, __ATOMIC_RELAXED);
    default:
        return 0;
    }
}
