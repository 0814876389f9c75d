/* procstat.c - see procstat.h. */
#include "common/procstat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROC_PF_EXITING 0x00000004ul /* linux/sched.h */

int procstat_parse(const char *line, procstat *out)
{
    /* "PID (COMM) STATE PPID PGRP SESSION TTY TPGID FLAGS ... STARTTIME"
     * (field 22); COMM may hold anything, so read from the last ')' */
    const char *p = line ? strrchr(line, ')') : NULL;
    if (!p)
        return -1;
    p++;
    int field = 2; /* the one p ends: COMM */
    procstat s = {0};
    while (*p) {
        while (*p == ' ')
            p++;
        if (!*p || *p == '\n')
            break;
        field++;
        char *end;
        if (field == 3) {
            s.state = *p;
        } else if (field == 9) {
            s.flags = strtoul(p, &end, 10);
            if (end == p)
                return -1;
        } else if (field == 22) {
            s.start_ticks = strtoull(p, &end, 10);
            if (end == p)
                return -1;
            *out = s;
            return s.state ? 0 : -1;
        }
        while (*p && *p != ' ' && *p != '\n')
            p++;
    }
    return -1;
}

int procstat_read(int pid, procstat *out)
{
    char path[64], line[1024];
    if (pid > 0)
        snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    else
        snprintf(path, sizeof(path), "/proc/self/stat");
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char *got = fgets(line, sizeof(line), f);
    fclose(f);
    return got ? procstat_parse(line, out) : -1;
}

int procstat_dying(const procstat *p)
{
    return p->state == 'Z' || p->state == 'X' || (p->flags & PROC_PF_EXITING) != 0;
}
