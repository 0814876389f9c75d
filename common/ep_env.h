/*
 * common/ep_env.h - the expert-parallel settings read from the environment,
 * one rule for the kernels (kcu_ep_create, kernels/cuda/kcu_ep.cu) and the
 * worker, which reports them at worker.register: the coordinator refuses a
 * worker whose value differs from the running workers' (the ranks' counts
 * exchange is sized by it). Header only; no state.
 */
#ifndef MOE_COMMON_EP_ENV_H
#define MOE_COMMON_EP_ENV_H

#include <stdlib.h>

/* ep_dedup_env: KCU_EP_DEDUP where set (0 off, 1 inference forwards, 2
 * training forwards too; clamped to 0..2), else 1 */
static inline int ep_dedup_env(void)
{
    const char *s = getenv("KCU_EP_DEDUP");
    int v = s && *s ? atoi(s) : 1;
    return v < 0 ? 0 : v > 2 ? 2 : v;
}

/* ep_ce_env: the copy-engine exchange (kernels/cuda/kcu_ep.h "Copy-engine
 * exchange"): 0 where KCU_EP_CE=0, else 1 (on by default since session 24:
 * bit-identical, Qwen3 on 4 H100s 3.81 ms against 4.49; it falls back by
 * itself where NCCL or the routing cannot take it) */
static inline int ep_ce_env(void)
{
    const char *s = getenv("KCU_EP_CE");
    return s && *s && atoi(s) == 0 ? 0 : 1;
}

#endif
