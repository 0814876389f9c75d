/* log.c - line logger; see log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

log_level log_min_level = LOG_INFO;
static char log_role[32] = "moe";

void log_init(const char *role, log_level min_level)
{
    snprintf(log_role, sizeof(log_role), "%s", role);
    log_min_level = min_level;
}

int log_level_parse(const char *s)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

void log_write(log_level lvl, uint64_t msgid, const char *fmt, ...)
{
    static const char lvl_ch[] = {'D', 'I', 'W', 'E'};
    char line[1024];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    localtime_r(&tv.tv_sec, &tm);
    int n = snprintf(line, sizeof(line), "%d:%s %02d:%02d:%02d.%03d %c %llu ", (int)getpid(),
                     log_role, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000),
                     lvl_ch[lvl & 3], (unsigned long long)msgid);
    va_list ap;
    va_start(ap, fmt);
    if (n < (int)sizeof(line))
        n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}
