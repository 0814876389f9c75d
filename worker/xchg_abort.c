/* xchg_abort.c - "a member of this generation is gone": collectives stop
 * waiting at once; see xchg.h (xchg_request_abort). */
#include <stdatomic.h>

#include "rpc/rpcsrv.h"
#include "worker/xchg.h"

static _Atomic uint64_t cur_gen;   /* the generation this worker is in (0 = none) */
static _Atomic uint64_t abort_gen; /* the last generation the coordinator gave up */
static _Atomic uint64_t abort_ns;  /* when (rpc_now_ns), 0 = never */

void xchg_set_generation(uint64_t gen)
{
    atomic_store(&cur_gen, gen);
}

uint64_t xchg_generation(void)
{
    return atomic_load(&cur_gen);
}

void xchg_request_abort(uint64_t gen)
{
    atomic_store(&abort_ns, rpc_now_ns());
    atomic_store(&abort_gen, gen);
}

uint64_t xchg_abort_requested_ns(void)
{
    return xchg_aborted() ? atomic_load(&abort_ns) : 0;
}

int xchg_abort_requested(uint64_t gen)
{
    return gen && atomic_load(&abort_gen) == gen;
}

int xchg_aborted(void)
{
    return xchg_abort_requested(atomic_load(&cur_gen));
}
