/* A running "CUDA process" for the late-attach tests: it is started WITHOUT the injection
 * library, dlopens the stub libcuda (argv[1], which pulls in the stub libcupti), then loops:
 * sleep, launch one stub kernel through the stub's CUPTI hooks, hand CUPTI its activity record,
 * print a checksum. `sparseety-prof record --late-attach` loads libsparseety_cupti.so into it with
 * ptrace while it runs; tests/test_late_attach.py then checks that the launches after the attach
 * reach the recording and that stdout is byte-equal to a run nobody attached to.
 *   late_target LIBCUDA ITERATIONS PERIOD_MS
 * ITERATIONS 0: until stdin reaches end of file (checked before each iteration), so that a test
 * decides when it ends (after its recorders attached), however slowly they start.
 * PERIOD_MS 0: no sleeping and no launches, only arithmetic kept in registers (general purpose and
 * vector) between the prints, so that a thread stopped by ptrace is almost always in user code.
 * stdout: "ready <pid>", then per iteration "i checksum" (deterministic, from values kept in
 * callee-saved registers and the stack across the sleep, where the attach stops the thread);
 * stderr: per iteration "launch i <corr> <kernel name> <1 if CUPTI saw it>". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>
#include <cupti.h>

#include "stub_api.h"

static const char *const NAMES[3] = {"late_gemm_kernel", "late_topk_kernel", "late_norm_kernel"};

static uint64_t mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int spin(int n) {
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    uint64_t a = 88172645463325252ull, b = 0;
    double x = 1.0, y = 0.5, z = 0.25, w = 0.125;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < 4000000; j++) { /* xorshift and a few dependent FP chains */
            a ^= a << 13, a ^= a >> 7, a ^= a << 17;
            b += a >> 60;
            x = x * 0.9999999 + 1e-7, y = y * 0.9999998 + x * 1e-8;
            z = z * 0.9999997 + y * 1e-8, w = w * 0.9999996 + z * 1e-8;
        }
        printf("%d %016llx %llu %.17g %.17g %.17g %.17g\n", i, (unsigned long long)a, (unsigned long long)b, x, y, z,
               w);
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: late_target LIBCUDA ITERATIONS PERIOD_MS\n");
        return 2;
    }
    void *cuda = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (cuda == NULL) {
        fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
        return 3;
    }
    int (*call)(int, int, const void *, const char *, uint32_t, void *, int) =
        (int (*)(int, int, const void *, const char *, uint32_t, void *, int))dlsym(cuda, "stub_cupti_call");
    int (*deliver)(const void *, size_t, size_t) = (int (*)(const void *, size_t, size_t))dlsym(cuda, "stub_cupti_deliver");
    if (call == NULL || deliver == NULL) {
        fprintf(stderr, "the stub hooks are missing from %s\n", argv[1]);
        return 3;
    }
    int n = atoi(argv[2]);
    if (atoi(argv[3]) == 0) return spin(n);
    struct timespec period = {0, (long)atoi(argv[3]) * 1000000L};
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    uint64_t sum = 1469598103934665603ull; /* FNV-1a over the iterations */
    double acc = 1.0;
    for (int i = 0; n == 0 || i < n; i++) {
        struct pollfd in = {0, POLLIN, 0};
        char c;
        if (n == 0 && poll(&in, 1, 0) == 1 && read(0, &c, 1) <= 0) break;
        nanosleep(&period, NULL);
        uint32_t corr = 1000u + (uint32_t)i;
        const char *name = NAMES[i % 3];
        struct stub_func f = {name, 0, {0}, NULL};
        cuLaunchKernel_params p = {(CUfunction)(void *)&f, 4, 1, 1, 64, 1, 1, 0, NULL, NULL, NULL};
        int seen = call(CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, &p, name, corr,
                        (void *)0x1, 0);
        CUpti_ActivityKernel10 k;
        memset(&k, 0, sizeof k);
        uint64_t t = mono();
        k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        k.correlationId = corr;
        k.name = name;
        k.start = t;
        k.end = t + 1000;
        k.contextId = 1;
        k.streamId = 7;
        k.gridX = 4, k.gridY = 1, k.gridZ = 1;
        k.blockX = 64, k.blockY = 1, k.blockZ = 1;
        if (seen) deliver(&k, sizeof k, 0);
        acc = acc * 1.000001 + (double)i / 7.0;
        sum = (sum ^ (uint64_t)i ^ (uint64_t)(acc * 1000.0)) * 1099511628211ull;
        printf("%d %016llx\n", i, (unsigned long long)sum);
        fflush(stdout);
        fprintf(stderr, "launch %d %u %s %d\n", i, corr, name, seen);
    }
    return 0;
}
