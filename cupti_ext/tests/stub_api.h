/* Test hooks of the stub libcupti / libcuda (cupti_ext/tests), used by driver.c. */
#ifndef SPARSEETY_STUB_API_H
#define SPARSEETY_STUB_API_H
#include <stddef.h>
#include <stdint.h>

/* In tests a CUfunction points to one of these. */
struct stub_func {
    const char *name;
    int nparams;
    size_t sizes[8];
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

int stub_cuda_copies(void);
int stub_cuda_host_allocs(void);
#endif
