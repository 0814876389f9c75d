/*
 * config.h - one config table drives defaults, a config file, the environment
 * and command-line flags (later sources win, in that order). Each entry
 * names its type, default and bounds; the effective config is printed at start.
 *
 *   file:  "name = value" lines, '#' comments       (--config PATH)
 *   env:   <PREFIX><NAME upper-cased, '-' -> '_'>    (e.g. MOE_LISTEN)
 *   flags: --name=value or --name value
 */
#ifndef MOE_CONFIG_H
#define MOE_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#include "base/moe.h"

/* CFG_BOOL: a long long 0/1; a bare --name sets it (--name=0 clears it) */
typedef enum cfg_type { CFG_STR, CFG_INT, CFG_BOOL } cfg_type;

#define CFG_STR_MAX 256

typedef struct cfg_entry {
    const char *name;
    cfg_type type;
    const char *def;    /* default, as text */
    long long min, max; /* bounds for CFG_INT */
    void *ptr;          /* CFG_STR: char[CFG_STR_MAX]; CFG_INT, CFG_BOOL: long long */
    const char *help;
} cfg_entry;

/* cfg_load fills every entry's ptr. Unknown flags/keys, bad numbers and
 * out-of-bound values are errors (MOE_EINVAL, reason in err). */
moe_err cfg_load(const cfg_entry *tab, int n, int argc, char **argv, const char *env_prefix,
                 char *err, size_t errlen);
/* cfg_print writes "name = value" for every entry (secrets - *token*,
 * cluster-secret - are masked). */
void cfg_print(const cfg_entry *tab, int n, FILE *f);
/* cfg_usage writes the flag list with defaults and help. */
void cfg_usage(const cfg_entry *tab, int n, FILE *f);

#endif
