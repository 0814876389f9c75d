/* act.c - the activation table (names and gating); see act.h. */
#include "common/act.h"

#include <stdio.h>
#include <string.h>

const act_row act_rows[ACT_COUNT] = {
    [ACT_SWIGLU] = {"swiglu", 1},
    [ACT_GELU] = {"gelu", 0},
};

int act_valid(int act)
{
    return act >= 0 && act < ACT_COUNT;
}

const char *act_name(int act)
{
    return act_valid(act) ? act_rows[act].name : "?";
}

int act_gated(int act)
{
    return act_valid(act) && act_rows[act].gated;
}

int act_parse(const char *name)
{
    if (!name)
        return -1;
    for (int i = 0; i < ACT_COUNT; i++)
        if (strcmp(name, act_rows[i].name) == 0)
            return i;
    return -1;
}

char *act_names(char *buf, size_t len)
{
    size_t used = 0;
    if (len == 0)
        return buf;
    buf[0] = 0;
    for (int i = 0; i < ACT_COUNT && used < len; i++) {
        int n = snprintf(buf + used, len - used, "%s\"%s\"", i ? ", " : "", act_rows[i].name);
        if (n < 0)
            break;
        used += (size_t)n;
    }
    return buf;
}
