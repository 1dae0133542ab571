/* A stand-in libcuda for tests without a GPU. "Device pointers" are host addresses. Work is
 * stream-ordered as on a GPU: kernels launched through cuLaunchKernel / cuGraphLaunch,
 * cuMemcpyDtoHAsync copies and cuEventRecord markers are queued and run later, in order, by a
 * "device" thread, so a copy sees what the kernels before it on the stream wrote and nothing
 * later. An event reports CUDA_ERROR_NOT_READY until the device reached it, and then for
 * STUB_CUDA_EVENT_DELAY more queries (default 2) so the library's polling path runs. Streams can
 * be captured into graphs (cuStreamBeginCapture_v2 / cuStreamEndCapture), graphs instantiated,
 * updated, launched and destroyed, with the CUPTI resource callbacks the real driver makes
 * (GRAPHNODE_CREATED, GRAPHEXEC_CREATE_STARTING, GRAPHNODE_CLONED, GRAPHEXEC_CREATED,
 * GRAPHEXEC_DESTROY_STARTING) and the driver API callbacks of cuLaunchKernel, cuGraphLaunch,
 * cuGraphExecUpdate_v2 and cuMemcpyDtoHAsync_v2 (the library's own copy re-enters the callback).
 * A destroyed graph's argument storage is poisoned before it is freed.
 *
 * Checks on the library: every cuStreamSynchronize / cuCtxSynchronize / cuEventSynchronize call is
 * counted (the library must make none), and so is every copy, event record or pinned allocation
 * made while a stream is being captured (a real driver would capture the copy into the engine's
 * graph, or invalidate the capture). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h>
#include <cupti.h>

#include "stub_api.h"

#define API __attribute__((visibility("default")))
#define DRV CUPTI_CB_DOMAIN_DRIVER_API

struct stub_event {
    int done;    /* the device reached the record (atomic) */
    int pending; /* NOT_READY answers still due after that */
};
static int copies, host_allocs, syncs, capture_violations;

/* ---- graphs */
#define MAX_NODES 16
struct stub_node {
    uint64_t id; /* first: cuptiGetGraphNodeId */
    uint64_t source_id; /* executables' nodes: the id of the node instantiated */
    struct stub_func *f;
    unsigned grid[3], block[3];
    unsigned char args[MAX_NODES * 8 * 8]; /* the node's own copies of the argument values */
    void *argp[8];
};
struct stub_graph { /* a CUgraph, and a CUgraphExec (its clone) */
    uint32_t id; /* first: cuptiGetGraphId / cuptiGetGraphExecId */
    uint32_t source_graph_id; /* executables: the graph instantiated */
    int n;
    struct stub_node *nodes[MAX_NODES];
};
static uint32_t next_graph_id = 10;
static uint64_t next_node_id = 1000;

struct stub_stream {
    struct stub_graph *capture; /* non-NULL while capturing */
};
static struct stub_stream legacy_stream, per_thread_stream;
static struct stub_stream *stream_of(CUstream s) {
    if (s == NULL) return &legacy_stream;
    if (s == CU_STREAM_PER_THREAD || s == CU_STREAM_LEGACY) return &per_thread_stream;
    return (struct stub_stream *)(void *)s;
}
static int captures_active; /* streams capturing (global mode; the stub knows no other), atomic */
static int any_capture(void) { return __atomic_load_n(&captures_active, __ATOMIC_ACQUIRE) > 0; }

static uint64_t mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- the device: one FIFO of work, run in order by one thread (stream order kept for all) */
enum op_kind { OP_KERNEL, OP_COPY, OP_EVENT };
struct op {
    enum op_kind kind;
    struct op *next;
    /* OP_KERNEL */
    struct stub_func *f;
    void *argp[8];
    unsigned char args[64];
    uint32_t corr, graph_id;
    uint64_t node_id;
    /* OP_COPY */
    void *dst;
    const void *src;
    size_t n;
    /* OP_EVENT */
    struct stub_event *ev;
};
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qcv = PTHREAD_COND_INITIALIZER, idle_cv = PTHREAD_COND_INITIALIZER;
static struct op *qhead, *qtail;
static int running; /* an op is being run */
static pthread_once_t device_once = PTHREAD_ONCE_INIT;
static __thread uint32_t cur_corr;
static __thread uint64_t cur_node;

static void *device_main(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&qmu);
        while (qhead == NULL) pthread_cond_wait(&qcv, &qmu);
        struct op *o = qhead;
        qhead = o->next;
        if (qhead == NULL) qtail = NULL;
        running = 1;
        pthread_mutex_unlock(&qmu);
        struct timespec ts = {0, 20000}; /* work takes time: the host runs ahead */
        nanosleep(&ts, NULL);
        if (o->kind == OP_KERNEL) {
            uint64_t t0 = mono();
            cur_corr = o->corr, cur_node = o->node_id;
            if (o->f->body != NULL) o->f->body(o->argp);
            cur_corr = 0, cur_node = 0;
            stub_cupti_kernel_ran(o->f->name, o->corr, t0, mono(), o->graph_id, o->node_id);
        } else if (o->kind == OP_COPY) {
            memcpy(o->dst, o->src, o->n);
        } else {
            __atomic_store_n(&o->ev->done, 1, __ATOMIC_RELEASE);
        }
        free(o);
        pthread_mutex_lock(&qmu);
        running = 0;
        if (qhead == NULL) pthread_cond_broadcast(&idle_cv);
        pthread_mutex_unlock(&qmu);
    }
    return NULL;
}

static void start_device(void) {
    pthread_t t;
    pthread_create(&t, NULL, device_main, NULL);
    pthread_detach(t);
}

static void enqueue(struct op *o) {
    pthread_once(&device_once, start_device);
    pthread_mutex_lock(&qmu);
    o->next = NULL;
    if (qtail != NULL) qtail->next = o;
    else qhead = o;
    qtail = o;
    pthread_cond_signal(&qcv);
    pthread_mutex_unlock(&qmu);
}

static void wait_idle(void) {
    pthread_mutex_lock(&qmu);
    while (qhead != NULL || running) pthread_cond_wait(&idle_cv, &qmu);
    pthread_mutex_unlock(&qmu);
}

/* A kernel op with its own copy of the arguments (what the driver does at launch). */
static struct op *kernel_op(struct stub_func *f, void **params, uint32_t corr, uint32_t graph_id, uint64_t node) {
    struct op *o = calloc(1, sizeof *o);
    if (o == NULL) abort();
    o->kind = OP_KERNEL;
    o->f = f;
    o->corr = corr, o->graph_id = graph_id, o->node_id = node;
    size_t off = 0;
    for (int i = 0; i < f->nparams && i < 8; i++) {
        memcpy(o->args + off, params[i], f->sizes[i]);
        o->argp[i] = o->args + off;
        off += (f->sizes[i] + 7) & ~(size_t)7;
    }
    return o;
}

/* This thread's capture interaction mode (cuThreadExchangeStreamCaptureMode); global by default. */
static __thread CUstreamCaptureMode thread_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    CUstreamCaptureMode old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

API CUresult cuMemAllocHost_v2(void **pp, size_t n) {
    /* a global-mode capture forbids it to every thread not in relaxed mode, and is invalidated */
    if (any_capture() && thread_mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
        __atomic_fetch_add(&capture_violations, 1, __ATOMIC_RELAXED);
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    *pp = aligned_alloc(256, (n + 255) & ~(size_t)255);
    if (*pp == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    __atomic_fetch_add(&host_allocs, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeHost(void *p) {
    free(p);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    int k = __atomic_add_fetch(&copies, 1, __ATOMIC_RELAXED);
    cuMemcpyDtoHAsync_v2_params p = {dst, src, n, s};
    uint64_t scratch = 0;
    uint32_t corr = 900000u + (uint32_t)k;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2, &p, NULL, corr, (void *)0x1, CUPTI_API_ENTER, 0,
                   &scratch);
    CUresult r = CUDA_SUCCESS;
    if (stream_of(s)->capture != NULL) {
        __atomic_fetch_add(&capture_violations, 1, __ATOMIC_RELAXED);
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else {
        struct op *o = calloc(1, sizeof *o);
        if (o == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
        o->kind = OP_COPY;
        o->dst = dst, o->src = (const void *)(uintptr_t)src, o->n = n;
        enqueue(o);
    }
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2, &p, NULL, corr, (void *)0x1, CUPTI_API_EXIT,
                   (int)r, &scratch);
    return r;
}

API CUresult cuEventCreate(CUevent *ev, unsigned int flags) {
    (void)flags;
    struct stub_event *e = calloc(1, sizeof *e);
    if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *ev = (CUevent)e;
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent ev, CUstream s) {
    if (stream_of(s)->capture != NULL) {
        __atomic_fetch_add(&capture_violations, 1, __ATOMIC_RELAXED);
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    struct stub_event *e = (struct stub_event *)ev;
    const char *d = getenv("STUB_CUDA_EVENT_DELAY");
    __atomic_store_n(&e->done, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&e->pending, d ? atoi(d) : 2, __ATOMIC_RELEASE);
    struct op *o = calloc(1, sizeof *o);
    if (o == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    o->kind = OP_EVENT;
    o->ev = e;
    enqueue(o);
    return CUDA_SUCCESS;
}

API CUresult cuEventQuery(CUevent ev) {
    struct stub_event *e = (struct stub_event *)ev;
    if (!__atomic_load_n(&e->done, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_READY;
    if (__atomic_load_n(&e->pending, __ATOMIC_ACQUIRE) > 0) {
        __atomic_fetch_sub(&e->pending, 1, __ATOMIC_ACQ_REL);
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}

/* Blocking calls the library must never make: counted, and they do block as the real ones do. */
API CUresult cuStreamSynchronize(CUstream s) {
    (void)s;
    __atomic_fetch_add(&syncs, 1, __ATOMIC_RELAXED);
    wait_idle();
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize(void) {
    __atomic_fetch_add(&syncs, 1, __ATOMIC_RELAXED);
    wait_idle();
    return CUDA_SUCCESS;
}
API CUresult cuEventSynchronize(CUevent ev) {
    __atomic_fetch_add(&syncs, 1, __ATOMIC_RELAXED);
    while (!__atomic_load_n(&((struct stub_event *)ev)->done, __ATOMIC_ACQUIRE)) wait_idle();
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent ev) {
    free(ev);
    return CUDA_SUCCESS;
}

/* A stub_func without a name plays a CUkernel handle (CUDA 12+ library loading): cuLaunchKernel
 * takes it, the cuFunc* queries refuse it as the real driver does. */
API CUresult cuFuncGetName(const char **name, CUfunction f) {
    if (f == NULL || ((const struct stub_func *)(const void *)f)->name == NULL) return CUDA_ERROR_INVALID_HANDLE;
    *name = ((const struct stub_func *)(const void *)f)->name;
    return CUDA_SUCCESS;
}

API CUresult cuFuncGetParamInfo(CUfunction f, size_t i, size_t *off, size_t *size) {
    const struct stub_func *sf = (const struct stub_func *)(const void *)f;
    if (sf != NULL && sf->name == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (sf == NULL || i >= (size_t)sf->nparams) return CUDA_ERROR_INVALID_VALUE;
    size_t o = 0;
    for (size_t k = 0; k < i; k++) o += sf->sizes[k];
    *off = o;
    *size = sf->sizes[i];
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext c) {
    (void)c;
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult r, const char **s) {
    *s = r == CUDA_SUCCESS ? "CUDA_SUCCESS" : r == CUDA_ERROR_NOT_READY ? "CUDA_ERROR_NOT_READY" : "CUDA_ERROR_STUB";
    return CUDA_SUCCESS;
}

/* ---- streams, capture, graphs */

API CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
    (void)flags;
    struct stub_stream *st = calloc(1, sizeof *st);
    if (st == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *s = (CUstream)(void *)st;
    return CUDA_SUCCESS;
}

API CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
    (void)mode;
    struct stub_stream *st = stream_of(s);
    if (st->capture != NULL) return CUDA_ERROR_ILLEGAL_STATE;
    st->capture = calloc(1, sizeof *st->capture);
    if (st->capture == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    st->capture->id = __atomic_fetch_add(&next_graph_id, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&captures_active, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

API CUresult cuStreamEndCapture(CUstream s, CUgraph *g) {
    struct stub_stream *st = stream_of(s);
    if (st->capture == NULL) return CUDA_ERROR_ILLEGAL_STATE;
    *g = (CUgraph)(void *)st->capture;
    st->capture = NULL;
    __atomic_fetch_sub(&captures_active, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status) {
    *status = stream_of(s)->capture != NULL ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

static struct stub_node *node_copy(const struct stub_node *from, struct stub_func *f, unsigned gx, unsigned bx,
                                   void **params) {
    struct stub_node *n = calloc(1, sizeof *n);
    if (n == NULL) abort();
    n->id = __atomic_fetch_add(&next_node_id, 1, __ATOMIC_RELAXED);
    n->source_id = from ? from->id : 0;
    n->f = from ? from->f : f;
    n->grid[0] = from ? from->grid[0] : gx, n->grid[1] = n->grid[2] = 1;
    n->block[0] = from ? from->block[0] : bx, n->block[1] = n->block[2] = 1;
    size_t off = 0;
    for (int i = 0; i < n->f->nparams && i < 8; i++) {
        memcpy(n->args + off, from ? from->argp[i] : params[i], n->f->sizes[i]);
        n->argp[i] = n->args + off;
        off += (n->f->sizes[i] + 7) & ~(size_t)7;
    }
    return n;
}

/* Runs the kernel on the device, or, on a capturing stream, adds it to the graph being captured. */
API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, CUstream s, void **params, void **extra) {
    cuLaunchKernel_params p = {f, gx, gy, gz, bx, by, bz, shmem, s, params, extra};
    struct stub_func *sf = (struct stub_func *)(void *)f;
    uint32_t corr = stub_cupti_next_correlation();
    uint64_t scratch = 0;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, &p, sf->name, corr, (void *)0x1, CUPTI_API_ENTER, 0,
                   &scratch);
    struct stub_stream *st = stream_of(s);
    if (st->capture != NULL) {
        struct stub_graph *g = st->capture;
        if (g->n == MAX_NODES) return CUDA_ERROR_OUT_OF_MEMORY;
        struct stub_node *n = node_copy(NULL, sf, gx, bx, params);
        g->nodes[g->n++] = n;
        CUpti_GraphData gd = {.graph = (CUgraph)(void *)g, .node = (CUgraphNode)(void *)n,
                              .nodeType = CU_GRAPH_NODE_TYPE_KERNEL};
        stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHNODE_CREATED, (void *)0x1, &gd);
    } else {
        enqueue(kernel_op(sf, params, corr, 0, 0));
    }
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, &p, sf->name, corr, (void *)0x1, CUPTI_API_EXIT, 0,
                   &scratch);
    return CUDA_SUCCESS;
}

API CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *num) {
    struct stub_graph *g = (struct stub_graph *)(void *)graph;
    if (g == NULL || num == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (nodes == NULL) {
        *num = (size_t)g->n;
        return CUDA_SUCCESS;
    }
    size_t k = *num < (size_t)g->n ? *num : (size_t)g->n;
    for (size_t i = 0; i < k; i++) nodes[i] = (CUgraphNode)(void *)g->nodes[i];
    *num = k;
    return CUDA_SUCCESS;
}

API CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type) {
    if (node == NULL) return CUDA_ERROR_INVALID_VALUE;
    *type = CU_GRAPH_NODE_TYPE_KERNEL;
    return CUDA_SUCCESS;
}

/* As the driver: kernelParams points to the node's own argument storage. */
API CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *p) {
    struct stub_node *n = (struct stub_node *)(void *)node;
    if (n == NULL || p == NULL) return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->func = (CUfunction)(void *)n->f;
    p->gridDimX = n->grid[0], p->gridDimY = n->grid[1], p->gridDimZ = n->grid[2];
    p->blockDimX = n->block[0], p->blockDimY = n->block[1], p->blockDimZ = n->block[2];
    p->kernelParams = n->argp;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags) {
    (void)flags;
    struct stub_graph *g = (struct stub_graph *)(void *)graph;
    CUpti_GraphData gd = {.graph = graph};
    /* STUB_CUDA_CLONES_BEFORE_STARTING: the nodes are cloned (and reported) before CREATE_STARTING,
     * the order the kept H200 run implies (results/gpu_check/2026-12-04T155821Z-nvidia-h200.json). */
    int clones_first = getenv("STUB_CUDA_CLONES_BEFORE_STARTING") != NULL;
    if (!clones_first) stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATE_STARTING, (void *)0x1, &gd);
    struct stub_graph *e = calloc(1, sizeof *e);
    if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    e->id = __atomic_fetch_add(&next_graph_id, 1, __ATOMIC_RELAXED);
    e->source_graph_id = g->id;
    for (int i = 0; i < g->n; i++) {
        e->nodes[i] = node_copy(g->nodes[i], NULL, 0, 0, NULL);
        CUpti_GraphData c = {.graph = graph, .originalGraph = graph, .node = (CUgraphNode)(void *)e->nodes[i],
                             .originalNode = (CUgraphNode)(void *)g->nodes[i], .nodeType = CU_GRAPH_NODE_TYPE_KERNEL};
        stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED, (void *)0x1, &c);
    }
    if (clones_first) stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATE_STARTING, (void *)0x1, &gd);
    e->n = g->n;
    *exec = (CUgraphExec)(void *)e;
    gd.graphExec = *exec;
    if (getenv("STUB_CUDA_EXEC_CREATED_WITHOUT_GRAPH") != NULL) gd.graph = NULL; /* the library's fallback */
    stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED, (void *)0x1, &gd);
    return CUDA_SUCCESS;
}

/* Same topology required; the executable's nodes (and ids) stay, their arguments are replaced. */
API CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, CUgraphExecUpdateResultInfo *info) {
    struct stub_graph *e = (struct stub_graph *)(void *)exec, *g = (struct stub_graph *)(void *)graph;
    cuGraphExecUpdate_v2_params p = {exec, graph, info};
    uint32_t corr = stub_cupti_next_correlation();
    uint64_t scratch = 0;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate_v2, &p, NULL, corr, (void *)0x1, CUPTI_API_ENTER, 0,
                   &scratch);
    CUresult r = CUDA_SUCCESS;
    if (e->n != g->n) {
        r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    } else {
        for (int i = 0; i < g->n; i++) {
            if (g->nodes[i]->f != e->nodes[i]->f) r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
        }
        for (int i = 0; r == CUDA_SUCCESS && i < g->n; i++) {
            uint64_t id = e->nodes[i]->id, source = e->nodes[i]->source_id;
            struct stub_node *fresh = node_copy(g->nodes[i], NULL, 0, 0, NULL);
            fresh->id = id, fresh->source_id = source;
            free(e->nodes[i]);
            e->nodes[i] = fresh;
        }
    }
    if (info != NULL) info->result = r == CUDA_SUCCESS ? CU_GRAPH_EXEC_UPDATE_SUCCESS : CU_GRAPH_EXEC_UPDATE_ERROR;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphExecUpdate_v2, &p, NULL, corr, (void *)0x1, CUPTI_API_EXIT,
                   (int)r, &scratch);
    return r;
}

/* `node` is a node of the graph `exec` was instantiated from; its clone in `exec` takes `p`. */
API CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p) {
    struct stub_graph *e = (struct stub_graph *)(void *)exec;
    struct stub_node *src = (struct stub_node *)(void *)node;
    cuGraphExecKernelNodeSetParams_v2_params cp = {exec, node, p};
    uint32_t corr = stub_cupti_next_correlation();
    uint64_t scratch = 0;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams_v2, &cp, NULL, corr, (void *)0x1,
                   CUPTI_API_ENTER, 0, &scratch);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < e->n; i++) {
        struct stub_node *n = e->nodes[i];
        if (n->source_id != src->id || (struct stub_func *)(void *)p->func != n->f) continue;
        size_t off = 0;
        for (int k = 0; k < n->f->nparams && k < 8; k++) {
            memcpy(n->args + off, p->kernelParams[k], n->f->sizes[k]);
            off += (n->f->sizes[k] + 7) & ~(size_t)7;
        }
        r = CUDA_SUCCESS;
    }
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphExecKernelNodeSetParams_v2, &cp, NULL, corr, (void *)0x1,
                   CUPTI_API_EXIT, (int)r, &scratch);
    return r;
}

API CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) {
    struct stub_graph *e = (struct stub_graph *)(void *)exec;
    cuGraphLaunch_params p = {exec, s};
    uint32_t corr = stub_cupti_next_correlation();
    uint64_t scratch = 0;
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, &p, NULL, corr, (void *)0x1, CUPTI_API_ENTER, 0,
                   &scratch);
    for (int i = 0; i < e->n; i++)
        enqueue(kernel_op(e->nodes[i]->f, e->nodes[i]->argp, corr, e->source_graph_id, e->nodes[i]->id));
    stub_cupti_api(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, &p, NULL, corr, (void *)0x1, CUPTI_API_EXIT, 0,
                   &scratch);
    return CUDA_SUCCESS;
}

static void free_graph(struct stub_graph *g) {
    for (int i = 0; i < g->n; i++) {
        memset(g->nodes[i], 0xAB, sizeof *g->nodes[i]); /* a pointer kept into it reads garbage */
        free(g->nodes[i]);
    }
    memset(g, 0xAB, sizeof *g);
    free(g);
}

API CUresult cuGraphExecDestroy(CUgraphExec exec) {
    CUpti_GraphData gd = {.graphExec = exec};
    stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING, (void *)0x1, &gd);
    free_graph((struct stub_graph *)(void *)exec);
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(CUgraph graph) {
    CUpti_GraphData gd = {.graph = graph};
    stub_cupti_resource(CUPTI_CBID_RESOURCE_GRAPH_DESTROY_STARTING, (void *)0x1, &gd);
    free_graph((struct stub_graph *)(void *)graph);
    return CUDA_SUCCESS;
}

API void stub_cuda_current_kernel(uint32_t *corr, uint64_t *node) {
    *corr = cur_corr;
    *node = cur_node;
}
API void stub_cuda_device_idle(void) { wait_idle(); }
API int stub_cuda_syncs(void) { return __atomic_load_n(&syncs, __ATOMIC_RELAXED); }
API int stub_cuda_capture_violations(void) { return __atomic_load_n(&capture_violations, __ATOMIC_RELAXED); }
API int stub_cuda_copies(void) { return __atomic_load_n(&copies, __ATOMIC_RELAXED); }
API int stub_cuda_host_allocs(void) { return __atomic_load_n(&host_allocs, __ATOMIC_RELAXED); }
