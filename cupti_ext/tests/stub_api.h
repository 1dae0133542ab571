/* Test hooks of the stub libcupti / libcuda (cupti_ext/tests), used by driver.c. */
#ifndef SPARSEETY_STUB_API_H
#define SPARSEETY_STUB_API_H
#include <stddef.h>
#include <stdint.h>

/* In tests a CUfunction points to one of these. `body` (may be NULL) is what the "device" runs
 * for a launch through the stub's cuLaunchKernel or a graph replay: it gets the argument pointers,
 * as a kernel gets its arguments. */
struct stub_func {
    const char *name;
    int nparams;
    size_t sizes[16]; /* the stub's own launches and graph nodes copy at most 8 */
    void (*body)(void **params);
};

/* The stub libcuda's CUgraph / CUgraphExec and CUgraphNode objects start with their CUPTI ids,
 * which the stub libcupti's cuptiGetGraphId / cuptiGetGraphExecId / cuptiGetGraphNodeId read. */
struct stub_graph_ids {
    uint32_t id;
};
struct stub_node_ids {
    uint64_t id;
};

/* Fire the enter and exit callbacks of one API call if the subscriber enabled that CBID.
 * Returns 1 when fired. `retval` is the call's return code seen at exit. */
int stub_cupti_call(int domain, int cbid, const void *params, const char *symbol, uint32_t corr, void *ctx,
                    int retval);
/* Hand `bytes` of activity records to the library as one completed buffer; 0 (nothing done)
 * while no buffer callbacks are registered. */
int stub_cupti_deliver(const void *records, size_t bytes, size_t dropped);
/* The registered timestamp callback's value, 0 when none. */
uint64_t stub_cupti_timestamp(void);
/* Calls made so far, ';'-separated: subscribe, timestamp, register, enable:<kind>, cb:<dom>:<cbid>, flush:<flag>. */
const char *stub_cupti_log(void);
int stub_cupti_flushes(void);

/* One callback site (CUPTI_API_ENTER / _EXIT) of an API call the stub libcuda makes itself;
 * `scratch` is the call's correlationData, shared by its two sites. */
void stub_cupti_api(int domain, int cbid, const void *params, const char *symbol, uint32_t corr, void *ctx,
                    int site, int retval, uint64_t *scratch);
/* A resource callback (CUPTI_CB_DOMAIN_RESOURCE) with CUpti_GraphData as its descriptor. */
void stub_cupti_resource(int cbid, void *ctx, const void *graph_data);
uint32_t stub_cupti_next_correlation(void);
/* The stub device ran a kernel: a CONCURRENT_KERNEL record for the next cuptiActivityFlushAll. */
void stub_cupti_kernel_ran(const char *name, uint32_t corr, uint64_t start, uint64_t end, uint32_t graph_id,
                           uint64_t node_id);

/* The stub device (cuda_stub.c): what runs now (inside a kernel body), and what the library did. */
void stub_cuda_current_kernel(uint32_t *corr, uint64_t *graph_node_id);
void stub_cuda_device_idle(void); /* the "engine" waits for its device without a CUDA call */
int stub_cuda_syncs(void);        /* cuStreamSynchronize + cuCtxSynchronize + cuEventSynchronize calls */
int stub_cuda_capture_violations(void); /* copies/events/allocations made on a capturing stream */
int stub_cuda_copies(void);
int stub_cuda_host_allocs(void);
#endif
