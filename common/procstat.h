/* procstat.h - a process on this host as /proc shows it (Linux), to see a
 * local worker die before its sockets close.
 *
 * A SIGKILLed process tears its memory down before it closes its files
 * (the kernel's exit order), so its peers see its connections drop only
 * after that teardown: 85 ms for a CPU worker holding a training model here,
 * longer with a CUDA context. Its threads are marked exiting (PF_EXITING in
 * /proc/PID/stat's flags) at once, and the leader becomes a zombie as soon
 * as it is done. A coordinator on the same host reads that. */
#ifndef MOE_PROCSTAT_H
#define MOE_PROCSTAT_H

typedef struct procstat {
    char state;                     /* R, S, D, Z, X, ... */
    unsigned long flags;            /* PF_* of the leader thread */
    unsigned long long start_ticks; /* start time since boot (clock ticks): with
                                     * the pid, names one process */
} procstat;

/* procstat_parse reads one /proc/PID/stat line (the command name may hold
 * spaces and parentheses). Returns 0, or -1 when it is not such a line. */
int procstat_parse(const char *line, procstat *out);

/* procstat_read: pid's line (0 = this process). Returns 0, or -1 when no
 * such process is visible (gone, or in a PID namespace not ours). */
int procstat_read(int pid, procstat *out);

/* procstat_dying: the process is exiting (its leader thread exiting or a
 * zombie) */
int procstat_dying(const procstat *p);

#endif
