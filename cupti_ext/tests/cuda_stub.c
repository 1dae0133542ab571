/* A stand-in libcuda for tests without a GPU. "Device pointers" are host addresses, copies are
 * plain memcpy, and an event reports CUDA_ERROR_NOT_READY for its first STUB_CUDA_EVENT_DELAY
 * queries (default 2) so the library's polling path runs. Like the real driver, the copy fires
 * the CUPTI driver callback for cuMemcpyDtoHAsync_v2 (re-entrancy of the library's own copies). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cupti.h>

#include "stub_api.h"

#define API __attribute__((visibility("default")))

struct stub_event {
    int pending;
};
static int copies, host_allocs;

API CUresult cuMemAllocHost_v2(void **pp, size_t n) {
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
    memcpy(dst, (const void *)(uintptr_t)src, n);
    int k = __atomic_add_fetch(&copies, 1, __ATOMIC_RELAXED);
    cuMemcpyDtoHAsync_v2_params p = {dst, src, n, s};
    stub_cupti_call(CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2, &p, NULL,
                    900000u + (uint32_t)k, NULL, 0);
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent *ev, unsigned int flags) {
    (void)flags;
    struct stub_event *e = calloc(1, sizeof *e);
    if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *ev = (CUevent)e;
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent ev, CUstream s) {
    (void)s;
    const char *d = getenv("STUB_CUDA_EVENT_DELAY");
    __atomic_store_n(&((struct stub_event *)ev)->pending, d ? atoi(d) : 2, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

API CUresult cuEventQuery(CUevent ev) {
    struct stub_event *e = (struct stub_event *)ev;
    if (__atomic_load_n(&e->pending, __ATOMIC_ACQUIRE) > 0) {
        __atomic_fetch_sub(&e->pending, 1, __ATOMIC_ACQ_REL);
        return CUDA_ERROR_NOT_READY;
    }
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

API int stub_cuda_copies(void) { return __atomic_load_n(&copies, __ATOMIC_RELAXED); }
API int stub_cuda_host_allocs(void) { return __atomic_load_n(&host_allocs, __ATOMIC_RELAXED); }
