/* Layout of the shared-memory ring written by libsparseety_cupti.so and read by
 * sparseety_prof/gpu/shm_ring.py. Everything is little-endian, naturally aligned, and fixed by
 * the static assertions below: change the layout only together with RING_VERSION and the reader.
 * cupti_ext/README.md describes the same layout in prose. */
#ifndef SPARSEETY_RING_FORMAT_H
#define SPARSEETY_RING_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#define RING_MAGIC 0x49545055434b5053ULL /* "SPKCUPTI" read as a little-endian u64 */
#define RING_VERSION 1u
#define RING_HEADER_SIZE 4096u /* the data area starts page-aligned */

/* ring_header.flags bits */
#define RING_FLAG_LATE_ATTACH 1u /* loaded into a running process (ptrace + dlopen), not at cuInit */

enum ring_clock_domain {
    RING_CLOCK_CUPTI_DEFAULT = 0, /* timestamp callback not registered: CUPTI's own clock (realtime) */
    RING_CLOCK_MONOTONIC = 1,     /* CUPTI stamps activity with our CLOCK_MONOTONIC callback */
};

/* One u64 per counter; the order is part of the format. */
enum ring_counter {
    CTR_ACTIVITY_DROPPED = 0,
    CTR_RING_DROPPED,
    CTR_BUFFERS_SKIPPED_SAMPLING,
    CTR_BUFFERS_SKIPPED_BUDGET,
    CTR_BUFFERS_FAILED,
    CTR_CALLBACK_NS,
    CTR_LAUNCHES_SEEN,
    CTR_GRAPH_LAUNCHES,
    CTR_RECORDS_WRITTEN,
    CTR_BUFFERS_COPIED,
    CTR_COUNT
};

struct ring_header {
    uint64_t magic;             /* 0 */
    uint32_t version;           /* 8 */
    uint32_t header_size;       /* 12: bytes before the data area */
    uint64_t capacity;          /* 16: data bytes, a power of two */
    uint32_t pid;               /* 24 */
    uint32_t clock_domain;      /* 28: enum ring_clock_domain actually in effect */
    uint64_t start_mono_ns;     /* 32: producer start, CLOCK_MONOTONIC */
    uint64_t calib_realtime_ns; /* 40: CLOCK_REALTIME ...                         */
    uint64_t calib_mono_ns;     /* 48: ... and CLOCK_MONOTONIC read back to back at init */
    uint32_t finished;          /* 56: 1 once the producer flushed at exit */
    uint32_t flags;             /* 60: RING_FLAG_* bits, set before the magic */
    uint64_t write_head;        /* 64: bytes reserved by producers since start (monotonic) */
    uint8_t pad0[56];
    uint64_t read_tail;         /* 128: bytes consumed by the reader (monotonic), own cache line */
    uint8_t pad1[56];
    uint64_t counters[CTR_COUNT]; /* 192 */
};

/* Every record starts with this header and is padded to a multiple of 8 bytes.
 * `length` (whole record, header included) is the commit word: 0 means "not written yet"; the
 * producer stores it last with release semantics; the reader zeroes what it consumed before it
 * advances read_tail, so reserved-but-unwritten space always reads as 0. */
struct rec_header {
    uint32_t length;
    uint16_t type;
    uint16_t reserved;
};

enum rec_type {
    REC_PAD = 0x50, /* filler up to the end of the data area; skip it */
    REC_KERNEL = 1,
    REC_LAUNCH_API = 2,
    REC_MEMCPY = 3,
    REC_WATCHED_BUFFER = 4,
    REC_ERROR = 5,
    REC_WATCHED_GRAPH_BUFFER = 6, /* a watched buffer of a CUDA graph replay (readers that predate it skip it) */
};

/* REC_KERNEL payload; the kernel name (name_len bytes, no NUL) follows. */
struct rec_kernel {
    uint64_t start_ns, end_ns, graph_node_id;
    uint32_t correlation_id, device_id, context_id, stream_id;
    int32_t grid[3], block[3];
    uint32_t shared_mem_bytes; /* static + dynamic per block */
    uint32_t graph_id;
    uint32_t name_len;
    uint32_t reserved;
};

/* REC_LAUNCH_API payload; the API name (name_len bytes) follows. */
struct rec_launch_api {
    uint64_t enter_ns, exit_ns; /* CLOCK_MONOTONIC, always (read by the library itself) */
    uint64_t graph_exec_id;     /* graph launches: cuptiGetGraphExecId, else 0 */
    uint32_t correlation_id, tid, pid;
    uint16_t cbid;
    uint8_t domain; /* 1 driver, 2 runtime (CUpti_CallbackDomain) */
    uint8_t reserved0;
    uint32_t name_len;
    uint32_t reserved1;
};

/* REC_MEMCPY payload */
struct rec_memcpy {
    uint64_t start_ns, end_ns, bytes;
    uint32_t correlation_id, device_id, context_id, stream_id, graph_id;
    uint8_t copy_kind; /* CUpti_ActivityMemcpyKind */
    uint8_t src_kind, dst_kind, flags;
};

/* REC_WATCHED_BUFFER payload; the kernel name (name_len bytes) padded to 8, then data_len bytes. */
#define WATCH_MAX_DIMS 4
struct rec_watched {
    uint64_t launch_ns; /* CLOCK_MONOTONIC at API exit of the launch */
    uint32_t correlation_id, tid, arg_index;
    uint32_t dtype; /* enum watch_dtype */
    uint32_t ndim, name_len;
    uint64_t data_len;
    uint64_t shape[WATCH_MAX_DIMS];
};

/* REC_WATCHED_GRAPH_BUFFER payload: struct rec_watched (correlation_id: the cuGraphLaunch's), then
 * these 16 bytes, then the kernel name padded to 8 and the data as in REC_WATCHED_BUFFER. */
struct rec_watched_graph {
    uint64_t graph_node_id; /* CUPTI's id of the executable graph's node: the kernel record's graphNodeId */
    uint32_t graph_id;      /* CUPTI's id of the graph it was instantiated from */
    uint32_t reserved;
};

/* REC_ERROR payload; the message (text_len bytes, UTF-8) follows. */
struct rec_error {
    int32_t code; /* CUptiResult / CUresult / errno, or -1 */
    uint32_t text_len;
};

enum watch_dtype {
    DT_INT8 = 1, DT_UINT8, DT_INT16, DT_UINT16, DT_INT32, DT_UINT32, DT_INT64, DT_UINT64,
    DT_FLOAT16, DT_BFLOAT16, DT_FLOAT32, DT_FLOAT64, DT_BOOL,
};

_Static_assert(sizeof(struct ring_header) == 192 + 8 * CTR_COUNT, "ring header layout");
_Static_assert(offsetof(struct ring_header, write_head) == 64, "write_head offset");
_Static_assert(offsetof(struct ring_header, read_tail) == 128, "read_tail offset");
_Static_assert(sizeof(struct ring_header) <= RING_HEADER_SIZE, "header fits");
_Static_assert(sizeof(struct rec_header) == 8, "record header");
_Static_assert(sizeof(struct rec_kernel) == 80, "kernel record");
_Static_assert(sizeof(struct rec_launch_api) == 48, "launch record");
_Static_assert(sizeof(struct rec_memcpy) == 48, "memcpy record");
_Static_assert(sizeof(struct rec_watched) == 72, "watched record");
_Static_assert(sizeof(struct rec_error) == 8, "error record");
_Static_assert(sizeof(struct rec_watched_graph) == 16, "watched graph record");

#endif
