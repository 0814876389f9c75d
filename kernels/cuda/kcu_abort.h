/*
 * kcu_abort.h - every ncclCommAbort of the process, timed.
 *
 * ncclCommAbort can hang for good: a copy-engine exchange (kcu_ep's CE
 * communicator) that waits on a peer that died can leave a stream wait that
 * no abort releases, and then every free on the device (each abort frees)
 * waits behind it. Every abort in the worker and in kcu_ep goes through
 * kcu_comm_abort, which times it; kcu_abort_stuck_ms says how long the
 * oldest abort still running has run, so that the worker can give the
 * device up (exit for its supervisor to restart it, --abort-exit-ms) seconds
 * after an abort hangs. Thread-safe, no locks: a fixed table of start times.
 */
#ifndef MOE_KCU_ABORT_H
#define MOE_KCU_ABORT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* kcu_comm_abort: ncclCommAbort(comm) (comm: an ncclComm_t; NULL does
 * nothing), timed while it runs */
void kcu_comm_abort(void *comm);
/* kcu_abort_stuck_ms: how long the oldest kcu_comm_abort still running has
 * run, ms (0: none running; more than 32 at once: the extra go untimed) */
int64_t kcu_abort_stuck_ms(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_KCU_ABORT_H */
