/* Test driver: plays the CUDA driver and an engine against libsparseety_cupti.so and the stubs.
 * Loads the library from CUDA_INJECTION64_PATH and calls InitializeInjection as the driver does,
 * then runs one scenario (argv[1]). tests/test_cupti_ext.py reads the ring and checks it; the
 * data written here follow formulas the test repeats:
 *   driver-API watched launch i (i = 0, 10, 20, ...): int32 topk[4][2], value (i*31 + j*7) % 64
 *   runtime-API watched launch i: int64 ids[grid.x*2 = 6], value i*13 + j */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>
#include <cupti.h>

#include "stub_api.h"

#define N_PER_THREAD 300
#define DRV CUPTI_CB_DOMAIN_DRIVER_API
#define RT CUPTI_CB_DOMAIN_RUNTIME_API

static struct stub_func gemm = {"gemm_kernel_bf16", 3, {8, 8, 4}, NULL};
static struct stub_func topk = {"topk_hist_kernel", 3, {8, 4, 4}, NULL};
static struct stub_func bad = {"bad_kernel", 3, {8, 4, 4}, NULL};
static struct stub_func kernel_handle = {NULL, 0, {0}, NULL}, kernel_handle2 = {NULL, 0, {0}, NULL}; /* CUkernel-like */
static char rt_elementwise, rt_moe; /* host stub addresses of the runtime kernels */
static pthread_barrier_t start_line;

static uint64_t mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int drv_launch_sym(struct stub_func *f, const char *symbol, void **params, uint32_t corr, int retval) {
    cuLaunchKernel_params p = {(CUfunction)(void *)f, 2, 1, 1, 128, 1, 1, 0, NULL, params, NULL};
    return stub_cupti_call(DRV, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, &p, symbol, corr, (void *)0x1, retval);
}

static int drv_launch(struct stub_func *f, void **params, uint32_t corr, int retval) {
    return drv_launch_sym(f, NULL, params, corr, retval);
}

static void watched_drv(int i, uint32_t corr, int retval) {
    static int32_t data[N_PER_THREAD + 1][8]; /* stays valid: the stub copies at enqueue */
    int32_t *ids = data[i];
    for (int j = 0; j < 8; j++) ids[j] = (i * 31 + j * 7) % 64;
    CUdeviceptr dptr = (CUdeviceptr)(uintptr_t)ids;
    int32_t ntok = 4, k = 2;
    void *params[3] = {&dptr, &ntok, &k};
    drv_launch(&topk, params, corr, retval);
}

/* The "engine"'s own step windows, read on its own clock around each STEP_LAUNCHES launches of a
 * thread: step <id> <tid> <t_start> <t_end>. The tests join against these, not against times
 * taken from the ring. */
#define STEP_LAUNCHES 50
static void step_window(int i, int first_id, uint64_t *t0) {
    if (i % STEP_LAUNCHES == 0) *t0 = mono();
    if (i % STEP_LAUNCHES == STEP_LAUNCHES - 1)
        printf("step %d %d %llu %llu\n", first_id + i / STEP_LAUNCHES, (int)gettid(), (unsigned long long)*t0,
               (unsigned long long)mono());
}

static void *driver_thread(void *arg) {
    (void)arg;
    uint64_t t0 = 0;
    pthread_barrier_wait(&start_line);
    for (int i = 0; i < N_PER_THREAD; i++) {
        uint32_t corr = 100000u + (uint32_t)i;
        if (i % STEP_LAUNCHES == 0) step_window(i, 0, &t0);
        if (i % 10 == 0) {
            watched_drv(i, corr, 0);
        } else {
            CUdeviceptr a = 0;
            int32_t n = i;
            void *params[3] = {&a, &a, &n};
            drv_launch(&gemm, params, corr, 0);
        }
        if (i % STEP_LAUNCHES == STEP_LAUNCHES - 1) step_window(i, 0, &t0);
    }
    return NULL;
}

static void *runtime_thread(void *arg) {
    (void)arg;
    static int64_t data[N_PER_THREAD][6];
    uint64_t t0 = 0;
    pthread_barrier_wait(&start_line);
    for (int i = 0; i < N_PER_THREAD; i++) {
        uint32_t corr = 200000u + (uint32_t)i;
        if (i % STEP_LAUNCHES == 0) step_window(i, 100, &t0);
        int watched = i % 10 == 0;
        for (int j = 0; j < 6; j++) data[i][j] = (int64_t)i * 13 + j;
        CUdeviceptr dptr = (CUdeviceptr)(uintptr_t)data[i];
        void *args[1] = {&dptr};
        cudaLaunchKernel_v7000_params p = {watched ? (void *)&rt_moe : (void *)&rt_elementwise,
                                           {3, 1, 1}, {64, 1, 1}, args, 0, NULL};
        const char *sym = watched ? "_ZN4vllm28moe_align_block_size_kernelIlEEvPKT_" : "elementwise_add";
        stub_cupti_call(RT, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, &p, sym, corr, (void *)0x1, 0);
        if (i % STEP_LAUNCHES == STEP_LAUNCHES - 1) step_window(i, 100, &t0);
    }
    return NULL;
}

static CUpti_ActivityKernel10 kernel(uint32_t corr, const char *name, uint64_t start, uint64_t end) {
    CUpti_ActivityKernel10 k;
    memset(&k, 0, sizeof k);
    k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    k.correlationId = corr;
    k.name = name;
    k.start = start;
    k.end = end;
    k.deviceId = 0;
    k.contextId = 1;
    k.streamId = 7;
    k.gridX = 2, k.gridY = 1, k.gridZ = 1;
    k.blockX = 128, k.blockY = 1, k.blockZ = 1;
    k.staticSharedMemory = 1024;
    k.dynamicSharedMemory = 512;
    return k;
}

static void deliver_activity(void) {
    uint8_t buf[4096];
    size_t o = 0;
    uint64_t t = mono();
    CUpti_ActivityKernel10 ks[4] = {
        kernel(100001, "gemm_kernel_bf16", t + 2000, t + 3000),
        kernel(100000, "topk_hist_kernel", t + 1000, t + 1500), /* out of order */
        kernel(100002, "gemm_kernel_bf16", 0, 0),               /* not timed */
        kernel(300000, "graph_node_kernel", t + 5000, t + 6000),
    };
    ks[3].graphId = 77;
    ks[3].graphNodeId = 5;
    for (int i = 0; i < 4; i++) {
        memcpy(buf + o, &ks[i], sizeof ks[i]);
        o += (sizeof ks[i] + 7) & ~(size_t)7;
    }
    CUpti_ActivityMemcpy6 m;
    memset(&m, 0, sizeof m);
    m.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
    m.copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
    m.bytes = 64;
    m.start = t + 4000;
    m.end = t + 4100;
    m.streamId = 7;
    m.correlationId = 300001;
    memcpy(buf + o, &m, sizeof m);
    o += (sizeof m + 7) & ~(size_t)7;
    stub_cupti_deliver(buf, o, 3);
    printf("activity_base %llu\n", (unsigned long long)t);
}

static int scenario_main(void) {
    uint64_t before = mono();
    uint64_t ts = stub_cupti_timestamp();
    uint64_t after = mono();
    printf("timestamp %llu %llu %llu\n", (unsigned long long)before, (unsigned long long)ts,
           (unsigned long long)after);
    pthread_t a, b;
    pthread_barrier_init(&start_line, NULL, 2);
    pthread_create(&a, NULL, driver_thread, NULL);
    pthread_create(&b, NULL, runtime_thread, NULL);
    pthread_join(a, NULL);
    pthread_join(b, NULL);

    uint64_t t0 = mono();
    cuGraphLaunch_params g = {(CUgraphExec)(uintptr_t)77, NULL};
    stub_cupti_call(DRV, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, &g, NULL, 300000, (void *)0x1, 0);
    printf("step 200 %d %llu %llu\n", (int)gettid(), (unsigned long long)t0, (unsigned long long)mono());
    cuMemcpyDtoHAsync_v2_params c = {NULL, 0, 64, NULL};
    stub_cupti_call(DRV, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2, &c, NULL, 300001, (void *)0x1, 0);
    cudaMemcpyAsync_v3020_params h2d = {NULL, NULL, 64, cudaMemcpyHostToDevice, NULL};
    stub_cupti_call(RT, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020, &h2d, NULL, 300002, (void *)0x1, 0);
    cudaMemcpyAsync_v3020_params d2h = {NULL, NULL, 64, cudaMemcpyDeviceToHost, NULL};
    stub_cupti_call(RT, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020, &d2h, NULL, 300003, (void *)0x1, 0);
    watched_drv(N_PER_THREAD, 300004, 1); /* a launch that failed: recorded, nothing copied */
    deliver_activity();
    usleep(50000); /* let the reader thread poll; exit publishes the rest */
    printf("copies %d host_allocs %d\n", stub_cuda_copies(), stub_cuda_host_allocs());
    return 0;
}

static int scenario_limits(void) {
    for (int i = 0; i < 10; i++) watched_drv(i, 100000u + (uint32_t)i, 0);
    CUdeviceptr dptr = 0;
    int32_t n = 1;
    void *params[3] = {&dptr, &n, &n};
    drv_launch(&bad, params, 100100, 0);
    usleep(20000);
    return 0;
}

static int scenario_handles(void) {
    /* Driver launches of CUkernel handles, which cuFuncGetName refuses: CUPTI's symbolName names
     * the kernel (watched, copied); a launch without one is reported once and not copied. */
    static int32_t ids[3][8];
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 8; j++) ids[i][j] = i * 8 + j;
        CUdeviceptr dptr = (CUdeviceptr)(uintptr_t)ids[i];
        int32_t ntok = 4, k = 2;
        void *params[3] = {&dptr, &ntok, &k};
        drv_launch_sym(&kernel_handle, "topk_hist_kernel", params, 400000u + (uint32_t)i, 0);
        drv_launch(&kernel_handle2, params, 400100u + (uint32_t)i, 0);
    }
    usleep(20000);
    return 0;
}

static int scenario_ringfull(void) {
    CUdeviceptr a = 0;
    int32_t n = 0;
    void *params[3] = {&a, &a, &n};
    for (int i = 0; i < 200; i++) drv_launch(&gemm, params, 1000u + (uint32_t)i, 0);
    printf("filled\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) return 1;
    for (int i = 0; i < 20; i++) drv_launch(&gemm, params, 5000u + (uint32_t)i, 0);
    return 0;
}

static int scenario_fail(void) {
    /* cuptiSubscribe refused or the timestamp callback failed: launches must pass unharmed. */
    CUdeviceptr a = 0;
    int32_t n = 0;
    void *params[3] = {&a, &a, &n};
    printf("fired %d\n", drv_launch(&gemm, params, 1, 0));
    uint64_t t = 1700000000000000000ull; /* a CLOCK_REALTIME-like stamp */
    CUpti_ActivityKernel10 k = kernel(1, "gemm_kernel_bf16", t, t + 1000);
    if (strstr(stub_cupti_log(), "register")) stub_cupti_deliver(&k, sizeof k, 0);
    return 0;
}

/* ---- CUDA graphs: an MoE decode step captured once and replayed. The "kernel" topk_graph writes
 * ids[ntok][k] from a step counter it keeps in device memory (so every replay writes other ids)
 * and logs what it wrote, with the correlation id and graph node id it ran under; the test
 * compares each watched copy with that log. */
#define NTOK 4
#define TOPK 2
static pthread_mutex_t wrote_mu = PTHREAD_MUTEX_INITIALIZER;
static char wrote_log[1 << 16];

static void topk_graph_body(void **params) {
    int32_t *ids = (int32_t *)(uintptr_t)*(CUdeviceptr *)params[0];
    int32_t ntok = *(int32_t *)params[1], k = *(int32_t *)params[2];
    int32_t *counter = (int32_t *)(uintptr_t)*(CUdeviceptr *)params[3];
    int32_t step = (*counter)++;
    uint32_t corr;
    uint64_t node;
    stub_cuda_current_kernel(&corr, &node);
    pthread_mutex_lock(&wrote_mu);
    size_t l = strlen(wrote_log);
    l += (size_t)snprintf(wrote_log + l, sizeof wrote_log - l, "wrote %u %llu ", corr, (unsigned long long)node);
    for (int j = 0; j < ntok * k; j++) {
        ids[j] = (step * 17 + j * 5) % 64;
        l += (size_t)snprintf(wrote_log + l, sizeof wrote_log - l, "%d%s", ids[j], j + 1 < ntok * k ? "," : "\n");
    }
    pthread_mutex_unlock(&wrote_mu);
}
static void gemm_graph_body(void **params) { (void)params; }
static struct stub_func topk_graph = {"_ZN4vllm17topk_graph_kernelEPiiiS0_", 4, {8, 4, 4, 8}, topk_graph_body};
static struct stub_func gemm_graph = {"gemm_graph_kernel", 1, {8}, gemm_graph_body};

/* One decode step's work on stream s: router top-k (layer 0), an expert GEMM, router top-k (layer 1). */
static void moe_step(CUstream s, int32_t ids[2][NTOK * TOPK], int32_t counters[2]) {
    int32_t ntok = NTOK, k = TOPK;
    CUdeviceptr x = 0;
    void *gp[1] = {&x};
    for (int layer = 0; layer < 2; layer++) {
        CUdeviceptr d = (CUdeviceptr)(uintptr_t)ids[layer], c = (CUdeviceptr)(uintptr_t)&counters[layer];
        void *params[4] = {&d, &ntok, &k, &c};
        cuLaunchKernel((CUfunction)(void *)&topk_graph, 1, 1, 1, 32, 1, 1, 0, s, params, NULL);
        if (layer == 0) cuLaunchKernel((CUfunction)(void *)&gemm_graph, 1, 1, 1, 32, 1, 1, 0, s, gp, NULL);
    }
}

static CUgraph capture(CUstream s, int32_t ids[2][NTOK * TOPK], int32_t counters[2]) {
    CUgraph g = NULL;
    if (cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL) != CUDA_SUCCESS) abort();
    moe_step(s, ids, counters);
    if (cuStreamEndCapture(s, &g) != CUDA_SUCCESS) abort();
    return g;
}

/* Replays back to back (the host never waits for the device), each inside a host step window the
 * "engine" reads itself: step <n> <tid> <t_start> <t_end>. */
static void replay(CUgraphExec e, CUstream s, int n, int *step) {
    for (int i = 0; i < n; i++) {
        uint64_t t0 = mono();
        if (cuGraphLaunch(e, s) != CUDA_SUCCESS) abort();
        uint64_t t1 = mono();
        printf("step %d %d %llu %llu\n", (*step)++, (int)gettid(), (unsigned long long)t0, (unsigned long long)t1);
    }
}

static int scenario_graphs(void) {
    static int32_t ids_a[2][NTOK * TOPK], ids_b[2][NTOK * TOPK], ids_c[2][NTOK * TOPK], ids_d[NTOK * TOPK];
    static int32_t cnt_a[2] = {0, 1000}, cnt_b[2] = {100, 1100}, cnt_c[2] = {200, 1200}, cnt_d = 300;
    CUstream s;
    cuStreamCreate(&s, 0);
    int step = 0;
    /* An eager step first (step 0), while another stream of this thread is being captured in
     * global mode: the library's one-time pinned allocation (at this first watched launch) must not
     * break that capture. */
    CUstream side;
    cuStreamCreate(&side, 0);
    if (cuStreamBeginCapture_v2(side, CU_STREAM_CAPTURE_MODE_GLOBAL) != CUDA_SUCCESS) abort();
    uint64_t t0 = mono();
    moe_step(s, ids_a, cnt_a);
    printf("step %d %d %llu %llu\n", step++, (int)gettid(), (unsigned long long)t0, (unsigned long long)mono());
    CUgraph empty;
    if (cuStreamEndCapture(side, &empty) != CUDA_SUCCESS) abort();
    cuGraphDestroy(empty);
    /* A: captured, instantiated, the source graph destroyed at once (as torch does), replayed */
    CUgraph ga = capture(s, ids_a, cnt_a);
    CUgraphExec ea;
    cuGraphInstantiateWithFlags(&ea, ga, 0);
    cuGraphDestroy(ga);
    replay(ea, s, 4, &step);
    /* B: captured again with new buffers and instantiated anew; the old executable destroyed */
    CUgraph gb = capture(s, ids_b, cnt_b);
    CUgraphExec eb;
    cuGraphInstantiateWithFlags(&eb, gb, 0);
    cuGraphExecDestroy(ea);
    replay(eb, s, 3, &step);
    /* C: a third capture with new buffers moved into B's executable by cuGraphExecUpdate */
    CUgraph gc = capture(s, ids_c, cnt_c);
    CUgraphExecUpdateResultInfo info;
    if (cuGraphExecUpdate_v2(eb, gc, &info) != CUDA_SUCCESS) abort();
    cuGraphDestroy(gc);
    replay(eb, s, 3, &step);
    /* D: layer 0's node of B's executable gets a new buffer with cuGraphExecKernelNodeSetParams
     * (the node named is the one of the graph B was instantiated from) */
    CUgraphNode nodes[3];
    size_t nn = 3;
    cuGraphGetNodes(gb, nodes, &nn);
    CUDA_KERNEL_NODE_PARAMS kp;
    cuGraphKernelNodeGetParams_v2(nodes[0], &kp);
    int32_t ntok = NTOK, k = TOPK;
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)ids_d, c = (CUdeviceptr)(uintptr_t)&cnt_d;
    void *params[4] = {&d, &ntok, &k, &c};
    kp.kernelParams = params;
    if (cuGraphExecKernelNodeSetParams_v2(eb, nodes[0], &kp) != CUDA_SUCCESS) abort();
    cuGraphDestroy(gb);
    replay(eb, s, 2, &step);
    stub_cuda_device_idle(); /* the engine's own wait, not a CUDA call of the library */
    usleep(50000);
    printf("syncs %d violations %d\n", stub_cuda_syncs(), stub_cuda_capture_violations());
    pthread_mutex_lock(&wrote_mu);
    fputs(wrote_log, stdout);
    pthread_mutex_unlock(&wrote_mu);
    return 0;
}

/* One launch of a kernel named on the command line, as `driver launch SYMBOL GRIDX ARG...`, each
 * ARG `p` (a pointer to the id buffer), `i32:V`, `i64:V` (a size_t) or `b:V` (a bool): the layout
 * of an engine's kernel, to check a watch preset's rule against it. The kernel is launched twice:
 * through cuLaunchKernel (corr 1: the library checks the indices and sizes with
 * cuFuncGetParamInfo) and through cudaLaunchKernel under the same symbol (corr 2: the runtime
 * path of <<<>>> launches, unchecked). The buffer holds bytes (i * 37 + 11) % 256. */
static int scenario_launch(int argc, char **argv) {
    static unsigned char buf[1 << 20];
    static int32_t i32[16];
    static int64_t i64[16];
    static unsigned char b[16];
    if (argc < 4 || argc - 4 > 16) {
        fprintf(stderr, "usage: driver launch SYMBOL GRIDX ARG... (at most 16 ARGs)\n");
        return 2;
    }
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)((i * 37 + 11) % 256);
    CUdeviceptr dptr = (CUdeviceptr)(uintptr_t)buf;
    struct stub_func f = {argv[2], argc - 4, {0}, NULL};
    void *params[16];
    for (int i = 0; i < f.nparams; i++) {
        const char *a = argv[4 + i];
        if (strcmp(a, "p") == 0) {
            params[i] = &dptr, f.sizes[i] = sizeof dptr;
        } else if (strncmp(a, "i32:", 4) == 0) {
            i32[i] = (int32_t)strtol(a + 4, NULL, 10), params[i] = &i32[i], f.sizes[i] = 4;
        } else if (strncmp(a, "i64:", 4) == 0) {
            i64[i] = strtoll(a + 4, NULL, 10), params[i] = &i64[i], f.sizes[i] = 8;
        } else if (strncmp(a, "b:", 2) == 0) {
            b[i] = (unsigned char)atoi(a + 2), params[i] = &b[i], f.sizes[i] = 1;
        } else {
            fprintf(stderr, "driver launch: bad argument '%s'\n", a);
            return 2;
        }
    }
    unsigned gx = (unsigned)strtoul(argv[3], NULL, 10);
    cuLaunchKernel_params p = {(CUfunction)(void *)&f, gx, 1, 1, 128, 1, 1, 0, NULL, params, NULL};
    stub_cupti_call(DRV, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, &p, NULL, 1, (void *)0x1, 0);
    cudaLaunchKernel_v7000_params rp = {(void *)&rt_moe, {gx, 1, 1}, {128, 1, 1}, params, 0, NULL};
    stub_cupti_call(RT, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, &rp, argv[2], 2, (void *)0x1, 0);
    usleep(20000);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: driver main|limits|handles|ringfull|fail|graphs|launch\n");
        return 2;
    }
    const char *path = getenv("CUDA_INJECTION64_PATH");
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "InitializeInjection") : NULL;
    if (init == NULL) {
        fprintf(stderr, "cannot load InitializeInjection from %s: %s\n", path ? path : "(unset)", dlerror());
        return 3;
    }
    printf("init %d\n", init());
    printf("log %s\n", stub_cupti_log());
    fflush(stdout);
    int rc = 2;
    if (strcmp(argv[1], "main") == 0) rc = scenario_main();
    else if (strcmp(argv[1], "limits") == 0) rc = scenario_limits();
    else if (strcmp(argv[1], "handles") == 0) rc = scenario_handles();
    else if (strcmp(argv[1], "ringfull") == 0) rc = scenario_ringfull();
    else if (strcmp(argv[1], "fail") == 0) rc = scenario_fail();
    else if (strcmp(argv[1], "graphs") == 0) rc = scenario_graphs();
    else if (strcmp(argv[1], "launch") == 0) rc = scenario_launch(argc, argv);
    fflush(stdout);
    return rc;
}
