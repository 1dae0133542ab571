/* Copies of watched kernel arguments. At API exit of a watched launch the callback enqueues
 * cuMemcpyDtoHAsync into a slot of a pinned staging area plus cuEventRecord, both on the launch's
 * own stream, so the copy runs right after the kernel and the engine never waits for it. A reader
 * thread polls the events in slot order and publishes completed slots as WATCHED_BUFFER records.
 *
 * Slot allocation takes a spinlock held for a few dozen instructions (never across a CUDA call);
 * the reader never takes it. Slots are freed in FIFO order, so the pinned area is a byte ring. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SLOTS 256u            /* power of two */
#define SLOT_ALIGN 256u       /* keep every copy's destination nicely aligned */
#define NAME_MAX_COPY 1024u

enum slot_state { S_FREE = 0, S_FILLING, S_READY, S_FAILED };

struct slot {
    uint32_t state; /* enum slot_state, atomic */
    uint64_t start, end; /* absolute byte positions in the pinned ring */
    CUevent ev;     /* created on first use of the slot, then reused */
    uint32_t correlation_id, tid, arg_index, dtype, ndim;
    uint64_t launch_ns, bytes;
    uint64_t shape[WATCH_MAX_DIMS];
    uint32_t graph_id;
    uint64_t graph_node_id; /* 0: an eager launch */
    char name[NAME_MAX_COPY];
};

static struct slot g_slots[SLOTS];
static size_t g_size;   /* pinned bytes (SPARSEETY_STAGING_BYTES) */
static uint8_t *g_pinned;
static CUcontext g_ctx; /* the pinned memory and events belong to this context */
static uint32_t g_init; /* 0 not yet, 1 initialising, 2 ready, 3 failed (atomics) */
static uint32_t g_lock; /* spinlock for the allocation heads */
static uint64_t g_byte_head, g_byte_tail; /* head: allocators under g_lock; tail: reader only */
static uint32_t g_slot_head, g_slot_tail;
static pthread_t g_thread;
static int g_thread_started, g_stop;

HIDDEN void staging_configure(size_t staging_bytes) { g_size = staging_bytes; }

static void lock(void) {
    while (__atomic_exchange_n(&g_lock, 1u, __ATOMIC_ACQUIRE)) sched_yield();
}
static void unlock(void) { __atomic_store_n(&g_lock, 0u, __ATOMIC_RELEASE); }

static void publish(struct slot *s) {
    size_t name_len = strnlen(s->name, sizeof s->name);
    size_t name_pad = (name_len + 7) & ~(size_t)7;
    bool graph = s->graph_node_id != 0;
    size_t extra = graph ? sizeof(struct rec_watched_graph) : 0;
    size_t len = sizeof(struct rec_header) + sizeof(struct rec_watched) + extra + name_pad + s->bytes;
    struct rec_header *h = ring_reserve(graph ? REC_WATCHED_GRAPH_BUFFER : REC_WATCHED_BUFFER, len);
    if (h == NULL) return; /* counted as ring_dropped */
    struct rec_watched *w = (struct rec_watched *)(h + 1);
    w->launch_ns = s->launch_ns;
    w->correlation_id = s->correlation_id;
    w->tid = s->tid;
    w->arg_index = s->arg_index;
    w->dtype = s->dtype;
    w->ndim = s->ndim;
    w->name_len = (uint32_t)name_len;
    w->data_len = s->bytes;
    memcpy(w->shape, s->shape, sizeof w->shape);
    uint8_t *p = (uint8_t *)(w + 1);
    if (graph) {
        struct rec_watched_graph *g = (struct rec_watched_graph *)p;
        g->graph_node_id = s->graph_node_id;
        g->graph_id = s->graph_id;
        g->reserved = 0;
        p += sizeof *g;
    }
    memcpy(p, s->name, name_len);
    memcpy(p + name_pad, g_pinned + (s->start % g_size), s->bytes);
    ring_commit(h, len);
    ring_count(CTR_BUFFERS_COPIED, 1);
}

/* One pass over the pending slots, oldest first. Returns how many are still pending. */
static unsigned poll_once(void) {
    for (;;) {
        uint32_t tail = g_slot_tail;
        if (tail == __atomic_load_n(&g_slot_head, __ATOMIC_ACQUIRE)) return 0;
        struct slot *s = &g_slots[tail & (SLOTS - 1)];
        uint32_t st = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
        if (st == S_FILLING) return 1; /* the launching thread is still enqueueing it */
        if (st == S_READY) {
            CUresult r = cu.EventQuery(s->ev);
            if (r == CUDA_ERROR_NOT_READY) return 1;
            if (r == CUDA_SUCCESS) {
                publish(s);
            } else {
                ring_count(CTR_BUFFERS_FAILED, 1);
                report_error(ERRK_STAGING_QUERY, (int)r, "cuEventQuery on a staging copy failed: %s",
                             cu_error_name(r));
            }
        }
        __atomic_store_n(&s->state, S_FREE, __ATOMIC_RELAXED);
        __atomic_store_n(&g_byte_tail, s->end, __ATOMIC_RELEASE);
        __atomic_store_n(&g_slot_tail, tail + 1, __ATOMIC_RELEASE);
    }
}

static void *reader_main(void *arg) {
    (void)arg;
    tls_busy = 1; /* nothing this thread calls may be treated as an engine call */
    if (cu.CtxSetCurrent != NULL) {
        CUresult r = cu.CtxSetCurrent(g_ctx);
        if (r != CUDA_SUCCESS)
            report_error(ERRK_STAGING_CTX, (int)r, "staging reader: cuCtxSetCurrent failed: %s", cu_error_name(r));
    }
    /* cuEventQuery is "potentially unsafe" while another thread captures a stream in global mode
     * (torch.cuda.graph's default): from a thread in that mode it fails and invalidates the
     * engine's capture (seen on an H200: a copy still pending when the engine began capturing
     * made its capture_end fail). This thread only polls its own events: relaxed for good. */
    if (cu.ThreadExchangeStreamCaptureMode != NULL) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        cu.ThreadExchangeStreamCaptureMode(&mode);
    }
    while (!__atomic_load_n(&g_stop, __ATOMIC_ACQUIRE)) {
        unsigned pending = poll_once();
        /* 200 us while copies are in flight keeps the pinned ring free; idle polling is cheap. */
        struct timespec ts = {0, pending ? 200000 : 5000000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* First watched launch: the pinned area needs a current context, which InitializeInjection (run
 * inside cuInit) does not have yet. A watched launch on another thread meanwhile waits for that
 * one-time allocation, at most INIT_WAIT_NS, then counts its buffer as failed. */
#define INIT_WAIT_NS 5000000ull
static bool ensure_init(CUcontext ctx) {
    uint32_t st = __atomic_load_n(&g_init, __ATOMIC_ACQUIRE);
    if (st == 2) return true;
    uint32_t expect = 0;
    if (st != 0 ||
        !__atomic_compare_exchange_n(&g_init, &expect, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        uint64_t deadline = now_mono_ns() + INIT_WAIT_NS;
        while ((st = __atomic_load_n(&g_init, __ATOMIC_ACQUIRE)) == 1 && now_mono_ns() < deadline) sched_yield();
        return st == 2;
    }
    void *p = NULL;
    /* A global-mode stream capture anywhere in the process forbids "potentially unsafe" calls such
     * as cuMemAllocHost on every thread that has not switched itself to relaxed mode, and the call
     * would invalidate that capture: this thread switches for the one allocation. */
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    bool relaxed = cu.ThreadExchangeStreamCaptureMode != NULL &&
                   cu.ThreadExchangeStreamCaptureMode(&mode) == CUDA_SUCCESS;
    CUresult r = cu.MemAllocHost != NULL ? cu.MemAllocHost(&p, g_size) : CUDA_ERROR_NOT_FOUND;
    if (relaxed) cu.ThreadExchangeStreamCaptureMode(&mode); /* back to the thread's own mode */
    if (r != CUDA_SUCCESS || p == NULL) {
        report_error(ERRK_STAGING_INIT, (int)r, "cuMemAllocHost(%zu) for the staging area failed: %s; "
                     "watched buffers are not captured", g_size, cu_error_name(r));
        __atomic_store_n(&g_init, 3u, __ATOMIC_RELEASE);
        return false;
    }
    g_pinned = p;
    g_ctx = ctx;
    if (pthread_create(&g_thread, NULL, reader_main, NULL) != 0) {
        report_error(ERRK_STAGING_INIT, -1, "cannot start the staging reader thread; watched buffers are not captured");
        __atomic_store_n(&g_init, 3u, __ATOMIC_RELEASE);
        return false;
    }
    g_thread_started = 1;
    __atomic_store_n(&g_init, 2u, __ATOMIC_RELEASE);
    return true;
}

HIDDEN void staging_enqueue(const struct staging_request *q) {
    if (!ensure_init(q->ctx)) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        return;
    }
    if (q->ctx != g_ctx) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        report_error(ERRK_STAGING_CTX, -1, "watched launch on a second CUDA context: only the first context's "
                     "launches are captured");
        return;
    }
    uint64_t need = (q->bytes + SLOT_ALIGN - 1) & ~(uint64_t)(SLOT_ALIGN - 1);
    if (need > g_size) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        report_error(ERRK_WATCH_SIZE, -1, "watched buffer of %s is %llu bytes, larger than SPARSEETY_STAGING_BYTES "
                     "(%zu)", q->w->pattern, (unsigned long long)q->bytes, g_size);
        return;
    }
    lock();
    uint32_t sh = g_slot_head;
    uint64_t head = g_byte_head;
    uint64_t off = head % g_size;
    uint64_t start = off + need > g_size ? head + (g_size - off) : head; /* never split a copy */
    bool ok = sh - __atomic_load_n(&g_slot_tail, __ATOMIC_ACQUIRE) < SLOTS &&
              start + need - __atomic_load_n(&g_byte_tail, __ATOMIC_ACQUIRE) <= g_size;
    struct slot *s = &g_slots[sh & (SLOTS - 1)];
    if (ok) {
        s->state = S_FILLING;
        s->start = start;
        s->end = start + need;
        g_byte_head = start + need;
        __atomic_store_n(&g_slot_head, sh + 1, __ATOMIC_RELEASE);
    }
    unlock();
    if (!ok) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        report_error(ERRK_STAGING_FULL, -1, "staging area full (the reader is behind): watched buffers are being "
                     "skipped; raise SPARSEETY_STAGING_BYTES or SPARSEETY_SAMPLE_EVERY");
        return;
    }
    s->correlation_id = q->correlation_id;
    s->tid = q->tid;
    s->arg_index = q->w->arg_index;
    s->dtype = q->w->dtype;
    s->ndim = (uint32_t)q->w->ndim;
    s->launch_ns = q->launch_ns;
    s->bytes = q->bytes;
    memcpy(s->shape, q->shape, sizeof s->shape);
    s->graph_id = q->graph_id;
    s->graph_node_id = q->graph_node_id;
    snprintf(s->name, sizeof s->name, "%s", q->kernel_name);

    uint32_t final = S_FAILED;
    CUresult r = CUDA_SUCCESS;
    if (s->ev == NULL) r = cu.EventCreate(&s->ev, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
        s->ev = NULL;
        report_error(ERRK_STAGING_EVENT, (int)r, "cuEventCreate failed: %s", cu_error_name(r));
    } else if ((r = cu.MemcpyDtoHAsync(g_pinned + start % g_size, q->src, q->bytes, q->stream)) != CUDA_SUCCESS) {
        report_error(ERRK_STAGING_COPY, (int)r, "cuMemcpyDtoHAsync of a watched buffer (%s) failed: %s",
                     q->w->pattern, cu_error_name(r));
    } else if ((r = cu.EventRecord(s->ev, q->stream)) != CUDA_SUCCESS) {
        report_error(ERRK_STAGING_EVENT, (int)r, "cuEventRecord failed: %s", cu_error_name(r));
    } else {
        final = S_READY;
    }
    if (final == S_FAILED) ring_count(CTR_BUFFERS_FAILED, 1);
    __atomic_store_n(&s->state, final, __ATOMIC_RELEASE);
}

HIDDEN void staging_shutdown(unsigned timeout_ms) {
    if (__atomic_load_n(&g_init, __ATOMIC_ACQUIRE) != 2) return;
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
    if (g_thread_started) {
        pthread_join(g_thread, NULL);
        g_thread_started = 0;
    }
    uint64_t deadline = now_mono_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (poll_once() != 0 && now_mono_ns() < deadline) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}
