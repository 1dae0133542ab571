/* A stand-in libcupti for tests without a GPU: the entry points libsparseety_cupti.so calls, plus
 * hooks (stub_api.h) that fire API callbacks with synthetic callback data and deliver synthetic
 * activity buffers through the registered buffer callbacks. Configured by environment:
 *   STUB_CUPTI_SUBSCRIBE_RESULT  CUptiResult cuptiSubscribe returns (default 0)
 *   STUB_CUPTI_TIMESTAMP_RESULT  CUptiResult cuptiActivityRegisterTimestampCallback returns */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cupti.h>

#include "stub_api.h"

#define API __attribute__((visibility("default")))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char call_log[1 << 16];
static CUpti_CallbackFunc api_cb;
static void *api_ud;
static CUpti_BuffersCallbackRequestFunc req_cb;
static CUpti_BuffersCallbackCompleteFunc done_cb;
static CUpti_TimestampCallbackFunc ts_cb;
static unsigned char enabled[4][1024]; /* [domain][cbid]: driver 1, runtime 2, resource 3 */
static size_t dropped_pending;
static int flushes;
static void deliver_pending(void);

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...) {
    char item[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(item, sizeof item, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&mu);
    size_t l = strlen(call_log);
    snprintf(call_log + l, sizeof call_log - l, "%s%s", l ? ";" : "", item);
    pthread_mutex_unlock(&mu);
}

static CUptiResult env_result(const char *name) {
    const char *v = getenv(name);
    return v ? (CUptiResult)atoi(v) : CUPTI_SUCCESS;
}

API CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *sub, CUpti_CallbackFunc cb, void *ud) {
    logf_("subscribe");
    CUptiResult r = env_result("STUB_CUPTI_SUBSCRIBE_RESULT");
    if (r != CUPTI_SUCCESS) return r;
    api_cb = cb;
    api_ud = ud;
    *sub = (CUpti_SubscriberHandle)&api_cb;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle sub, CUpti_CallbackDomain d,
                                    CUpti_CallbackId cbid) {
    if (sub != (CUpti_SubscriberHandle)&api_cb || d < 1 || d > 3 || cbid >= 1024) return CUPTI_ERROR_INVALID_PARAMETER;
    enabled[d][cbid] = (unsigned char)(enable != 0);
    logf_("cb:%d:%u", (int)d, (unsigned)cbid);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind) {
    logf_("enable:%d", (int)kind);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc req,
                                               CUpti_BuffersCallbackCompleteFunc done) {
    logf_("register");
    req_cb = req;
    done_cb = done;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityRegisterTimestampCallback(CUpti_TimestampCallbackFunc f) {
    logf_("timestamp");
    CUptiResult r = env_result("STUB_CUPTI_TIMESTAMP_RESULT");
    if (r == CUPTI_SUCCESS) ts_cb = f;
    return r;
}

API CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    __atomic_fetch_add(&flushes, 1, __ATOMIC_RELAXED);
    if (flag != 0) logf_("flush:%u", flag);
    deliver_pending();
    return CUPTI_SUCCESS;
}

static size_t record_size(const CUpti_Activity *r) {
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    default: return 0;
    }
}

API CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, CUpti_Activity **record) {
    uint8_t *p = *record == NULL ? buffer : (uint8_t *)*record + ((record_size(*record) + 7) & ~(size_t)7);
    if (p + sizeof(CUpti_Activity) > buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    size_t sz = record_size((CUpti_Activity *)p);
    if (sz == 0 || p + sz > buffer + valid) return CUPTI_ERROR_INVALID_KIND;
    *record = (CUpti_Activity *)p;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext ctx, uint32_t stream, size_t *dropped) {
    (void)ctx;
    (void)stream;
    *dropped = __atomic_exchange_n(&dropped_pending, 0, __ATOMIC_RELAXED);
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetResultString(CUptiResult r, const char **s) {
    switch (r) {
    case CUPTI_SUCCESS: *s = "CUPTI_SUCCESS"; break;
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED: *s = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"; break;
    case CUPTI_ERROR_NOT_SUPPORTED: *s = "CUPTI_ERROR_NOT_SUPPORTED"; break;
    default: *s = "CUPTI_ERROR_UNKNOWN"; break;
    }
    return CUPTI_SUCCESS;
}

/* The stub libcuda's graph objects (cuda_stub.c) start with their CUPTI id; other handles (the
 * main scenario's made-up ones) are their own id. */
API CUptiResult cuptiGetGraphExecId(CUgraphExec exec, uint32_t *id) {
    if (exec == NULL || id == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    *id = (uintptr_t)exec < 4096 ? (uint32_t)(uintptr_t)exec : ((const struct stub_graph_ids *)(const void *)exec)->id;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetGraphId(CUgraph graph, uint32_t *id) {
    if (graph == NULL || id == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    *id = ((const struct stub_graph_ids *)(const void *)graph)->id;
    return CUPTI_SUCCESS;
}

API CUptiResult cuptiGetGraphNodeId(CUgraphNode node, uint64_t *id) {
    if (node == NULL || id == NULL) return CUPTI_ERROR_INVALID_PARAMETER;
    *id = ((const struct stub_node_ids *)(const void *)node)->id;
    return CUPTI_SUCCESS;
}

/* ---- hooks ---- */

API int stub_cupti_call(int domain, int cbid, const void *params, const char *symbol, uint32_t corr, void *ctx,
                        int retval) {
    if (api_cb == NULL || domain < 1 || domain > 2 || cbid < 0 || cbid >= 1024 || !enabled[domain][cbid]) return 0;
    uint64_t scratch = 0; /* CUPTI's per-call correlationData, shared by enter and exit */
    int zero = 0;
    CUpti_CallbackData d = {0};
    d.functionName = "stub";
    d.functionParams = params;
    d.symbolName = symbol;
    d.context = (CUcontext)ctx;
    d.correlationId = corr;
    d.correlationData = &scratch;
    d.callbackSite = CUPTI_API_ENTER;
    d.functionReturnValue = &zero;
    api_cb(api_ud, (CUpti_CallbackDomain)domain, (CUpti_CallbackId)cbid, &d);
    d.callbackSite = CUPTI_API_EXIT;
    d.functionReturnValue = &retval;
    api_cb(api_ud, (CUpti_CallbackDomain)domain, (CUpti_CallbackId)cbid, &d);
    return 1;
}

API void stub_cupti_api(int domain, int cbid, const void *params, const char *symbol, uint32_t corr, void *ctx,
                        int site, int retval, uint64_t *scratch) {
    if (api_cb == NULL || domain < 1 || domain > 2 || cbid < 0 || cbid >= 1024 || !enabled[domain][cbid]) return;
    CUpti_CallbackData d = {0};
    d.functionName = "stub";
    d.functionParams = params;
    d.symbolName = symbol;
    d.context = (CUcontext)ctx;
    d.correlationId = corr;
    d.correlationData = scratch;
    d.callbackSite = (CUpti_ApiCallbackSite)site;
    d.functionReturnValue = &retval;
    api_cb(api_ud, (CUpti_CallbackDomain)domain, (CUpti_CallbackId)cbid, &d);
}

API void stub_cupti_resource(int cbid, void *ctx, const void *g) {
    if (api_cb == NULL || cbid < 0 || cbid >= 1024 || !enabled[CUPTI_CB_DOMAIN_RESOURCE][cbid]) return;
    CUpti_ResourceData d;
    memset(&d, 0, sizeof d);
    d.context = (CUcontext)ctx;
    d.resourceDescriptor = (void *)g;
    api_cb(api_ud, CUPTI_CB_DOMAIN_RESOURCE, (CUpti_CallbackId)cbid, &d);
}

API uint32_t stub_cupti_next_correlation(void) {
    static uint32_t next = 500000;
    return __atomic_add_fetch(&next, 1, __ATOMIC_RELAXED);
}

/* Kernel records of the work the stub device ran, handed over at the next cuptiActivityFlushAll
 * as CUPTI does: in buffers from the registered request callback. */
static uint8_t pending_act[1 << 16];
static size_t pending_act_len;

API void stub_cupti_kernel_ran(const char *name, uint32_t corr, uint64_t start, uint64_t end, uint32_t graph_id,
                               uint64_t node_id) {
    CUpti_ActivityKernel10 k;
    memset(&k, 0, sizeof k);
    k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    k.name = name;
    k.correlationId = corr;
    k.start = start;
    k.end = end;
    k.contextId = 1;
    k.streamId = 7;
    k.gridX = k.gridY = k.gridZ = 1;
    k.blockX = 32, k.blockY = k.blockZ = 1;
    k.graphId = graph_id;
    k.graphNodeId = node_id;
    size_t sz = (sizeof k + 7) & ~(size_t)7;
    pthread_mutex_lock(&mu);
    if (pending_act_len + sz <= sizeof pending_act) {
        memcpy(pending_act + pending_act_len, &k, sizeof k);
        pending_act_len += sz;
    } else {
        __atomic_fetch_add(&dropped_pending, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&mu);
}

static void deliver_pending(void) {
    static uint8_t out[sizeof pending_act];
    pthread_mutex_lock(&mu);
    size_t n = pending_act_len;
    memcpy(out, pending_act, n);
    pending_act_len = 0;
    pthread_mutex_unlock(&mu);
    if (n > 0 && req_cb != NULL) stub_cupti_deliver(out, n, 0);
}

API int stub_cupti_deliver(const void *records, size_t bytes, size_t dropped) {
    if (req_cb == NULL || done_cb == NULL) return 0; /* nobody asked for activity: CUPTI keeps none */
    uint8_t *buf = NULL;
    size_t size = 0, maxrec = 0;
    req_cb(&buf, &size, &maxrec);
    if (buf == NULL || size < bytes) abort();
    memcpy(buf, records, bytes);
    __atomic_store_n(&dropped_pending, dropped, __ATOMIC_RELAXED);
    done_cb(NULL, 0, buf, size, bytes);
    return 1;
}

API uint64_t stub_cupti_timestamp(void) { return ts_cb ? ts_cb() : 0; }
API const char *stub_cupti_log(void) { return call_log; }
API int stub_cupti_flushes(void) { return __atomic_load_n(&flushes, __ATOMIC_RELAXED); }
