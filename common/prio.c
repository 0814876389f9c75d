/* prio.c - see prio.h. */
#include "common/prio.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

int prio_set_self(int nice, char *msg, size_t msglen)
{
    /* PRIO_PROCESS with a thread id: that thread alone (Linux) */
    const id_t tid = (id_t)syscall(SYS_gettid);
    if (setpriority(PRIO_PROCESS, tid, nice) != 0) {
        snprintf(msg, msglen, "cannot set nice %d: %s", nice, strerror(errno));
        return -1;
    }
    return 0;
}
