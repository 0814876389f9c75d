/*
 * hostid.h - which host this process runs on, for the data plane: a client
 * and a worker with the same id may share memory. $MOE_HOST_ID when set
 * (a process that must count as on another host, e.g. to try the bulk
 * path on one machine), else the kernel's boot id
 * (/proc/sys/kernel/random/boot_id), else the hostname.
 */
#ifndef MOE_HOSTID_H
#define MOE_HOSTID_H

#include <stddef.h>

/* moe_host_id writes this host's id into out (len bytes, terminated);
 * "unknown" when neither can be read. */
void moe_host_id(char *out, size_t len);

#endif
