/* Watched kernels inside CUDA graphs. A graph replay (cuGraphLaunch) fires no per-kernel launch
 * callback, but a kernel node keeps the argument values it was captured (or updated) with: the
 * device pointer of a watched argument is the same on every replay, only the buffer's contents
 * change. So the watched arguments are resolved once per executable graph, when it is
 * instantiated (CUPTI resource callback GRAPHEXEC_CREATED: the source graph's kernel nodes are
 * read with cuGraphKernelNodeGetParams) or updated (cuGraphExecUpdate), and after each launch of
 * that executable graph the copies are enqueued on the launch's stream, exactly like the copies of
 * eager launches (staging.c): cuMemcpyDtoHAsync + cuEventRecord, no host synchronisation.
 *
 * What is kept is values, never pointers into the graph: torch destroys the source graph right
 * after instantiating it, and the kernelParams array cuGraphKernelNodeGetParams returns belongs to
 * the node.
 *
 * Node ids. Instantiation clones every node (GRAPHNODE_CLONED, on the instantiating thread, before
 * GRAPHEXEC_CREATED), and kernel activity records of a replay carry the clone's id
 * (cuptiGetGraphNodeId): that id is what a copy is tagged with, so it joins the kernel row it
 * belongs to. The clone reports are kept from whenever they come, not only after
 * GRAPHEXEC_CREATE_STARTING: on the H200 run of 2026-12-04 (results/gpu_check/) every copy carried
 * its source node's id (graph 1, 4) and every replayed kernel a clone's (graph 2, 5, same node
 * index), which is what a driver that clones the graph before it reports CREATE_STARTING gives
 * when only the reports after it are kept. Without a CLONED report the source node's id is used.
 * Should GRAPHEXEC_CREATED come without its source graph, the nodes are the originals of the
 * clones reported since the previous instantiation. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

HIDDEN struct cupti_graph_api cupti_graph;

struct graph_watch { /* one watched kernel node of an executable graph */
    const struct watch *w;
    unsigned kernel_ordinal; /* position among the graph's kernel nodes: cuGraphExecUpdate keeps it */
    uint64_t node_id;
    uint64_t source_node_id; /* the node instantiated: cuGraphExecKernelNodeSetParams names it */
    CUdeviceptr src;
    uint64_t bytes;
    uint64_t shape[WATCH_MAX_DIMS];
    char name[256];
};

struct graph_exec_entry {
    CUgraphExec exec; /* NULL: free slot */
    uint32_t graph_id;
    int n;
    struct graph_watch *nodes;
};

#define GRAPH_EXECS 1024
static struct graph_exec_entry g_execs[GRAPH_EXECS];
static int g_nexec; /* high-water mark of used slots */
/* Held for a table look-up or update only, never across a CUDA call: graph launches (one per
 * decode step) and instantiations are rare next to kernel launches. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

/* Clones reported on this thread since its last instantiation: original node -> clone id. */
struct clone_pair {
    CUgraphNode original;
    uint64_t clone_id;
};
static __thread struct clone_pair *tls_clones;
static __thread size_t tls_nclones, tls_cap_clones;
/* Clones made outside instantiations (cuGraphClone) are kept too until the next instantiation
 * consumes the list; past this many the list starts again rather than grow without end. */
#define MAX_PENDING_CLONES (1u << 16)

HIDDEN void graph_exec_create_starting(void) {
    /* Nothing to reset: the clones of this instantiation may already have been reported. */
}

HIDDEN void graph_node_cloned(CUgraphNode original, CUgraphNode clone) {
    if (original == NULL || clone == NULL || cupti_graph.GetGraphNodeId == NULL) return;
    uint64_t id = 0;
    if (cupti_graph.GetGraphNodeId(clone, &id) != CUPTI_SUCCESS) return;
    if (tls_nclones >= MAX_PENDING_CLONES) tls_nclones = 0;
    if (tls_nclones == tls_cap_clones) {
        size_t cap = tls_cap_clones ? tls_cap_clones * 2 : 256;
        struct clone_pair *p = realloc(tls_clones, cap * sizeof *p);
        if (p == NULL) return; /* the source node's id is used instead */
        tls_clones = p;
        tls_cap_clones = cap;
    }
    tls_clones[tls_nclones++] = (struct clone_pair){original, id};
}

static uint64_t node_id_of(CUgraphNode node) {
    for (size_t i = tls_nclones; i-- > 0;) /* the newest clone of a node: this instantiation's */
        if (tls_clones[i].original == node) return tls_clones[i].clone_id;
    uint64_t id = 0;
    if (cupti_graph.GetGraphNodeId != NULL) cupti_graph.GetGraphNodeId(node, &id);
    return id;
}

static const char *kernel_name(const CUDA_KERNEL_NODE_PARAMS *p) {
    const char *name = NULL;
    if (p->func != NULL && cu.FuncGetName != NULL && cu.FuncGetName(&name, p->func) == CUDA_SUCCESS) return name;
    if (p->kern != NULL && cu.KernelGetName != NULL && cu.KernelGetName(&name, p->kern) == CUDA_SUCCESS) return name;
    return NULL;
}

/* The nodes of `graph` (calloc'ed, *num of them), or, without a graph, the original nodes the
 * running instantiation reported as cloned, in report order. NULL with *num = 0 when there are none;
 * NULL with *num = 1 on a failure (reported). */
static CUgraphNode *list_nodes(CUgraph graph, size_t *num) {
    *num = 0;
    if (graph == NULL) { /* GRAPHEXEC_CREATED without its source graph: the clones' originals */
        if (tls_nclones == 0) return NULL;
        CUgraphNode *nodes = calloc(tls_nclones, sizeof *nodes);
        if (nodes == NULL) return *num = 1, NULL;
        for (size_t i = 0; i < tls_nclones; i++) nodes[i] = tls_clones[i].original;
        *num = tls_nclones;
        return nodes;
    }
    CUresult r = cu.GraphGetNodes(graph, NULL, num);
    if (r != CUDA_SUCCESS) {
        report_error(ERRK_GRAPH_READ, (int)r, "cuGraphGetNodes failed: %s; this graph's watched kernels are not "
                     "copied", cu_error_name(r));
        return *num = 1, NULL;
    }
    if (*num == 0) return NULL;
    CUgraphNode *nodes = calloc(*num, sizeof *nodes);
    if (nodes == NULL || (r = cu.GraphGetNodes(graph, nodes, num)) != CUDA_SUCCESS) {
        report_error(ERRK_GRAPH_READ, (int)r, "cannot read the nodes of a CUDA graph: %s", cu_error_name(r));
        free(nodes);
        return *num = 1, NULL;
    }
    return nodes;
}

/* The watched kernel nodes of `graph`, their arguments evaluated now. -1 when the graph could not be
 * read (reported); 0 with *n = 0 when nothing in it is watched. */
static int resolve(CUgraph graph, int nwatch, struct watch *watches, struct graph_watch **out, int *n) {
    *out = NULL;
    *n = 0;
    if (cu.GraphGetNodes == NULL || cu.GraphNodeGetType == NULL || cu.GraphKernelNodeGetParams == NULL) return -1;
    size_t num = 0;
    CUgraphNode *nodes = list_nodes(graph, &num);
    if (nodes == NULL) return num == 0 ? 0 : -1;
    struct graph_watch *gw = calloc(num, sizeof *gw);
    if (gw == NULL) {
        report_error(ERRK_GRAPH_READ, ENOMEM, "out of memory reading a CUDA graph");
        free(nodes);
        return -1;
    }
    CUresult r;
    unsigned ordinal = 0;
    for (size_t i = 0; i < num; i++) {
        CUgraphNodeType type;
        if (cu.GraphNodeGetType(nodes[i], &type) != CUDA_SUCCESS || type != CU_GRAPH_NODE_TYPE_KERNEL) continue;
        unsigned k = ordinal++;
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        if ((r = cu.GraphKernelNodeGetParams(nodes[i], &p)) != CUDA_SUCCESS) {
            report_error(ERRK_GRAPH_READ, (int)r, "cuGraphKernelNodeGetParams failed: %s", cu_error_name(r));
            continue;
        }
        const char *name = kernel_name(&p);
        struct watch *w = watch_match(watches, nwatch, name);
        if (w == NULL) continue;
        if (p.kernelParams == NULL) {
            ring_count(CTR_BUFFERS_FAILED, 1);
            report_error(ERRK_WATCH_EXTRA, -1, "watched graph node %s passes its arguments through `extra`: "
                         "not copied", w->pattern);
            continue;
        }
        struct launch_geom g = {{p.gridDimX, p.gridDimY, p.gridDimZ}, {p.blockDimX, p.blockDimY, p.blockDimZ},
                                p.kernelParams, p.func};
        struct graph_watch *e = &gw[*n];
        char err[256];
        if (watch_eval(w, &g, e->shape, &e->bytes, &e->src, err, sizeof err) != 0) {
            ring_count(CTR_BUFFERS_FAILED, 1);
            report_error(ERRK_WATCH_PARAM, -1, "watched graph node %s: %s", w->pattern, err);
            continue;
        }
        e->w = w;
        e->kernel_ordinal = k;
        e->node_id = node_id_of(nodes[i]);
        if (cupti_graph.GetGraphNodeId != NULL) cupti_graph.GetGraphNodeId(nodes[i], &e->source_node_id);
        snprintf(e->name, sizeof e->name, "%s", name);
        (*n)++;
    }
    free(nodes);
    if (*n == 0) {
        free(gw);
        gw = NULL;
    }
    *out = gw;
    return 0;
}

static struct graph_exec_entry *find(CUgraphExec exec) {
    for (int i = 0; i < g_nexec; i++)
        if (g_execs[i].exec == exec) return &g_execs[i];
    return NULL;
}

/* Drops the entry of `exec` (a handle the driver may hand out again once destroyed). */
HIDDEN void graph_exec_destroyed(CUgraphExec exec) {
    pthread_mutex_lock(&g_mu);
    struct graph_exec_entry *e = find(exec);
    struct graph_watch *old = NULL;
    if (e != NULL) {
        old = e->nodes;
        memset(e, 0, sizeof *e);
    }
    pthread_mutex_unlock(&g_mu);
    free(old);
}

HIDDEN void graph_exec_created(CUgraph graph, CUgraphExec exec, int nwatch, struct watch *watches) {
    if (exec == NULL) {
        tls_nclones = 0;
        return;
    }
    graph_exec_destroyed(exec); /* a stale entry of a recycled handle */
    struct graph_watch *nodes;
    int n;
    int rc = resolve(graph, nwatch, watches, &nodes, &n);
    tls_nclones = 0;
    if (rc != 0 || n == 0) return;
    uint32_t graph_id = 0;
    if (graph != NULL && cupti_graph.GetGraphId != NULL) cupti_graph.GetGraphId(graph, &graph_id);
    pthread_mutex_lock(&g_mu);
    struct graph_exec_entry *slot = find(NULL);
    if (slot == NULL && g_nexec < GRAPH_EXECS) slot = &g_execs[g_nexec++];
    if (slot != NULL) *slot = (struct graph_exec_entry){exec, graph_id, n, nodes};
    pthread_mutex_unlock(&g_mu);
    if (slot == NULL) {
        free(nodes);
        report_error(ERRK_GRAPH_TABLE, -1, "more than %d executable graphs with watched kernels at once: the "
                     "newest are not copied", GRAPH_EXECS);
    }
}

/* cuGraphExecUpdate succeeded: `exec` now runs with the parameters of `graph`, whose topology is
 * the same. The executable's own nodes (and their ids) stay; kernel node k takes the arguments of
 * kernel node k of `graph`. */
HIDDEN void graph_exec_updated(CUgraphExec exec, CUgraph graph, int nwatch, struct watch *watches) {
    if (exec == NULL || graph == NULL) return;
    struct graph_watch *fresh;
    int n;
    if (resolve(graph, nwatch, watches, &fresh, &n) != 0) return;
    pthread_mutex_lock(&g_mu);
    struct graph_exec_entry *e = find(exec);
    if (e != NULL) {
        for (int i = 0; i < n; i++) /* keep the executable's node ids (and the ones it was made from) */
            for (int j = 0; j < e->n; j++)
                if (e->nodes[j].kernel_ordinal == fresh[i].kernel_ordinal) {
                    fresh[i].node_id = e->nodes[j].node_id;
                    fresh[i].source_node_id = e->nodes[j].source_node_id;
                }
        struct graph_watch *old = e->nodes;
        e->nodes = fresh;
        e->n = n;
        fresh = old;
        if (n == 0) memset(e, 0, sizeof *e);
    }
    pthread_mutex_unlock(&g_mu);
    free(fresh);
    if (e == NULL && n > 0) report_error(ERRK_GRAPH_TABLE, -1, "cuGraphExecUpdate of an executable graph "
                                         "instantiated before the library saw it: its watched kernels are not copied");
}

/* cuGraphExecKernelNodeSetParams succeeded: the executable's node instantiated from `node` runs with
 * `p` from now on. Only a node already watched is followed (its copy reads the new pointer); a node
 * that becomes watched only through new parameters is reported and not copied. */
HIDDEN void graph_exec_node_set(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p, int nwatch,
                                struct watch *watches) {
    uint64_t source_id = 0;
    if (exec == NULL || node == NULL || p == NULL || cupti_graph.GetGraphNodeId == NULL ||
        cupti_graph.GetGraphNodeId(node, &source_id) != CUPTI_SUCCESS)
        return;
    const char *name = kernel_name(p);
    struct watch *w = watch_match(watches, nwatch, name);
    struct graph_watch fresh = {0};
    char err[256] = "";
    int ok = 0;
    if (w != NULL && p->kernelParams != NULL) {
        struct launch_geom g = {{p->gridDimX, p->gridDimY, p->gridDimZ}, {p->blockDimX, p->blockDimY, p->blockDimZ},
                                p->kernelParams, p->func};
        ok = watch_eval(w, &g, fresh.shape, &fresh.bytes, &fresh.src, err, sizeof err) == 0;
    }
    int found = 0;
    pthread_mutex_lock(&g_mu);
    struct graph_exec_entry *e = find(exec);
    for (int j = 0; e != NULL && j < e->n; j++) {
        struct graph_watch *gw = &e->nodes[j];
        if (gw->source_node_id != source_id) continue;
        found = 1;
        if (ok) {
            gw->w = w, gw->src = fresh.src, gw->bytes = fresh.bytes;
            memcpy(gw->shape, fresh.shape, sizeof gw->shape);
            snprintf(gw->name, sizeof gw->name, "%s", name);
        } else { /* no longer watched, or its rule cannot be evaluated: no copy */
            e->nodes[j] = e->nodes[--e->n];
        }
        break;
    }
    pthread_mutex_unlock(&g_mu);
    if (w != NULL && !ok) {
        ring_count(CTR_BUFFERS_FAILED, 1);
        report_error(ERRK_WATCH_PARAM, -1, "watched graph node %s after cuGraphExecKernelNodeSetParams: %s",
                     w->pattern, p->kernelParams == NULL ? "arguments through `extra`" : err);
    } else if (w != NULL && !found) {
        report_error(ERRK_GRAPH_TABLE, -1, "a graph node became watched through cuGraphExecKernelNodeSetParams "
                     "(%s): not copied", w->pattern);
    }
}

/* After a successful launch of `exec` on `stream`: one staging copy per watched node, in node order,
 * behind the graph's work on the same stream. */
HIDDEN void graph_launched(CUgraphExec exec, CUstream stream, CUcontext ctx, uint32_t correlation_id,
                           uint64_t launch_ns) {
    struct graph_watch local[32];
    int n = 0;
    uint32_t graph_id = 0;
    int more = 0;
    pthread_mutex_lock(&g_mu);
    struct graph_exec_entry *e = find(exec);
    if (e != NULL) {
        n = e->n < 32 ? e->n : 32;
        more = e->n - n;
        memcpy(local, e->nodes, (size_t)n * sizeof local[0]);
        graph_id = e->graph_id;
    }
    pthread_mutex_unlock(&g_mu);
    if (more > 0) {
        ring_count(CTR_BUFFERS_FAILED, (uint64_t)more);
        report_error(ERRK_GRAPH_TABLE, -1, "a graph with more than 32 watched kernel nodes: the rest are not copied");
    }
    uint32_t tid = current_tid();
    for (int i = 0; i < n; i++) {
        struct graph_watch *g = &local[i];
        if (!watch_admit((struct watch *)g->w, launch_ns, g->bytes)) continue;
        struct staging_request q = {.w = g->w, .kernel_name = g->name, .correlation_id = correlation_id,
                                    .tid = tid, .launch_ns = launch_ns, .src = g->src, .stream = stream,
                                    .ctx = ctx, .bytes = g->bytes, .graph_id = graph_id,
                                    .graph_node_id = g->node_id};
        memcpy(q.shape, g->shape, sizeof q.shape);
        staging_enqueue(&q);
    }
}
