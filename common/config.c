/* config.c - the config table; see config.h. */
#include "common/config.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const cfg_entry *find(const cfg_entry *tab, int n, const char *name, size_t len)
{
    for (int i = 0; i < n; i++)
        if (strlen(tab[i].name) == len && memcmp(tab[i].name, name, len) == 0)
            return &tab[i];
    return NULL;
}

static moe_err set_value(const cfg_entry *e, const char *val, const char *src, char *err,
                         size_t errlen)
{
    if (e->type == CFG_STR) {
        if (strlen(val) >= CFG_STR_MAX) {
            snprintf(err, errlen, "%s: %s is longer than %d bytes", src, e->name, CFG_STR_MAX - 1);
            return MOE_EINVAL;
        }
        snprintf((char *)e->ptr, CFG_STR_MAX, "%s", val);
        return MOE_OK;
    }
    if (e->type == CFG_BOOL) {
        int on = !strcmp(val, "1") || !strcmp(val, "true") || !strcmp(val, "yes");
        int off = !strcmp(val, "0") || !strcmp(val, "false") || !strcmp(val, "no");
        if (!on && !off) {
            snprintf(err, errlen, "%s: %s expects 1/0 (true/false), got '%s'", src, e->name, val);
            return MOE_EINVAL;
        }
        *(long long *)e->ptr = on;
        return MOE_OK;
    }
    char *end;
    errno = 0;
    long long v = strtoll(val, &end, 0);
    if (errno || end == val || *end) {
        snprintf(err, errlen, "%s: %s expects an integer, got '%s'", src, e->name, val);
        return MOE_EINVAL;
    }
    if (v < e->min || v > e->max) {
        snprintf(err, errlen, "%s: %s = %lld is outside [%lld, %lld]", src, e->name, v, e->min,
                 e->max);
        return MOE_EINVAL;
    }
    *(long long *)e->ptr = v;
    return MOE_OK;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

static moe_err load_file(const cfg_entry *tab, int n, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    char line[1024], src[300];
    int lineno = 0;
    if (!f) {
        snprintf(err, errlen, "cannot open config file %s: %s", path, strerror(errno));
        return MOE_EIO;
    }
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char *s = trim(line);
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        snprintf(src, sizeof(src), "%s:%d", path, lineno);
        if (!eq) {
            snprintf(err, errlen, "%s: expected 'name = value'", src);
            fclose(f);
            return MOE_EINVAL;
        }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        const cfg_entry *e = find(tab, n, key, strlen(key));
        if (!e) {
            snprintf(err, errlen, "%s: unknown setting '%s'", src, key);
            fclose(f);
            return MOE_EINVAL;
        }
        moe_err rc = set_value(e, val, src, err, errlen);
        if (rc != MOE_OK) {
            fclose(f);
            return rc;
        }
    }
    fclose(f);
    return MOE_OK;
}

moe_err cfg_load(const cfg_entry *tab, int n, int argc, char **argv, const char *env_prefix,
                 char *err, size_t errlen)
{
    moe_err rc;
    const char *config_path = NULL;
    for (int i = 0; i < n; i++)
        if ((rc = set_value(&tab[i], tab[i].def, "default", err, errlen)) != MOE_OK)
            return rc;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--config=", 9) == 0)
            config_path = argv[i] + 9;
        else if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            config_path = argv[i + 1];
    }
    if (config_path && (rc = load_file(tab, n, config_path, err, errlen)) != MOE_OK)
        return rc;
    for (int i = 0; i < n; i++) {
        char env[128];
        int k = snprintf(env, sizeof(env), "%s", env_prefix);
        for (const char *p = tab[i].name; *p && k < (int)sizeof(env) - 1; p++)
            env[k++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
        env[k] = 0;
        const char *v = getenv(env);
        if (v && (rc = set_value(&tab[i], v, env, err, errlen)) != MOE_OK)
            return rc;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s'", a);
            return MOE_EINVAL;
        }
        a += 2;
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        const char *val;
        if (len == 6 && strncmp(a, "config", 6) == 0) {
            if (!eq)
                i++;
            continue;
        }
        const cfg_entry *e = find(tab, n, a, len);
        if (!e) {
            snprintf(err, errlen, "unknown flag --%.*s (see --help)", (int)len, a);
            return MOE_EINVAL;
        }
        if (eq) {
            val = eq + 1;
        } else if (e->type == CFG_BOOL) {
            val = "1"; /* a bare --name switches it on; never takes the next argument */
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            snprintf(err, errlen, "flag --%s needs a value", e->name);
            return MOE_EINVAL;
        }
        if ((rc = set_value(e, val, "flag", err, errlen)) != MOE_OK)
            return rc;
    }
    return MOE_OK;
}

void cfg_print(const cfg_entry *tab, int n, FILE *f)
{
    for (int i = 0; i < n; i++) {
        if (tab[i].type != CFG_STR)
            fprintf(f, "  %-22s = %lld\n", tab[i].name, *(long long *)tab[i].ptr);
        else if ((strstr(tab[i].name, "token") || !strcmp(tab[i].name, "cluster-secret")) &&
                 ((char *)tab[i].ptr)[0])
            fprintf(f, "  %-22s = (set)\n", tab[i].name);
        else
            fprintf(f, "  %-22s = %s\n", tab[i].name, (char *)tab[i].ptr);
    }
}

void cfg_usage(const cfg_entry *tab, int n, FILE *f)
{
    fprintf(f, "  --config PATH            read 'name = value' lines first\n");
    for (int i = 0; i < n; i++)
        fprintf(f, "  --%-22s %s (default %s)\n", tab[i].name, tab[i].help,
                tab[i].def[0] ? tab[i].def : "\"\"");
}
