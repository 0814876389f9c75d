/*
 * sdnotify.h - the daemons' side of systemd's notification protocol
 * (Type=notify), without libsystemd: a datagram "READY=1", "WATCHDOG=1",
 * "STOPPING=1" or "STATUS=..." sent to the unix socket named by
 * $NOTIFY_SOCKET (a path, or an abstract name when it starts with '@').
 * Without $NOTIFY_SOCKET every call does nothing and succeeds.
 *
 * A daemon keeps one sdn and calls sdn_tick from its event loop: READY=1
 * once when it first becomes ready, STOPPING=1 once when it starts to stop,
 * and WATCHDOG=1 every half $WATCHDOG_USEC when the service manager set it
 * (for this process: $WATCHDOG_PID unset or ours).
 */
#ifndef MOE_SDNOTIFY_H
#define MOE_SDNOTIFY_H

#include <stdint.h>

#include "base/moe.h"

typedef struct sdn {
    uint64_t watchdog_ns; /* $WATCHDOG_USEC in ns; 0 = no watchdog */
    uint64_t last_watchdog_ns;
    int ready_sent;
    int stopping_sent;
} sdn;

/* sdn_send sends one message (e.g. "READY=1") to $NOTIFY_SOCKET; MOE_OK when
 * it was sent or no socket is set, MOE_EINVAL for a bad socket name,
 * MOE_EIO when the send failed. */
moe_err sdn_send(const char *msg);

/* sdn_init reads $WATCHDOG_USEC and $WATCHDOG_PID. */
void sdn_init(sdn *s);

/* sdn_period_ms: how often sdn_tick must run for the watchdog (a quarter of
 * $WATCHDOG_USEC, at least 1 ms); 0 when there is no watchdog. */
uint64_t sdn_period_ms(const sdn *s);

/* sdn_tick sends what the daemon's state calls for: READY=1 (with status,
 * when not NULL, as STATUS=) the first time ready is set, STOPPING=1 the
 * first time stopping is set, WATCHDOG=1 when half the watchdog interval
 * passed since the last one (now_ns: CLOCK_MONOTONIC). */
void sdn_tick(sdn *s, int ready, int stopping, const char *status, uint64_t now_ns);

#endif
