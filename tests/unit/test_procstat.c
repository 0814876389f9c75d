/* test_procstat.c - common/procstat.c: /proc/PID/stat lines, whatever the
 * command name holds, and this process as /proc shows it. */
#include <criterion/criterion.h>
#include <unistd.h>

#include "common/procstat.h"

Test(procstat, parses_state_flags_and_start_time)
{
    procstat p;
    const char *plain = "4242 (moe-worker) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 "
                        "9 0 123456789 1000000 500 18446744073709551615 1 1 0 0 0 0 0 0\n";
    cr_assert_eq(procstat_parse(plain, &p), 0);
    cr_assert_eq(p.state, 'S');
    cr_assert_eq(p.flags, 4194560ul);
    cr_assert_eq(p.start_ticks, 123456789ull);
    cr_assert(!procstat_dying(&p));
    /* a name with spaces and parentheses; the leader exiting (PF_EXITING) */
    const char *odd = "7 (a) b (c) d) R 1 7 7 0 -1 4194564 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0\n";
    cr_assert_eq(procstat_parse(odd, &p), 0);
    cr_assert_eq(p.state, 'R');
    cr_assert_eq(p.start_ticks, 77ull);
    cr_assert(procstat_dying(&p), "PF_EXITING (0x4) in the flags");
    const char *zombie = "9 (w) Z 1 9 9 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n";
    cr_assert_eq(procstat_parse(zombie, &p), 0);
    cr_assert(procstat_dying(&p), "a zombie");
    cr_assert_eq(procstat_parse("12 (short) S 1 2 3\n", &p), -1, "too few fields");
    cr_assert_eq(procstat_parse("no parenthesis at all", &p), -1);
    cr_assert_eq(procstat_parse(NULL, &p), -1);
}

Test(procstat, reads_this_process)
{
    procstat self, byid;
    cr_assert_eq(procstat_read(0, &self), 0);
    cr_assert_eq(procstat_read((int)getpid(), &byid), 0);
    cr_assert(self.start_ticks > 0 && self.start_ticks == byid.start_ticks);
    cr_assert(!procstat_dying(&self));
    cr_assert_eq(procstat_read(0x7ffffff0, &byid), -1, "no such process");
}
