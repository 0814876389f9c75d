/*
 * kcu_tool.h - abort-on-error checks for the GPU tools (bin/check-gpu and
 * the benchmarks in bench/): on failure print file, line, the call and the
 * error, then exit(2). Not for the library, whose functions return error
 * codes (KCU_CHECK / KCU_TRY in kcu_internal.cuh).
 */
#ifndef MOE_KCU_TOOL_H
#define MOE_KCU_TOOL_H

#include <stdio.h>
#include <stdlib.h>

/* a CUDA runtime call */
#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

/* a moe_err call */
#define CKM(call)                                                                                  \
    do {                                                                                           \
        moe_err r_ = (call);                                                                       \
        if (r_ != MOE_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s failed (moe_err %d)\n", __FILE__, __LINE__, #call,          \
                    (int)r_);                                                                      \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

#endif /* MOE_KCU_TOOL_H */
