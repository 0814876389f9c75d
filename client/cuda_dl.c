/* cuda_dl.c - the CUDA runtime and NCCL found at run time; see cuda_dl.h. */
#include "client/cuda_dl.h"

#ifdef MOE_HAVE_CUDA
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* sonames first (an application's own or the system's), then the toolkit's
 * usual place */
static const char *const k_rt_names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
                                         "/usr/local/cuda/lib64/libcudart.so.13"};
static const char *const k_nccl_names[] = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static moe_cudl g_fn;    /* filled once, then read-only */
static int g_rt_state;   /* 0 not tried, 1 runtime found, -1 looked and loaded nothing */
static int g_nccl_state; /* 0 not tried, 1 NCCL found, -1 failed (g_why says why) */
static char g_why[256];

/* open_first: the first of names that dlopen finds (flags RTLD_NOLOAD: only
 * if already in the process) */
static void *open_first(const char *const *names, size_t n, int flags)
{
    for (size_t i = 0; i < n; i++) {
        void *h = dlopen(names[i], flags);
        if (h)
            return h;
    }
    return NULL;
}

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))
#define TAKE(h, name)                                                                              \
    do {                                                                                           \
        *(void **)&g_fn.name = dlsym(h, #name);                                                    \
        if (!g_fn.name) {                                                                          \
            snprintf(g_why, sizeof(g_why), "%s not found in the loaded library", #name);           \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

static int take_rt(void *h)
{
    TAKE(h, cudaGetLastError);
    TAKE(h, cudaGetErrorString);
    TAKE(h, cudaGetDevice);
    TAKE(h, cudaSetDevice);
    TAKE(h, cudaPointerGetAttributes);
    TAKE(h, cudaStreamCreateWithFlags);
    TAKE(h, cudaStreamDestroy);
    TAKE(h, cudaStreamQuery);
    TAKE(h, cudaStreamSynchronize);
    TAKE(h, cudaMalloc);
    TAKE(h, cudaFree);
    TAKE(h, cudaMemcpy);
    TAKE(h, cudaMemcpyAsync);
    return 0;
}

static int take_nccl(void *h)
{
    TAKE(h, ncclGetVersion);
    TAKE(h, ncclGetUniqueId);
    TAKE(h, ncclCommInitRankConfig);
    TAKE(h, ncclCommGetAsyncError);
    TAKE(h, ncclCommAbort);
    TAKE(h, ncclCommDestroy);
    TAKE(h, ncclGetErrorString);
    TAKE(h, ncclGetLastError);
    TAKE(h, ncclSend);
    TAKE(h, ncclRecv);
    TAKE(h, ncclGroupStart);
    TAKE(h, ncclGroupEnd);
    return 0;
}

const moe_cudl *moe_cudl_get(int load, char *err, size_t errlen)
{
    pthread_mutex_lock(&g_mu);
    if (g_rt_state <= 0) {
        void *h = open_first(k_rt_names, NELEM(k_rt_names), RTLD_NOW | RTLD_NOLOAD);
        if (!h && load)
            h = open_first(k_rt_names, NELEM(k_rt_names), RTLD_NOW | RTLD_LOCAL);
        if (h && take_rt(h) == 0)
            g_rt_state = 1;
        else if (load) {
            g_rt_state = -1;
            if (!h)
                snprintf(g_why, sizeof(g_why), "no CUDA runtime (libcudart.so.13/.12) to load");
        }
    }
    if (load && g_rt_state == 1 && g_nccl_state == 0) {
        void *h = open_first(k_nccl_names, NELEM(k_nccl_names), RTLD_NOW | RTLD_NOLOAD);
        if (!h)
            h = open_first(k_nccl_names, NELEM(k_nccl_names), RTLD_NOW | RTLD_LOCAL);
        if (!h)
            snprintf(g_why, sizeof(g_why), "no NCCL (libnccl.so.2) to load");
        g_nccl_state = h && take_nccl(h) == 0 ? 1 : -1;
    }
    const int ok = g_rt_state == 1 && (!load || g_nccl_state == 1);
    if (!ok && err)
        snprintf(err, errlen, "%s", g_why[0] ? g_why : "no CUDA runtime in this process");
    pthread_mutex_unlock(&g_mu);
    return ok ? &g_fn : NULL;
}
#endif
