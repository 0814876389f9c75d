/*
 * test_cuda_images.c - the CUDA library carries both kernel images (no GPU
 * needed): sm_90a code for Hopper, and the portable image - sm_80 code plus
 * compute_80 PTX - that every other GPU from Ampere on runs (newer ones
 * through the driver's JIT; kernels/cuda/kcu_arch.cu). Without the portable
 * image an A100 or L40S worker would find no kernel to launch. The kernels
 * themselves are checked on a GPU by bin/check-gpu and bin/check-gpu-portable.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef MOE_HAVE_CUDA

#define LIB "build/libmoekern_cuda.a"
/* where cuobjdump is looked for after PATH: the toolkit's bin, and the wheel
 * `make deps` installs beside a toolkit that lacks it (deploy/install-deps.sh) */
#define CUOBJDUMP_PATH "$PATH:/usr/local/cuda/bin:.tools/cuobjdump/nvidia/cu13/bin"

static int have_cuobjdump(void)
{
    return system("export PATH=\"" CUOBJDUMP_PATH "\"; command -v cuobjdump >/dev/null 2>&1") == 0;
}

/* counts the lines of `cuobjdump <flag> LIB` that contain each of the n
 * needles; returns the number of lines read, -1 if cuobjdump did not run */
static int objdump_count(const char *flag, const char **needles, int *counts, int n)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "PATH=\"" CUOBJDUMP_PATH "\" cuobjdump %s %s 2>/dev/null", flag,
             LIB);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    char line[512];
    int lines = 0;
    memset(counts, 0, sizeof(int) * (size_t)n);
    while (fgets(line, sizeof(line), p)) {
        lines++;
        for (int i = 0; i < n; i++)
            counts[i] += strstr(line, needles[i]) != NULL;
    }
    return pclose(p) == 0 ? lines : -1;
}

Test(cuda_images, sm90a_and_portable_in_every_object)
{
    cr_assert_eq(access(LIB, R_OK), 0, "%s not built", LIB);
    cr_assert(have_cuobjdump(),
              "cuobjdump not found (PATH, /usr/local/cuda/bin, .tools/cuobjdump): "
              "`make deps` installs it beside a toolkit that lacks it");
    /* the GEMM's kernel objects (kernels/cuda/gemm/), one member each, and
     * kcu_ffn.o, the expert FFN's GEMMs (host side, kcu_ffn.cuh) */
    const char *elf_needles[] = {".sm_90a.cubin", ".sm_80.cubin",       "mma_sync.o",  "member",
                                 "wgmma.o",       "warp_specialised.o", "clustered.o", "kcu_ffn.o"};
    int elf[8];
    cr_assert_gt(objdump_count("--list-elf", elf_needles, elf, 8), 0,
                 "cuobjdump --list-elf failed");
    const char *ptx_needles[] = {".sm_80.ptx", ".sm_90a.ptx"};
    int ptx[2];
    cr_assert_gt(objdump_count("--list-ptx", ptx_needles, ptx, 2), 0,
                 "cuobjdump --list-ptx failed");
    for (int i = 2; i < 8; i++)
        if (i != 3)
            cr_assert_eq(elf[i], 1, "%s is not in %s", elf_needles[i], LIB);
    cr_assert_gt(elf[0], 0, "no sm_90a code");
    /* each object with device code: one sm_90a cubin, one sm_80 cubin, and
     * the compute_80 PTX the driver compiles for newer GPUs */
    cr_expect_eq(elf[1], elf[0], "%d sm_80 cubins for %d sm_90a ones", elf[1], elf[0]);
    cr_expect_eq(ptx[0], elf[0], "%d compute_80 PTX for %d sm_90a cubins", ptx[0], elf[0]);
    cr_expect_eq(ptx[1], 0, "sm_90a PTX shipped (only its code is needed)");
}

#else

Test(cuda_images, skipped_without_cuda)
{
    cr_skip_test("built without CUDA");
}

#endif
