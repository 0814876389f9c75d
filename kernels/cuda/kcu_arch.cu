/*
 * kcu_arch.cu - which kernel image runs on the current device, and whether
 * launches take programmatic dependent launch (PDL).
 *
 * The library carries two images (Makefile, NVCC_GENCODE): sm_90a for Hopper
 * (wgmma, TMA, clusters, PDL) and a portable one - sm_80 code plus compute_80
 * PTX, which the driver compiles for any newer GPU that has no code of its
 * own (mma.sync GEMMs, no PDL). The driver loads the best image for the
 * device; the dispatch (kcu_gemm_version, kcu_pdl_on) must then only pick
 * kernels that image really has: the Hopper-only ones are empty elsewhere.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/kcu_internal.cuh"

namespace
{

/* never launched: its attributes say which image the driver loaded */
__global__ void k_arch_probe(int *)
{
}

enum { ARCH_MAX_DEV = 64 };
int g_arch[ARCH_MAX_DEV]; /* per device: 0 not probed yet, 1 portable, 2 sm_90a */
int g_arch_forced = -1;   /* KCU_ARCH=portable: 1 */
int g_pdl = -1;           /* -1 unknown, 0 off, 1 on */

} // namespace

int kcu_sm90(void)
{
    if (g_arch_forced < 0) {
        const char *s = getenv("KCU_ARCH");
        g_arch_forced = s && !strcmp(s, "portable");
    }
    if (g_arch_forced)
        return 0;
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= ARCH_MAX_DEV) {
        (void)cudaGetLastError();
        return 0;
    }
    if (!g_arch[d]) { /* a race between threads writes the same value */
        cudaFuncAttributes fa;
        int v = 1;
        if (cudaFuncGetAttributes(&fa, k_arch_probe) == cudaSuccess)
            v = fa.ptxVersion >= 90 && fa.binaryVersion >= 90 ? 2 : 1;
        else
            (void)cudaGetLastError();
        g_arch[d] = v;
    }
    return g_arch[d] == 2;
}

extern "C" const char *kcu_arch_name(void)
{
    return kcu_sm90() ? "sm_90a kernels (wgmma, TMA)" : "portable kernels (mma.sync)";
}

extern "C" int kcu_arch_image(int *ptx, int *binary)
{
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, k_arch_probe) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    *ptx = fa.ptxVersion;
    *binary = fa.binaryVersion;
    return 0;
}

int kcu_pdl_on(void)
{
    return kcu_env_flag(&g_pdl, "KCU_PDL", 1) && kcu_sm90();
}

void kcu_pdl_refused(void)
{
    g_pdl = 0;
}

int kcu_route_pdl(void)
{
    static int on = -1;
    return kcu_env_flag(&on, "KCU_PDL_ROUTE", 1);
}
