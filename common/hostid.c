/* hostid.c - this host's id; see hostid.h. */
#include "common/hostid.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void moe_host_id(char *out, size_t len)
{
    if (!len)
        return;
    const char *env = getenv("MOE_HOST_ID"); /* another host as far as the data plane knows */
    if (env && env[0]) {
        snprintf(out, len, "%s", env);
        return;
    }
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    out[0] = 0;
    if (f) {
        if (!fgets(out, (int)len, f))
            out[0] = 0;
        fclose(f);
    }
    out[strcspn(out, "\n")] = 0;
    if (!out[0] && gethostname(out, len) != 0)
        snprintf(out, len, "unknown");
    out[len - 1] = 0;
}
