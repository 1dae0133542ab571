/* The shared-memory ring: many producers (launch callbacks on any engine thread, CUPTI's buffer
 * completion thread, the staging reader), one consumer (the profiler) in another process.
 * Producers reserve space with a CAS loop on write_head and never wait for the consumer: when the
 * ring is full the record is dropped and counted. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static struct ring_header *g_hdr;
static uint8_t *g_data;
static uint64_t g_cap;
static int g_active; /* 0 before init, after a fork (the child must not write the parent's ring) */
static char g_name[256];
static uint64_t g_reported; /* bit k: error key k already reported */

HIDDEN __thread int tls_busy;

HIDDEN uint64_t now_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static __thread uint32_t tls_tid;
HIDDEN uint32_t current_tid(void) {
    if (tls_tid == 0) tls_tid = (uint32_t)gettid();
    return tls_tid;
}

static uint64_t timespec_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void make_name(char *out, size_t outlen) {
    const char *env = setting("SPARSEETY_SHM_NAME");
    char pid[16];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    if (env == NULL || env[0] == '\0') {
        snprintf(out, outlen, "/sparseety-prof-cupti.%s", pid);
        return;
    }
    /* "{pid}" in the override is replaced, so that child processes inheriting it get their own. */
    size_t o = 0;
    if (env[0] != '/' && o + 1 < outlen) out[o++] = '/';
    for (const char *p = env; *p && o + 1 < outlen; p++) {
        if (strncmp(p, "{pid}", 5) == 0) {
            for (const char *q = pid; *q && o + 1 < outlen; q++) out[o++] = *q;
            p += 4;
        } else {
            out[o++] = *p;
        }
    }
    out[o] = '\0';
}

HIDDEN int ring_create(uint64_t capacity, uint32_t flags, char *err, size_t errlen) {
    make_name(g_name, sizeof g_name);
    /* A file left by a dead process with the same pid (or a test's name) is stale: replace it. */
    shm_unlink(g_name);
    int fd = shm_open(g_name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    /* Still there: another user's file (/dev/shm is sticky), planted under our name. Readers find
     * rings by what this process maps, never by name, so an unguessable name of our own serves. */
    size_t base = strlen(g_name);
    for (int tries = 0; fd < 0 && errno == EEXIST && tries < 8 && base + 18 < sizeof g_name; tries++) {
        uint64_t r = 0;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) break;
        snprintf(g_name + base, sizeof g_name - base, ".%016llx", (unsigned long long)r);
        fd = shm_open(g_name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        snprintf(err, errlen, "shm_open(%s): %s", g_name, strerror(errno));
        return -1;
    }
    size_t total = RING_HEADER_SIZE + capacity;
    void *m = MAP_FAILED;
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)total) != 0 ||
        (m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        snprintf(err, errlen, "creating %s (%zu bytes): %s", g_name, total, strerror(errno));
        close(fd);
        shm_unlink(g_name);
        return -1;
    }
    close(fd);
    g_hdr = m;
    g_data = (uint8_t *)m + RING_HEADER_SIZE;
    g_cap = capacity;
    g_hdr->version = RING_VERSION;
    g_hdr->header_size = RING_HEADER_SIZE;
    g_hdr->capacity = capacity;
    g_hdr->pid = (uint32_t)getpid();
    g_hdr->clock_domain = RING_CLOCK_CUPTI_DEFAULT;
    g_hdr->flags = flags;
    g_hdr->start_mono_ns = now_mono_ns();
    g_hdr->calib_realtime_ns = timespec_ns(CLOCK_REALTIME);
    g_hdr->calib_mono_ns = timespec_ns(CLOCK_MONOTONIC);
    /* The magic goes last: a reader that maps the file early sees "not initialised", never a
     * half-filled header. */
    __atomic_store_n(&g_hdr->magic, RING_MAGIC, __ATOMIC_RELEASE);
    __atomic_store_n(&g_active, 1, __ATOMIC_RELEASE);
    return 0;
}

HIDDEN bool ring_active(void) { return __atomic_load_n(&g_active, __ATOMIC_ACQUIRE) != 0; }
HIDDEN void ring_disable_after_fork(void) { g_active = 0; }
HIDDEN const char *ring_name(void) { return g_name; }

HIDDEN void ring_count(enum ring_counter c, uint64_t v) {
    if (g_hdr != NULL && g_active) __atomic_fetch_add(&g_hdr->counters[c], v, __ATOMIC_RELAXED);
}

HIDDEN void ring_set_clock(uint32_t domain) {
    if (g_hdr != NULL) __atomic_store_n(&g_hdr->clock_domain, domain, __ATOMIC_RELEASE);
}

HIDDEN void ring_set_finished(void) {
    if (g_hdr != NULL && g_active) __atomic_store_n(&g_hdr->finished, 1u, __ATOMIC_RELEASE);
}

HIDDEN struct rec_header *ring_reserve(uint16_t type, size_t len) {
    if (!ring_active()) return NULL;
    len = (len + 7) & ~(size_t)7;
    if (len > g_cap || len > UINT32_MAX) {
        ring_count(CTR_RING_DROPPED, 1);
        return NULL;
    }
    uint64_t head = __atomic_load_n(&g_hdr->write_head, __ATOMIC_RELAXED);
    uint64_t pad;
    for (;;) {
        /* Acquire pairs with the reader's release of read_tail: the reader finished reading and
         * zeroing everything below the tail before we write there. */
        uint64_t tail = __atomic_load_n(&g_hdr->read_tail, __ATOMIC_ACQUIRE);
        uint64_t off = head & (g_cap - 1);
        /* A record never wraps: if it does not fit before the end, a PAD record fills the rest. */
        pad = off + len > g_cap ? g_cap - off : 0;
        if (head + pad + len - tail > g_cap) {
            ring_count(CTR_RING_DROPPED, 1);
            return NULL;
        }
        if (__atomic_compare_exchange_n(&g_hdr->write_head, &head, head + pad + len, true, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            break;
    }
    if (pad) {
        struct rec_header *p = (struct rec_header *)(g_data + (head & (g_cap - 1)));
        p->type = REC_PAD;
        p->reserved = 0;
        __atomic_store_n(&p->length, (uint32_t)pad, __ATOMIC_RELEASE);
    }
    struct rec_header *h = (struct rec_header *)(g_data + ((head + pad) & (g_cap - 1)));
    h->type = type;
    h->reserved = 0;
    return h;
}

HIDDEN void ring_commit(struct rec_header *h, size_t len) {
    /* Release: the payload is visible before the reader can see a non-zero length. */
    __atomic_store_n(&h->length, (uint32_t)((len + 7) & ~(size_t)7), __ATOMIC_RELEASE);
    ring_count(CTR_RECORDS_WRITTEN, 1);
}

HIDDEN void report_error(unsigned key, int code, const char *fmt, ...) {
    if (key > 0 && key < 64) {
        uint64_t bit = 1ull << key;
        if (__atomic_fetch_or(&g_reported, bit, __ATOMIC_RELAXED) & bit) return;
    }
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    size_t tl = (size_t)n < sizeof text ? (size_t)n : sizeof text - 1;
    fprintf(stderr, LOG_PREFIX "%s\n", text);
    size_t len = sizeof(struct rec_header) + sizeof(struct rec_error) + tl;
    struct rec_header *h = ring_reserve(REC_ERROR, len);
    if (h == NULL) return;
    struct rec_error *e = (struct rec_error *)(h + 1);
    e->code = code;
    e->text_len = (uint32_t)tl;
    memcpy(e + 1, text, tl);
    ring_commit(h, len);
}
