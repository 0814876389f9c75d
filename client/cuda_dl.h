/* cuda_dl.h - the CUDA runtime and NCCL functions libmoe's NCCL path calls,
 * found at run time (dlopen), never linked.
 *
 * libmoe must load in any process: on a host without a GPU, beside a
 * PyTorch that brings its own NCCL and CUDA runtime (linking libnccl.so.2
 * into libmoe made `import torch` after `import moe` fail with "undefined
 * symbol: ncclCommResume": torch's libraries bound to the NCCL libmoe had
 * loaded first). So nothing here is linked: moe_cudl_get finds the
 * libraries when the NCCL path is first used - those already in the process
 * when there are (the application's own CUDA runtime, torch's NCCL), else
 * the system's.
 *
 * Only built with MOE_HAVE_CUDA (the CUDA headers give the types). */
#ifndef MOE_CUDA_DL_H
#define MOE_CUDA_DL_H

#ifdef MOE_HAVE_CUDA
#include <stddef.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

/* one pointer per function, named as the function */
typedef struct moe_cudl {
    __typeof__(&cudaGetLastError) cudaGetLastError;
    __typeof__(&cudaGetErrorString) cudaGetErrorString;
    __typeof__(&cudaGetDevice) cudaGetDevice;
    __typeof__(&cudaSetDevice) cudaSetDevice;
    __typeof__(&cudaPointerGetAttributes) cudaPointerGetAttributes;
    __typeof__(&cudaStreamCreateWithFlags) cudaStreamCreateWithFlags;
    __typeof__(&cudaStreamDestroy) cudaStreamDestroy;
    __typeof__(&cudaStreamQuery) cudaStreamQuery;
    __typeof__(&cudaStreamSynchronize) cudaStreamSynchronize;
    __typeof__(&cudaMalloc) cudaMalloc;
    __typeof__(&cudaFree) cudaFree;
    __typeof__(&cudaMemcpy) cudaMemcpy;
    __typeof__(&cudaMemcpyAsync) cudaMemcpyAsync;
    __typeof__(&ncclGetVersion) ncclGetVersion;
    __typeof__(&ncclGetUniqueId) ncclGetUniqueId;
    __typeof__(&ncclCommInitRankConfig) ncclCommInitRankConfig;
    __typeof__(&ncclCommGetAsyncError) ncclCommGetAsyncError;
    __typeof__(&ncclCommAbort) ncclCommAbort;
    __typeof__(&ncclCommDestroy) ncclCommDestroy;
    __typeof__(&ncclGetErrorString) ncclGetErrorString;
    __typeof__(&ncclGetLastError) ncclGetLastError;
    __typeof__(&ncclSend) ncclSend;
    __typeof__(&ncclRecv) ncclRecv;
    __typeof__(&ncclGroupStart) ncclGroupStart;
    __typeof__(&ncclGroupEnd) ncclGroupEnd;
} moe_cudl;

/* moe_cudl_get: the functions, or NULL with why in err. load 0: a CUDA
 * runtime already in this process, or NULL (nothing is loaded: a process
 * without one holds no device memory); only the cuda* pointers may be used
 * then. load 1: the CUDA runtime and NCCL, loaded if not yet there (once
 * per process; the handles stay open); every pointer is set. Thread-safe. */
const moe_cudl *moe_cudl_get(int load, char *err, size_t errlen);

#endif
#endif
