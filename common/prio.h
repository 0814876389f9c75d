/* prio.h - the control threads of a daemon ahead of compute threads.
 *
 * On a host whose cores the workers' BLAS and AdamW threads fill, the
 * coordinator's loop and a worker's loop (RPC, heartbeats, worker.abort)
 * must not wait for a core: a death is seen and answered when the loop
 * runs. Linux schedules threads by their own nice value, and a thread
 * starts with its creator's; so a daemon raises its priority first thing in
 * main (before nng's, libuv's and its own threads exist) and its compute
 * thread lowers itself back (always allowed). Raising needs CAP_SYS_NICE or
 * an RLIMIT_NICE allowance (systemd's Nice=, root): without it the daemon
 * runs at its usual priority and says so. */
#ifndef MOE_PRIO_H
#define MOE_PRIO_H

#include <stddef.h>

/* prio_set_self sets the calling thread's nice value (-20..19). Returns 0,
 * or -1 with why in msg (the thread keeps its priority). */
int prio_set_self(int nice, char *msg, size_t msglen);

#endif
