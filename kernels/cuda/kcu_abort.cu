/* kcu_abort.cu - every ncclCommAbort of the process, timed: see kcu_abort.h */
#include <time.h>

#include <atomic>

#include <nccl.h>

#include "kernels/cuda/kcu_abort.h"

namespace
{

constexpr int ABORT_SLOTS = 32;
/* one slot per running abort: its start (abort_now_ms), 0 when free */
std::atomic<int64_t> abort_started[ABORT_SLOTS];

int64_t abort_now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + 1; /* never 0 */
}

} // namespace

extern "C" void kcu_comm_abort(void *comm)
{
    if (!comm)
        return;
    int slot = -1;
    const int64_t t0 = abort_now_ms();
    for (int i = 0; i < ABORT_SLOTS && slot < 0; i++) {
        int64_t free_slot = 0;
        if (abort_started[i].compare_exchange_strong(free_slot, t0))
            slot = i;
    }
    ncclCommAbort((ncclComm_t)comm);
    if (slot >= 0)
        abort_started[slot].store(0);
}

extern "C" int64_t kcu_abort_stuck_ms(void)
{
    int64_t oldest = 0;
    for (int i = 0; i < ABORT_SLOTS; i++) {
        const int64_t t = abort_started[i].load();
        if (t && (!oldest || t < oldest))
            oldest = t;
    }
    return oldest ? abort_now_ms() - oldest : 0;
}
