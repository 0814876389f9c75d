/* mp_err.c - mp_errbuf helpers: the reason that travels with a moe_err. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "proto/proto.h"

moe_err mp_errf(mp_errbuf *eb, moe_err err, const char *fmt, ...)
{
    if (eb) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(eb->msg, sizeof(eb->msg), fmt, ap);
        va_end(ap);
    }
    return err;
}

void mp_err_prefix(mp_errbuf *eb, const char *fmt, ...)
{
    if (!eb)
        return;
    char old[sizeof(eb->msg)];
    memcpy(old, eb->msg, sizeof(old));
    old[sizeof(old) - 1] = '\0';
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(eb->msg, sizeof(eb->msg), fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n < sizeof(eb->msg))
        snprintf(eb->msg + n, sizeof(eb->msg) - (size_t)n, "%s", old);
}
