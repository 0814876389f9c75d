/*
 * log.h - one line per event: "pid:role time level msgid message".
 * The level is checked before any formatting (MOE_LOG macro).
 */
#ifndef MOE_LOG_H
#define MOE_LOG_H

#include <stdint.h>

typedef enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3 } log_level;

extern log_level log_min_level; /* read-only outside log.c; set by log_init */

/* log_init sets the role letter-word ("coord", "worker3", "test") and the
 * minimum level. Not thread safe; call once from main. */
void log_init(const char *role, log_level min_level);
/* log_level_parse maps "debug|info|warn|error"; returns -1 if unknown. */
int log_level_parse(const char *s);
/* log_write formats and writes one line to stderr (thread safe: one write). */
void log_write(log_level lvl, uint64_t msgid, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define MOE_LOG(lvl, msgid, ...)                                                                   \
    do {                                                                                           \
        if ((lvl) >= log_min_level)                                                                \
            log_write((lvl), (msgid), __VA_ARGS__);                                                \
    } while (0)
#define LOG_D(...) MOE_LOG(LOG_DEBUG, 0, __VA_ARGS__)
#define LOG_I(...) MOE_LOG(LOG_INFO, 0, __VA_ARGS__)
#define LOG_W(...) MOE_LOG(LOG_WARN, 0, __VA_ARGS__)
#define LOG_E(...) MOE_LOG(LOG_ERROR, 0, __VA_ARGS__)

#endif
