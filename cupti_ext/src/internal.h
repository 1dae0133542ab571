/* Internal interfaces of libsparseety_cupti.so (all hidden; only InitializeInjection is exported). */
#ifndef SPARSEETY_INTERNAL_H
#define SPARSEETY_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>
#include <cupti.h>

#include "ring_format.h"

#define HIDDEN __attribute__((visibility("hidden")))
#define LOG_PREFIX "[sparseety-cupti] "

/* ---- time and threads ---- */
HIDDEN uint64_t now_mono_ns(void);
HIDDEN uint32_t current_tid(void);
/* Set while the library itself calls into CUDA/CUPTI on this thread: the callbacks those calls
 * trigger (our own staging copy and event record) must not recurse into the library's logic. */
extern HIDDEN __thread int tls_busy;

/* ---- ring (ring.c) ---- */
HIDDEN int ring_create(uint64_t capacity, uint32_t flags, char *err, size_t errlen);
/* A SPARSEETY_* setting: the late-attach settings text when given, else the environment. */
HIDDEN const char *setting(const char *name);
HIDDEN bool ring_active(void);
HIDDEN void ring_disable_after_fork(void);
/* Reserve a record of `len` bytes (header included; padded to 8). NULL: no room (counted in
 * ring_dropped) or no ring. Fill the payload, then ring_commit. */
HIDDEN struct rec_header *ring_reserve(uint16_t type, size_t len);
HIDDEN void ring_commit(struct rec_header *h, size_t len);
HIDDEN void ring_count(enum ring_counter c, uint64_t v);
HIDDEN void ring_set_clock(uint32_t domain);
HIDDEN void ring_set_finished(void);
HIDDEN const char *ring_name(void);
/* An ERROR record plus one stderr line. With key > 0 only the first report of that key is
 * written (every failure is reported once, never per launch). */
HIDDEN void report_error(unsigned key, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

enum error_key { /* keys for report_error: one report each */
    ERRK_NONE = 0,
    ERRK_ACTIVITY_ALLOC = 1,
    ERRK_ACTIVITY_NEXT,
    ERRK_ACTIVITY_DROPPED,
    ERRK_FLUSH,
    ERRK_STAGING_INIT,
    ERRK_STAGING_CTX,
    ERRK_STAGING_FULL,
    ERRK_STAGING_COPY,
    ERRK_STAGING_EVENT,
    ERRK_STAGING_QUERY,
    ERRK_WATCH_EXTRA,
    ERRK_WATCH_PARAM,
    ERRK_WATCH_SIZE,
    ERRK_WATCH_NAME,
    ERRK_GRAPH_ID,
    ERRK_GRAPH_READ,
    ERRK_GRAPH_TABLE,
    ERRK_CAPTURE_QUERY,
    ERRK_KEY_COUNT
};

/* ---- libcuda entry points, resolved at init (cuda_api in inject.c) ---- */
struct cuda_api {
    CUresult (*MemAllocHost)(void **pp, size_t bytesize);
    CUresult (*MemFreeHost)(void *p);
    CUresult (*MemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t n, CUstream s);
    CUresult (*EventCreate)(CUevent *ev, unsigned int flags);
    CUresult (*EventRecord)(CUevent ev, CUstream s);
    CUresult (*EventQuery)(CUevent ev);
    CUresult (*EventDestroy)(CUevent ev);
    CUresult (*FuncGetName)(const char **name, CUfunction f);
    CUresult (*FuncGetParamInfo)(CUfunction f, size_t index, size_t *offset, size_t *size);
    CUresult (*CtxSetCurrent)(CUcontext ctx);
    CUresult (*GetErrorName)(CUresult r, const char **s);
    /* CUDA graphs (graph.c) and stream capture; optional: without them graphs are not watched */
    CUresult (*StreamIsCapturing)(CUstream s, CUstreamCaptureStatus *status);
    CUresult (*GraphGetNodes)(CUgraph g, CUgraphNode *nodes, size_t *n);
    CUresult (*GraphNodeGetType)(CUgraphNode node, CUgraphNodeType *type);
    CUresult (*GraphKernelNodeGetParams)(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *p); /* _v2 */
    CUresult (*KernelGetName)(const char **name, CUkernel k);
    CUresult (*ThreadExchangeStreamCaptureMode)(CUstreamCaptureMode *mode);
};
extern HIDDEN struct cuda_api cu;
HIDDEN const char *cu_error_name(CUresult r);

/* ---- watched kernels (watch.c) ---- */
#define WATCH_MAX 16
#define WATCH_MAX_TERMS 6

enum term_kind { T_CONST, T_ARG32, T_ARG64, T_GRID_X, T_GRID_Y, T_GRID_Z, T_BLOCK_X, T_BLOCK_Y, T_BLOCK_Z };
struct watch_term {
    enum term_kind kind;
    uint64_t value; /* T_CONST: the constant; T_ARG*: the argument index */
};
struct watch_dim {
    int nterms;
    struct watch_term terms[WATCH_MAX_TERMS]; /* multiplied together */
};
struct watch {
    char pattern[128]; /* substring of the (mangled) kernel name */
    unsigned arg_index;
    uint32_t dtype;
    uint32_t elem_size;
    int ndim;
    struct watch_dim dims[WATCH_MAX_DIMS];
    uint64_t seen; /* watched launches so far (atomic), for sampling */
};
/* The values a count rule may read at a launch. */
struct launch_geom {
    unsigned grid[3], block[3];
    void **params; /* kernelParams / args: params[i] points to the host copy of argument i */
    CUfunction func; /* driver launches: lets the rule check argument sizes; else NULL */
};

HIDDEN int watch_parse(const char *text, struct watch *out, int max, int *n, char *err, size_t errlen);
HIDDEN struct watch *watch_match(struct watch *ws, int n, const char *kernel_name);
/* 0 on success; fills shape/ndim/bytes. -1 with a message when the rule cannot be evaluated. */
HIDDEN int watch_eval(const struct watch *w, const struct launch_geom *g, uint64_t shape[WATCH_MAX_DIMS],
                      uint64_t *bytes, CUdeviceptr *src, char *err, size_t errlen);

/* ---- staging copies of watched buffers (staging.c) ---- */
struct staging_request {
    const struct watch *w;
    const char *kernel_name;
    uint32_t correlation_id, tid;
    uint64_t launch_ns;
    CUdeviceptr src;
    CUstream stream;
    CUcontext ctx;
    uint64_t shape[WATCH_MAX_DIMS];
    uint64_t bytes;
    uint32_t graph_id;      /* graph replays: CUPTI's id of the graph the executable came from ... */
    uint64_t graph_node_id; /* ... and of the kernel node (0: an eager launch) */
};
HIDDEN void staging_configure(size_t staging_bytes);
/* Called at API exit of a watched launch: enqueue the copy + event on the launch's stream. */
HIDDEN void staging_enqueue(const struct staging_request *r);
/* Publish what completed, waiting at most timeout_ms (at exit only). */
HIDDEN void staging_shutdown(unsigned timeout_ms);

/* ---- sampling and byte budget of watched copies (inject.c) ---- */
/* True when this watched launch is to be copied; a skip is counted. */
HIDDEN bool watch_admit(struct watch *w, uint64_t now_ns, uint64_t bytes);

/* ---- watched kernels inside CUDA graphs (graph.c) ---- */
struct cupti_graph_api {
    CUptiResult (*GetGraphNodeId)(CUgraphNode node, uint64_t *id);
    CUptiResult (*GetGraphId)(CUgraph graph, uint32_t *id);
};
extern HIDDEN struct cupti_graph_api cupti_graph;
HIDDEN void graph_exec_create_starting(void);
HIDDEN void graph_node_cloned(CUgraphNode original, CUgraphNode clone);
HIDDEN void graph_exec_created(CUgraph graph, CUgraphExec exec, int nwatch, struct watch *watches);
HIDDEN void graph_exec_updated(CUgraphExec exec, CUgraph graph, int nwatch, struct watch *watches);
HIDDEN void graph_exec_destroyed(CUgraphExec exec);
HIDDEN void graph_exec_node_set(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p, int nwatch,
                                struct watch *watches);
HIDDEN void graph_launched(CUgraphExec exec, CUstream stream, CUcontext ctx, uint32_t correlation_id,
                           uint64_t launch_ns);

#endif
