/* libsparseety_cupti.so: loaded by the CUDA driver through CUDA_INJECTION64_PATH, which calls
 * InitializeInjection() from cuInit. Records kernel and memcpy activity, the launch API calls,
 * and copies of watched kernel arguments into the shared-memory ring (ring.c).
 *
 * Rules kept everywhere: InitializeInjection always returns 1 (the engine must never break
 * because of the profiler); every failure is reported once, as an ERROR record and on stderr;
 * nothing here blocks or synchronizes inside an engine's CUDA call.
 *
 * libcupti and libcuda are dlopen'ed, not linked: the driver dlopens us with whatever
 * LD_LIBRARY_PATH the engine has, and libcupti.so.13 usually lives in a pip wheel
 * (nvidia/cu13/lib) that is not on it. A DT_NEEDED entry would make that dlopen fail with no
 * report at all; dlopen lets us try SPARSEETY_CUPTI_PATH, then the soname, and say what is missing. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cupti.h> /* also brings the generated_*_meta.h parameter structs */

#include "internal.h"

HIDDEN struct cuda_api cu;

static struct {
    CUptiResult (*Subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*EnableCallback)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
    CUptiResult (*ActivityEnable)(CUpti_ActivityKind);
    CUptiResult (*ActivityRegisterCallbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*ActivityRegisterTimestampCallback)(CUpti_TimestampCallbackFunc);
    CUptiResult (*ActivityFlushAll)(uint32_t);
    CUptiResult (*ActivityGetNextRecord)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*ActivityGetNumDroppedRecords)(CUcontext, uint32_t, size_t *);
    CUptiResult (*GetResultString)(CUptiResult, const char **);
    CUptiResult (*GetGraphExecId)(CUgraphExec, uint32_t *); /* optional */
} cupti;

static struct {
    struct watch watches[WATCH_MAX];
    int nwatch;
    uint64_t sample_every;
    uint64_t bytes_per_s;
    unsigned flush_ms;
    size_t activity_buffer_bytes;
} cfg;

static CUpti_SubscriberHandle g_sub;
/* Late attach (SparseetyLateAttach): the settings arrive as text, "KEY=VALUE" entries separated
 * by NUL once parsed; the running engine's environment has none of ours and must not be read. */
static int g_late;
static char g_settings[16384];
static size_t g_settings_len;
static int g_initialized;
static pthread_t g_flush_thread;
static int g_flush_started;
static pthread_mutex_t g_flush_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_flush_cv;
static int g_flush_stop;
static uint64_t g_budget_window_ns, g_budget_used; /* byte budget, one-second windows (atomics) */

/* ---------------------------------------------------------------- helpers */

HIDDEN const char *cu_error_name(CUresult r) {
    const char *s = NULL;
    if (cu.GetErrorName != NULL && cu.GetErrorName(r, &s) == CUDA_SUCCESS && s != NULL) return s;
    return "CUDA error";
}

static const char *cupti_error_name(CUptiResult r) {
    const char *s = NULL;
    if (cupti.GetResultString != NULL && cupti.GetResultString(r, &s) == CUPTI_SUCCESS && s != NULL) return s;
    return "CUPTI error";
}

#define CUPTI_CHECK(call, what)                                                                           \
    do {                                                                                                  \
        CUptiResult r_ = (call);                                                                          \
        if (r_ != CUPTI_SUCCESS) {                                                                        \
            report_error(ERRK_NONE, (int)r_, "%s failed: %s (%d)", what, cupti_error_name(r_), (int)r_);  \
            goto fail;                                                                                    \
        }                                                                                                 \
    } while (0)

HIDDEN const char *setting(const char *name) {
    if (!g_late) return getenv(name);
    size_t nl = strlen(name);
    for (size_t i = 0; i < g_settings_len;) {
        const char *e = g_settings + i;
        size_t el = strlen(e);
        if (el > nl && strncmp(e, name, nl) == 0 && e[nl] == '=') return e + nl + 1;
        i += el + 1;
    }
    return NULL;
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = setting(name);
    if (v == NULL || *v == '\0') return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    uint64_t mult = 1;
    if (*end == 'K' || *end == 'k') mult = 1ull << 10, end++;
    else if (*end == 'M' || *end == 'm') mult = 1ull << 20, end++;
    else if (*end == 'G' || *end == 'g') mult = 1ull << 30, end++;
    if (errno != 0 || *end != '\0' || end == v) {
        fprintf(stderr, LOG_PREFIX "%s=%s is not a number; using %llu\n", name, v, (unsigned long long)dflt);
        return dflt;
    }
    return (uint64_t)x * mult;
}

static uint64_t floor_pow2(uint64_t x) {
    uint64_t p = 1;
    while (p <= x / 2) p *= 2;
    return p;
}

/* ---------------------------------------------------------------- API callbacks */

enum api_kind { K_NONE, K_DRV_LAUNCH, K_DRV_LAUNCH_EX, K_RT_LAUNCH, K_RT_LAUNCH_EX, K_DRV_GRAPH, K_RT_GRAPH,
                K_DRV_MEMCPY, K_RT_MEMCPY, K_DRV_GRAPH_UPDATE, K_DRV_GRAPH_NODE_SET };
struct api_info {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId cbid;
    const char *name;
    enum api_kind kind;
    int ptsz; /* per-thread default stream variant: a NULL stream means CU_STREAM_PER_THREAD */
};

#define DRV(n, k, p) {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_##n, #n, k, p}
#define RT(n, name, k, p) {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_##n, name, k, p}
static const struct api_info APIS[] = {
    DRV(cuLaunchKernel, K_DRV_LAUNCH, 0),
    DRV(cuLaunchKernel_ptsz, K_DRV_LAUNCH, 1),
    DRV(cuLaunchKernelEx, K_DRV_LAUNCH_EX, 0),
    DRV(cuLaunchKernelEx_ptsz, K_DRV_LAUNCH_EX, 1),
    DRV(cuGraphLaunch, K_DRV_GRAPH, 0),
    DRV(cuGraphLaunch_ptsz, K_DRV_GRAPH, 1),
    /* not a launch: an executable graph takes new kernel arguments (graph.c) */
    DRV(cuGraphExecUpdate_v2, K_DRV_GRAPH_UPDATE, 0),
    DRV(cuGraphExecKernelNodeSetParams_v2, K_DRV_GRAPH_NODE_SET, 0),
    DRV(cuMemcpyDtoH_v2, K_DRV_MEMCPY, 0),
    DRV(cuMemcpyDtoH_v2_ptds, K_DRV_MEMCPY, 1),
    DRV(cuMemcpyDtoHAsync_v2, K_DRV_MEMCPY, 0),
    DRV(cuMemcpyDtoHAsync_v2_ptsz, K_DRV_MEMCPY, 1),
    DRV(cuMemcpyAsync, K_DRV_MEMCPY, 0),
    DRV(cuMemcpyAsync_ptsz, K_DRV_MEMCPY, 1),
    RT(cudaLaunchKernel_v7000, "cudaLaunchKernel", K_RT_LAUNCH, 0),
    RT(cudaLaunchKernel_ptsz_v7000, "cudaLaunchKernel_ptsz", K_RT_LAUNCH, 1),
    RT(cudaLaunchKernelExC_v11060, "cudaLaunchKernelExC", K_RT_LAUNCH_EX, 0),
    RT(cudaLaunchKernelExC_ptsz_v11060, "cudaLaunchKernelExC_ptsz", K_RT_LAUNCH_EX, 1),
    /* CUDA 13's <<<>>> launches go through __cudaLaunchKernel (same parameters as cudaLaunchKernel). */
    RT(__cudaLaunchKernel_v13000, "__cudaLaunchKernel", K_RT_LAUNCH, 0),
    RT(__cudaLaunchKernel_ptsz_v13000, "__cudaLaunchKernel_ptsz", K_RT_LAUNCH, 1),
    RT(cudaGraphLaunch_v10000, "cudaGraphLaunch", K_RT_GRAPH, 0),
    RT(cudaGraphLaunch_ptsz_v10000, "cudaGraphLaunch_ptsz", K_RT_GRAPH, 1),
    RT(cudaMemcpy_v3020, "cudaMemcpy", K_RT_MEMCPY, 0),
    RT(cudaMemcpyAsync_v3020, "cudaMemcpyAsync", K_RT_MEMCPY, 0),
    RT(cudaMemcpyAsync_ptsz_v7000, "cudaMemcpyAsync_ptsz", K_RT_MEMCPY, 1),
};
#define NAPIS (sizeof APIS / sizeof APIS[0])

static const struct api_info *api_lookup(CUpti_CallbackDomain d, CUpti_CallbackId cbid) {
    for (size_t i = 0; i < NAPIS; i++)
        if (APIS[i].cbid == cbid && APIS[i].domain == d) return &APIS[i];
    return NULL;
}

/* Inside a runtime launch, the driver launch the runtime makes (if CUPTI reports it at all) must
 * not copy the watched buffer a second time. */
static __thread int tls_runtime_depth;

static void write_launch(const struct api_info *a, const char *name, uint32_t corr, uint64_t enter, uint64_t exit_ns,
                         uint64_t graph_id) {
    size_t nl = strlen(name);
    size_t len = sizeof(struct rec_header) + sizeof(struct rec_launch_api) + nl;
    struct rec_header *h = ring_reserve(REC_LAUNCH_API, len);
    if (h == NULL) return;
    struct rec_launch_api *r = (struct rec_launch_api *)(h + 1);
    r->enter_ns = enter;
    r->exit_ns = exit_ns;
    r->graph_exec_id = graph_id;
    r->correlation_id = corr;
    r->tid = current_tid();
    r->pid = (uint32_t)getpid();
    r->cbid = (uint16_t)a->cbid;
    r->domain = (uint8_t)a->domain;
    r->reserved0 = 0;
    r->name_len = (uint32_t)nl;
    r->reserved1 = 0;
    memcpy(r + 1, name, nl);
    ring_commit(h, len);
}

/* Resource callbacks that follow CUDA graphs: instantiation (and the node clones it makes) and
 * destruction of executable graphs. */
static const CUpti_CallbackId RESOURCE_CBIDS[] = {
    CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATE_STARTING,
    CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED,
    CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED,
    CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING,
};
#define NRESOURCE (sizeof RESOURCE_CBIDS / sizeof RESOURCE_CBIDS[0])

static bool budget_take(uint64_t now, uint64_t bytes) {
    uint64_t ws = __atomic_load_n(&g_budget_window_ns, __ATOMIC_RELAXED);
    if (now - ws >= 1000000000ull &&
        __atomic_compare_exchange_n(&g_budget_window_ns, &ws, now, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        __atomic_store_n(&g_budget_used, 0, __ATOMIC_RELAXED);
    uint64_t used = __atomic_add_fetch(&g_budget_used, bytes, __ATOMIC_RELAXED);
    if (used > cfg.bytes_per_s) {
        __atomic_sub_fetch(&g_budget_used, bytes, __ATOMIC_RELAXED);
        return false;
    }
    return true;
}

/* Per-thread cache of CUfunction / host stub -> watch (or none), so the name lookup and the
 * substring search run once per kernel and thread, not per launch. The name is CUPTI's
 * symbolName where it gives one (runtime and driver launches alike); cuFuncGetName is the
 * fallback only: on an H200 with torch 2.11 it refused one driver launch's handle
 * (CUDA_ERROR_INVALID_HANDLE), as it refuses CUkernel handles (CUDA 12+ library loading), which
 * cuLaunchKernel accepts. */
#define WCACHE 64
static __thread struct { const void *key; struct watch *w; int valid; } tls_wcache[WCACHE];

static struct watch *lookup_watch(const void *key, const char *name_or_null, CUfunction f) {
    size_t i = ((uintptr_t)key >> 4) & (WCACHE - 1);
    if (tls_wcache[i].valid && tls_wcache[i].key == key) return tls_wcache[i].w;
    const char *name = name_or_null;
    if (name == NULL && f != NULL && cu.FuncGetName != NULL) {
        CUresult r = cu.FuncGetName(&name, f);
        if (r != CUDA_SUCCESS) {
            report_error(ERRK_WATCH_NAME, (int)r, "a launch without a symbol name, and cuFuncGetName failed: %s",
                         cu_error_name(r));
            name = NULL;
        }
    }
    struct watch *w = watch_match(cfg.watches, cfg.nwatch, name);
    tls_wcache[i].key = key;
    tls_wcache[i].w = w;
    tls_wcache[i].valid = 1;
    return w;
}

HIDDEN bool watch_admit(struct watch *w, uint64_t now_ns, uint64_t bytes) {
    uint64_t n = __atomic_fetch_add(&w->seen, 1, __ATOMIC_RELAXED);
    if (cfg.sample_every > 1 && n % cfg.sample_every != 0) {
        ring_count(CTR_BUFFERS_SKIPPED_SAMPLING, 1);
        return false;
    }
    if (bytes == 0) return false; /* an empty buffer (e.g. no tokens): nothing to copy */
    if (!budget_take(now_ns, bytes)) {
        ring_count(CTR_BUFFERS_SKIPPED_BUDGET, 1);
        return false;
    }
    return true;
}

/* A launch on a capturing stream does not run: it becomes a node of the graph being captured. A
 * copy enqueued there would be captured into the engine's graph (and cuMemAllocHost is forbidden
 * during a global-mode capture), so nothing is enqueued; the node is resolved at instantiation.
 * cuStreamIsCapturing is a plain query, allowed during capture. When it fails, nothing is copied. */
static bool stream_capturing(CUstream stream) {
    if (cu.StreamIsCapturing == NULL) return false;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = cu.StreamIsCapturing(stream, &st);
    if (r != CUDA_SUCCESS) {
        report_error(ERRK_CAPTURE_QUERY, (int)r, "cuStreamIsCapturing failed: %s; that launch is not copied",
                     cu_error_name(r));
        return true;
    }
    return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

static void handle_watch(const struct api_info *a, const CUpti_CallbackData *cb, uint64_t exit_ns) {
    struct launch_geom g = {0};
    CUstream stream = NULL;
    const void *key = NULL;
    const char *name = NULL;
    CUfunction f = NULL;
    switch (a->kind) {
    case K_DRV_LAUNCH: {
        const cuLaunchKernel_params *p = cb->functionParams;
        f = p->f;
        g = (struct launch_geom){{p->gridDimX, p->gridDimY, p->gridDimZ},
                                 {p->blockDimX, p->blockDimY, p->blockDimZ}, p->kernelParams, f};
        stream = p->hStream;
        key = f;
        name = cb->symbolName;
        break;
    }
    case K_DRV_LAUNCH_EX: {
        const cuLaunchKernelEx_params *p = cb->functionParams;
        if (p->config == NULL) return;
        f = p->f;
        const CUlaunchConfig *c = p->config;
        g = (struct launch_geom){{c->gridDimX, c->gridDimY, c->gridDimZ}, {c->blockDimX, c->blockDimY, c->blockDimZ},
                                 p->kernelParams, f};
        stream = c->hStream;
        key = f;
        name = cb->symbolName;
        break;
    }
    case K_RT_LAUNCH: {
        const cudaLaunchKernel_v7000_params *p = cb->functionParams;
        g = (struct launch_geom){{p->gridDim.x, p->gridDim.y, p->gridDim.z},
                                 {p->blockDim.x, p->blockDim.y, p->blockDim.z}, p->args, NULL};
        stream = (CUstream)p->stream;
        key = p->func;
        name = cb->symbolName;
        break;
    }
    case K_RT_LAUNCH_EX: {
        const cudaLaunchKernelExC_v11060_params *p = cb->functionParams;
        if (p->config == NULL) return;
        const cudaLaunchConfig_t *c = p->config;
        g = (struct launch_geom){{c->gridDim.x, c->gridDim.y, c->gridDim.z},
                                 {c->blockDim.x, c->blockDim.y, c->blockDim.z}, p->args, NULL};
        stream = (CUstream)c->stream;
        key = p->func;
        name = cb->symbolName;
        break;
    }
    default: return;
    }
    if (key == NULL) return;
    /* A runtime launch without symbolName has nothing to match (and the cache must not remember
     * "no watch" for this key). */
    if (f == NULL && name == NULL) return;
    struct watch *w = lookup_watch(key, name, f);
    if (w == NULL) return;
    if (name == NULL && f != NULL && cu.FuncGetName != NULL && cu.FuncGetName(&name, f) != CUDA_SUCCESS) name = NULL;
    if (name == NULL) name = w->pattern;

    if (stream == NULL && a->ptsz) stream = CU_STREAM_PER_THREAD;
    if (stream_capturing(stream)) return; /* becomes a graph node: copied at each replay (graph.c) */
    uint64_t n = __atomic_fetch_add(&w->seen, 1, __ATOMIC_RELAXED);
    if (cfg.sample_every > 1 && n % cfg.sample_every != 0) {
        ring_count(CTR_BUFFERS_SKIPPED_SAMPLING, 1);
        return;
    }
    struct staging_request q = {.w = w, .kernel_name = name, .correlation_id = cb->correlationId,
                                .tid = current_tid(), .launch_ns = exit_ns, .ctx = cb->context};
    char err[256];
    if (watch_eval(w, &g, q.shape, &q.bytes, &q.src, err, sizeof err) != 0) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        report_error(ERRK_WATCH_PARAM, -1, "watched kernel %s: %s", w->pattern, err);
        return;
    }
    if (q.bytes == 0) return; /* an empty buffer (e.g. no tokens): nothing to copy */
    if (!budget_take(exit_ns, q.bytes)) {
        ring_count(CTR_BUFFERS_SKIPPED_BUDGET, 1);
        return;
    }
    q.stream = stream;
    staging_enqueue(&q);
}

static uint64_t graph_exec_id(const struct api_info *a, const CUpti_CallbackData *cb) {
    CUgraphExec ge = a->kind == K_DRV_GRAPH ? ((const cuGraphLaunch_params *)cb->functionParams)->hGraph
                                            : (CUgraphExec)((const cudaGraphLaunch_v10000_params *)cb->functionParams)
                                                  ->graphExec;
    uint32_t id = 0;
    if (ge == NULL || cupti.GetGraphExecId == NULL) return 0;
    CUptiResult r = cupti.GetGraphExecId(ge, &id);
    if (r != CUPTI_SUCCESS) {
        report_error(ERRK_GRAPH_ID, (int)r, "cuptiGetGraphExecId failed: %s", cupti_error_name(r));
        return 0;
    }
    return id;
}

/* After a successful graph launch: the copies of its watched kernel nodes (graph.c). */
static void handle_graph_watch(const struct api_info *a, const CUpti_CallbackData *cb, uint64_t exit_ns) {
    CUgraphExec ge;
    CUstream stream;
    if (a->kind == K_DRV_GRAPH) {
        const cuGraphLaunch_params *p = cb->functionParams;
        ge = p->hGraph, stream = p->hStream;
    } else {
        const cudaGraphLaunch_v10000_params *p = cb->functionParams;
        ge = (CUgraphExec)p->graphExec, stream = (CUstream)p->stream;
    }
    if (stream == NULL && a->ptsz) stream = CU_STREAM_PER_THREAD;
    if (ge == NULL || stream_capturing(stream)) return; /* a graph launched into a capture runs later, elsewhere */
    graph_launched(ge, stream, cb->context, cb->correlationId, exit_ns);
}

static void on_resource(CUpti_CallbackId cbid, const CUpti_ResourceData *rd) {
    const CUpti_GraphData *g = rd != NULL ? rd->resourceDescriptor : NULL;
    if (g == NULL || cfg.nwatch == 0) return;
    switch (cbid) {
    case CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATE_STARTING: graph_exec_create_starting(); break;
    case CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED: graph_node_cloned(g->originalNode, g->node); break;
    case CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED: graph_exec_created(g->graph, g->graphExec, cfg.nwatch, cfg.watches); break;
    case CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING: graph_exec_destroyed(g->graphExec); break;
    default: break;
    }
}

static bool rt_memcpy_is_dtoh(const struct api_info *a, const CUpti_CallbackData *cb) {
    enum cudaMemcpyKind k;
    if (a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020)
        k = ((const cudaMemcpy_v3020_params *)cb->functionParams)->kind;
    else if (a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020)
        k = ((const cudaMemcpyAsync_v3020_params *)cb->functionParams)->kind;
    else
        k = ((const cudaMemcpyAsync_ptsz_v7000_params *)cb->functionParams)->kind;
    return k == cudaMemcpyDeviceToHost || k == cudaMemcpyDefault;
}

static void CUPTIAPI on_api(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void *data) {
    (void)userdata;
    if (domain == CUPTI_CB_DOMAIN_RESOURCE) {
        if (tls_busy) return;
        uint64_t t = now_mono_ns();
        tls_busy = 1;
        on_resource(cbid, data);
        tls_busy = 0;
        ring_count(CTR_CALLBACK_NS, now_mono_ns() - t);
        return;
    }
    const CUpti_CallbackData *cb = data;
    if (cb == NULL) return;
    const struct api_info *a = api_lookup(domain, cbid);
    if (a == NULL) return;
    if (tls_busy) {
        /* Our own staging copy: record it under a name of its own, so that the consumer can tell
         * the profiler's device-to-host copies from the engine's. */
        if (cb->callbackSite == CUPTI_API_EXIT && a->kind == K_DRV_MEMCPY) {
            uint64_t t = now_mono_ns();
            write_launch(&(struct api_info){domain, cbid, "sparseety_staging_copy", K_DRV_MEMCPY, 0},
                         "sparseety_staging_copy", cb->correlationId, t, t, 0);
        }
        return;
    }
    uint64_t t0 = now_mono_ns();
    tls_busy = 1;
    bool rt_launch = a->kind == K_RT_LAUNCH || a->kind == K_RT_LAUNCH_EX || a->kind == K_RT_GRAPH;
    if (cb->callbackSite == CUPTI_API_ENTER) {
        /* correlationData is CUPTI's per-call scratch shared by the enter and exit callbacks. */
        if (cb->correlationData != NULL) *cb->correlationData = t0;
        if (rt_launch) tls_runtime_depth++;
    } else {
        uint64_t enter = cb->correlationData != NULL && *cb->correlationData != 0 ? *cb->correlationData : t0;
        if (rt_launch && tls_runtime_depth > 0) tls_runtime_depth--;
        bool ok = cb->functionReturnValue == NULL || *(const int *)cb->functionReturnValue == 0;
        switch (a->kind) {
        case K_DRV_GRAPH:
        case K_RT_GRAPH:
            ring_count(CTR_GRAPH_LAUNCHES, 1);
            write_launch(a, a->name, cb->correlationId, enter, t0, ok ? graph_exec_id(a, cb) : 0);
            /* the runtime's graph launch goes through the driver's: copy once */
            if (ok && cfg.nwatch > 0 && (a->kind == K_RT_GRAPH || tls_runtime_depth == 0))
                handle_graph_watch(a, cb, t0);
            break;
        case K_DRV_GRAPH_UPDATE:
            if (ok && cfg.nwatch > 0) {
                const cuGraphExecUpdate_v2_params *p = cb->functionParams;
                graph_exec_updated(p->hGraphExec, p->hGraph, cfg.nwatch, cfg.watches);
            }
            break;
        case K_DRV_GRAPH_NODE_SET:
            if (ok && cfg.nwatch > 0) {
                const cuGraphExecKernelNodeSetParams_v2_params *p = cb->functionParams;
                graph_exec_node_set(p->hGraphExec, p->hNode, p->nodeParams, cfg.nwatch, cfg.watches);
            }
            break;
        case K_RT_MEMCPY:
            if (rt_memcpy_is_dtoh(a, cb)) write_launch(a, a->name, cb->correlationId, enter, t0, 0);
            break;
        case K_DRV_MEMCPY:
            write_launch(a, a->name, cb->correlationId, enter, t0, 0);
            break;
        default:
            ring_count(CTR_LAUNCHES_SEEN, 1);
            write_launch(a, a->name, cb->correlationId, enter, t0, 0);
            if (ok && cfg.nwatch > 0 && (rt_launch || tls_runtime_depth == 0)) handle_watch(a, cb, t0);
            break;
        }
    }
    tls_busy = 0;
    ring_count(CTR_CALLBACK_NS, now_mono_ns() - t0);
}

/* ---------------------------------------------------------------- activity buffers */

static uint64_t CUPTIAPI monotonic_timestamp(void) { return now_mono_ns(); }

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *max_records = 0;
    *buffer = aligned_alloc(8, cfg.activity_buffer_bytes);
    *size = *buffer != NULL ? cfg.activity_buffer_bytes : 0;
    if (*buffer == NULL)
        report_error(ERRK_ACTIVITY_ALLOC, ENOMEM, "cannot allocate a %zu-byte activity buffer: CUPTI drops records",
                     cfg.activity_buffer_bytes);
}

static void write_kernel(const CUpti_ActivityKernel10 *k) {
    const char *name = k->name != NULL ? k->name : "";
    size_t nl = strnlen(name, 4096);
    size_t len = sizeof(struct rec_header) + sizeof(struct rec_kernel) + nl;
    struct rec_header *h = ring_reserve(REC_KERNEL, len);
    if (h == NULL) return;
    struct rec_kernel *r = (struct rec_kernel *)(h + 1);
    r->start_ns = k->start;
    r->end_ns = k->end;
    r->graph_node_id = k->graphNodeId;
    r->correlation_id = k->correlationId;
    r->device_id = k->deviceId;
    r->context_id = k->contextId;
    r->stream_id = k->streamId;
    r->grid[0] = k->gridX, r->grid[1] = k->gridY, r->grid[2] = k->gridZ;
    r->block[0] = k->blockX, r->block[1] = k->blockY, r->block[2] = k->blockZ;
    r->shared_mem_bytes = (uint32_t)k->staticSharedMemory + (uint32_t)k->dynamicSharedMemory;
    r->graph_id = k->graphId;
    r->name_len = (uint32_t)nl;
    r->reserved = 0;
    memcpy(r + 1, name, nl);
    ring_commit(h, len);
}

static void write_memcpy(const CUpti_ActivityMemcpy6 *m) {
    size_t len = sizeof(struct rec_header) + sizeof(struct rec_memcpy);
    struct rec_header *h = ring_reserve(REC_MEMCPY, len);
    if (h == NULL) return;
    struct rec_memcpy *r = (struct rec_memcpy *)(h + 1);
    r->start_ns = m->start;
    r->end_ns = m->end;
    r->bytes = m->bytes;
    r->correlation_id = m->correlationId;
    r->device_id = m->deviceId;
    r->context_id = m->contextId;
    r->stream_id = m->streamId;
    r->graph_id = m->graphId;
    r->copy_kind = m->copyKind;
    r->src_kind = m->srcKind;
    r->dst_kind = m->dstKind;
    r->flags = m->flags;
    ring_commit(h, len);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)size;
    int was_busy = tls_busy;
    tls_busy = 1;
    uint64_t t0 = now_mono_ns();
    CUpti_Activity *rec = NULL;
    CUptiResult r;
    while ((r = cupti.ActivityGetNextRecord(buffer, valid, &rec)) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL)
            write_kernel((const CUpti_ActivityKernel10 *)rec);
        else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY)
            write_memcpy((const CUpti_ActivityMemcpy6 *)rec);
    }
    if (r != CUPTI_ERROR_MAX_LIMIT_REACHED)
        report_error(ERRK_ACTIVITY_NEXT, (int)r, "cuptiActivityGetNextRecord failed: %s", cupti_error_name(r));
    size_t dropped = 0;
    r = cupti.ActivityGetNumDroppedRecords(ctx, stream_id, &dropped);
    if (r == CUPTI_SUCCESS)
        ring_count(CTR_ACTIVITY_DROPPED, dropped);
    else
        report_error(ERRK_ACTIVITY_DROPPED, (int)r, "cuptiActivityGetNumDroppedRecords failed: %s",
                     cupti_error_name(r));
    free(buffer);
    ring_count(CTR_CALLBACK_NS, now_mono_ns() - t0);
    tls_busy = was_busy;
}

/* ---------------------------------------------------------------- flush thread, exit */

static void *flush_main(void *arg) {
    (void)arg;
    tls_busy = 1;
    bool relaxed = false;
    pthread_mutex_lock(&g_flush_mu);
    while (!g_flush_stop) {
        /* The flush's driver calls must not invalidate a global-mode stream capture on an engine
         * thread (torch.cuda.graph's default mode): this thread switches to relaxed mode for good,
         * once libcuda's entry points are loaded (they may come after this thread starts). */
        CUresult (*exchange)(CUstreamCaptureMode *) =
            relaxed ? NULL : __atomic_load_n(&cu.ThreadExchangeStreamCaptureMode, __ATOMIC_ACQUIRE);
        if (exchange != NULL) {
            CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
            relaxed = exchange(&mode) == CUDA_SUCCESS;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)cfg.flush_ms * 1000000ull;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&g_flush_cv, &g_flush_mu, &ts);
        if (g_flush_stop) break;
        pthread_mutex_unlock(&g_flush_mu);
        CUptiResult r = cupti.ActivityFlushAll(0);
        if (r != CUPTI_SUCCESS)
            report_error(ERRK_FLUSH, (int)r, "cuptiActivityFlushAll failed: %s", cupti_error_name(r));
        pthread_mutex_lock(&g_flush_mu);
    }
    pthread_mutex_unlock(&g_flush_mu);
    return NULL;
}

static void at_exit(void) {
    if (!ring_active()) return;
    tls_busy = 1;
    if (g_flush_started) {
        pthread_mutex_lock(&g_flush_mu);
        g_flush_stop = 1;
        pthread_cond_signal(&g_flush_cv);
        pthread_mutex_unlock(&g_flush_mu);
        pthread_join(g_flush_thread, NULL);
        g_flush_started = 0;
    }
    if (g_initialized) {
        CUptiResult r = cupti.ActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
        if (r != CUPTI_SUCCESS)
            report_error(ERRK_FLUSH, (int)r, "cuptiActivityFlushAll at exit failed: %s", cupti_error_name(r));
    }
    staging_shutdown(200);
    ring_set_finished();
}

static void after_fork_child(void) {
    /* The child shares the parent's ring mapping but has none of its threads: stay silent. A
     * child that execs gets its own injection and ring. */
    ring_disable_after_fork();
    g_flush_started = 0;
}

/* ---------------------------------------------------------------- init */

static void *sym(void *lib, const char *name, bool required, char *missing, size_t mlen) {
    void *p = dlsym(lib, name);
    if (p == NULL && required) {
        size_t l = strlen(missing);
        snprintf(missing + l, mlen - l, "%s%s", l ? ", " : "", name);
    }
    return p;
}

static int load_cupti(void) {
    const char *path = setting("SPARSEETY_CUPTI_PATH");
    void *lib = NULL;
    if (path != NULL && *path) {
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    } else {
        lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL) lib = dlopen("libcupti.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (lib == NULL) {
        report_error(ERRK_NONE, -1, "cannot load libcupti (%s): %s; set SPARSEETY_CUPTI_PATH to libcupti.so.13 "
                     "(pip package nvidia-cuda-cupti: .../nvidia/cu13/lib/libcupti.so.13)",
                     path ? path : "libcupti.so.13", dlerror());
        return -1;
    }
    char missing[512] = "";
    *(void **)&cupti.Subscribe = sym(lib, "cuptiSubscribe", true, missing, sizeof missing);
    *(void **)&cupti.EnableCallback = sym(lib, "cuptiEnableCallback", true, missing, sizeof missing);
    *(void **)&cupti.ActivityEnable = sym(lib, "cuptiActivityEnable", true, missing, sizeof missing);
    *(void **)&cupti.ActivityRegisterCallbacks = sym(lib, "cuptiActivityRegisterCallbacks", true, missing, sizeof missing);
    *(void **)&cupti.ActivityRegisterTimestampCallback =
        sym(lib, "cuptiActivityRegisterTimestampCallback", true, missing, sizeof missing);
    *(void **)&cupti.ActivityFlushAll = sym(lib, "cuptiActivityFlushAll", true, missing, sizeof missing);
    *(void **)&cupti.ActivityGetNextRecord = sym(lib, "cuptiActivityGetNextRecord", true, missing, sizeof missing);
    *(void **)&cupti.ActivityGetNumDroppedRecords =
        sym(lib, "cuptiActivityGetNumDroppedRecords", true, missing, sizeof missing);
    *(void **)&cupti.GetResultString = sym(lib, "cuptiGetResultString", true, missing, sizeof missing);
    *(void **)&cupti.GetGraphExecId = sym(lib, "cuptiGetGraphExecId", false, missing, sizeof missing);
    *(void **)&cupti_graph.GetGraphNodeId = sym(lib, "cuptiGetGraphNodeId", false, missing, sizeof missing);
    *(void **)&cupti_graph.GetGraphId = sym(lib, "cuptiGetGraphId", false, missing, sizeof missing);
    if (missing[0]) {
        report_error(ERRK_NONE, -1, "libcupti lacks %s: too old (CUDA 13 needed)", missing);
        return -1;
    }
    return 0;
}

static void load_cuda(void) {
    const char *path = setting("SPARSEETY_CUDA_PATH"); /* tests point this at a stub */
    void *lib = NULL;
    if (path != NULL && *path) {
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    } else {
        /* The driver that is calling us is already loaded: take that very copy. */
        lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    }
    if (lib == NULL) {
        report_error(ERRK_NONE, -1, "cannot load libcuda (%s): %s; watched buffers are not captured",
                     path ? path : "libcuda.so.1", dlerror());
        return;
    }
    char missing[512] = "";
    *(void **)&cu.MemAllocHost = sym(lib, "cuMemAllocHost_v2", true, missing, sizeof missing);
    *(void **)&cu.MemFreeHost = sym(lib, "cuMemFreeHost", true, missing, sizeof missing);
    *(void **)&cu.MemcpyDtoHAsync = sym(lib, "cuMemcpyDtoHAsync_v2", true, missing, sizeof missing);
    *(void **)&cu.EventCreate = sym(lib, "cuEventCreate", true, missing, sizeof missing);
    *(void **)&cu.EventRecord = sym(lib, "cuEventRecord", true, missing, sizeof missing);
    *(void **)&cu.EventQuery = sym(lib, "cuEventQuery", true, missing, sizeof missing);
    *(void **)&cu.EventDestroy = sym(lib, "cuEventDestroy_v2", true, missing, sizeof missing);
    *(void **)&cu.FuncGetName = sym(lib, "cuFuncGetName", true, missing, sizeof missing);
    *(void **)&cu.CtxSetCurrent = sym(lib, "cuCtxSetCurrent", true, missing, sizeof missing);
    *(void **)&cu.GetErrorName = sym(lib, "cuGetErrorName", true, missing, sizeof missing);
    *(void **)&cu.FuncGetParamInfo = sym(lib, "cuFuncGetParamInfo", false, missing, sizeof missing);
    /* optional: CUDA graphs are followed only with all of these */
    *(void **)&cu.StreamIsCapturing = sym(lib, "cuStreamIsCapturing", false, missing, sizeof missing);
    *(void **)&cu.GraphGetNodes = sym(lib, "cuGraphGetNodes", false, missing, sizeof missing);
    *(void **)&cu.GraphNodeGetType = sym(lib, "cuGraphNodeGetType", false, missing, sizeof missing);
    *(void **)&cu.GraphKernelNodeGetParams = sym(lib, "cuGraphKernelNodeGetParams_v2", false, missing, sizeof missing);
    *(void **)&cu.KernelGetName = sym(lib, "cuKernelGetName", false, missing, sizeof missing);
    *(void **)&cu.ThreadExchangeStreamCaptureMode =
        sym(lib, "cuThreadExchangeStreamCaptureMode", false, missing, sizeof missing);
    if (missing[0]) {
        report_error(ERRK_NONE, -1, "libcuda lacks %s; watched buffers are not captured", missing);
        memset(&cu, 0, sizeof cu);
    }
}

static void load_watches(void) {
    char err[256];
    const char *spec = setting("SPARSEETY_WATCH");
    if (spec != NULL && *spec && watch_parse(spec, cfg.watches, WATCH_MAX, &cfg.nwatch, err, sizeof err) != 0)
        report_error(ERRK_NONE, EINVAL, "SPARSEETY_WATCH: %s", err);
    const char *file = setting("SPARSEETY_WATCH_FILE");
    if (file == NULL || !*file) return;
    FILE *fp = fopen(file, "r");
    if (fp == NULL) {
        report_error(ERRK_NONE, errno, "SPARSEETY_WATCH_FILE %s: %s", file, strerror(errno));
        return;
    }
    char text[16384];
    size_t n = fread(text, 1, sizeof text - 1, fp);
    text[n] = '\0';
    fclose(fp);
    if (watch_parse(text, cfg.watches, WATCH_MAX, &cfg.nwatch, err, sizeof err) != 0)
        report_error(ERRK_NONE, EINVAL, "SPARSEETY_WATCH_FILE %s: %s", file, err);
}

static void init(void) {
    char err[512];
    uint64_t cap = floor_pow2(env_u64("SPARSEETY_RING_BYTES", 64ull << 20));
    if (cap < 4096) cap = 4096;
    if (cap > (1ull << 30)) cap = 1ull << 30;
    if (ring_create(cap, g_late ? RING_FLAG_LATE_ATTACH : 0, err, sizeof err) != 0) {
        fprintf(stderr, LOG_PREFIX "no shared-memory ring, profiling off: %s\n", err);
        return;
    }
    pthread_atfork(NULL, NULL, after_fork_child);
    atexit(at_exit);
    cfg.sample_every = env_u64("SPARSEETY_SAMPLE_EVERY", 1);
    if (cfg.sample_every == 0) cfg.sample_every = 1;
    cfg.bytes_per_s = env_u64("SPARSEETY_BUFFER_BYTES_PER_S", 64ull << 20);
    cfg.flush_ms = (unsigned)env_u64("SPARSEETY_FLUSH_MS", 100);
    if (cfg.flush_ms == 0) cfg.flush_ms = 100;
    cfg.activity_buffer_bytes = (size_t)env_u64("SPARSEETY_ACTIVITY_BUFFER_BYTES", 8ull << 20);
    if (cfg.activity_buffer_bytes < 4096) cfg.activity_buffer_bytes = 4096;
    cfg.activity_buffer_bytes &= ~(size_t)7; /* aligned_alloc wants a multiple of the alignment */
    staging_configure((size_t)env_u64("SPARSEETY_STAGING_BYTES", 4ull << 20));
    load_watches();
    if (load_cupti() != 0) return;
    load_cuda();

    CUptiResult r = cupti.Subscribe(&g_sub, on_api, NULL);
    if (r != CUPTI_SUCCESS) {
        /* Another tool (Kineto, nsys, ...) owns CUPTI. Registering our buffer callbacks would steal
         * its activity records, so we stay out entirely. */
        report_error(ERRK_NONE, (int)r, "cuptiSubscribe failed: %s (%d)%s", cupti_error_name(r), (int)r,
                     r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
                         ? ": MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, another CUPTI client (torch profiler/Kineto, "
                           "Nsight) is active; CUDA <= 13.2 allows only one. Nothing is recorded."
                         : "");
        return;
    }
    /* Once, before any activity kind is enabled: registering later corrupts records already
     * stamped with the other clock. */
    r = cupti.ActivityRegisterTimestampCallback(monotonic_timestamp);
    if (r == CUPTI_SUCCESS) {
        ring_set_clock(RING_CLOCK_MONOTONIC);
    } else {
        report_error(ERRK_NONE, (int)r, "cuptiActivityRegisterTimestampCallback failed: %s; activity timestamps "
                     "use CUPTI's clock, convert with the header's calibration pair", cupti_error_name(r));
    }
    CUPTI_CHECK(cupti.ActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    CUPTI_CHECK(cupti.ActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
    CUPTI_CHECK(cupti.ActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "cuptiActivityEnable(MEMCPY)");
    for (size_t i = 0; i < NAPIS; i++)
        CUPTI_CHECK(cupti.EnableCallback(1, g_sub, APIS[i].domain, APIS[i].cbid), "cuptiEnableCallback");
    if (cfg.nwatch > 0) /* graphs matter only for watched kernels (their timings come as activity) */
        for (size_t i = 0; i < NRESOURCE; i++)
            CUPTI_CHECK(cupti.EnableCallback(1, g_sub, CUPTI_CB_DOMAIN_RESOURCE, RESOURCE_CBIDS[i]),
                        "cuptiEnableCallback(RESOURCE)");
    g_initialized = 1;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g_flush_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&g_flush_thread, NULL, flush_main, NULL) == 0)
        g_flush_started = 1;
    else
        report_error(ERRK_NONE, -1, "cannot start the flush thread: activity arrives only when CUPTI's buffers fill");
    return;
fail:
    return;
}

static int g_once;

__attribute__((visibility("default"))) int InitializeInjection(void) {
    if (__atomic_exchange_n(&g_once, 1, __ATOMIC_ACQ_REL)) return 1;
    tls_busy = 1;
    init();
    tls_busy = 0;
    return 1; /* always: the engine must run whatever happened here */
}

/* Late attach: `sparseety-prof attach --late-attach` dlopens this library into a running CUDA
 * process with ptrace and calls this on the thread it stopped, with the settings as
 * "KEY=VALUE\n" text (SPARSEETY_* names, as in the environment of a launch). cuptiSubscribe and
 * activity tracing work in a process whose CUDA is already initialised; what ran before this call
 * is not seen (sparseety_prof/gpu/late_attach.py says what). Returns 1: ring created and CUPTI
 * subscribed; 0: ring created but CUPTI not (why is an ERROR record in the ring); -1: no ring;
 * 2: the library was already initialised in this process (its ring, if any, is in use). */
__attribute__((visibility("default"))) int SparseetyLateAttach(const char *settings) {
    if (__atomic_exchange_n(&g_once, 1, __ATOMIC_ACQ_REL)) return 2;
    size_t n = settings != NULL ? strnlen(settings, sizeof g_settings - 1) : 0;
    memcpy(g_settings, settings != NULL ? settings : "", n);
    g_settings[n] = '\0';
    for (size_t i = 0; i < n; i++)
        if (g_settings[i] == '\n') g_settings[i] = '\0';
    g_settings_len = n;
    g_late = 1;
    tls_busy = 1;
    init();
    tls_busy = 0;
    if (!ring_active()) return -1;
    return g_initialized ? 1 : 0;
}
