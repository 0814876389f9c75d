/*
 * test_ep_env.c - the expert-parallel settings' rules (common/ep_env.h),
 * read the same way by the kernels and by the worker's registration: the
 * deduplicated dispatch (KCU_EP_DEDUP: 1 unless set, clamped to 0..2) and
 * the copy-engine exchange (KCU_EP_CE: on unless "0"). The coordinator
 * refuses a worker whose values differ from the running ones', so a change
 * of default here is a change every worker must make together.
 */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "common/ep_env.h"

Test(ep_env, dedup_on_unless_set)
{
    unsetenv("KCU_EP_DEDUP");
    cr_assert_eq(ep_dedup_env(), 1, "unset: inference forwards");
    setenv("KCU_EP_DEDUP", "", 1);
    cr_assert_eq(ep_dedup_env(), 1, "empty: the default");
    setenv("KCU_EP_DEDUP", "0", 1);
    cr_assert_eq(ep_dedup_env(), 0);
    setenv("KCU_EP_DEDUP", "2", 1);
    cr_assert_eq(ep_dedup_env(), 2);
    setenv("KCU_EP_DEDUP", "7", 1);
    cr_assert_eq(ep_dedup_env(), 2, "clamped to 2");
    setenv("KCU_EP_DEDUP", "-3", 1);
    cr_assert_eq(ep_dedup_env(), 0, "clamped to 0");
}

Test(ep_env, copy_engine_exchange_on_unless_zero)
{
    unsetenv("KCU_EP_CE");
    cr_assert_eq(ep_ce_env(), 1, "unset: on (the default since session 24)");
    setenv("KCU_EP_CE", "", 1);
    cr_assert_eq(ep_ce_env(), 1, "empty: the default");
    setenv("KCU_EP_CE", "0", 1);
    cr_assert_eq(ep_ce_env(), 0, "0 turns it off");
    setenv("KCU_EP_CE", "1", 1);
    cr_assert_eq(ep_ce_env(), 1);
    setenv("KCU_EP_CE", "2", 1);
    cr_assert_eq(ep_ce_env(), 1, "any other number: on");
}
