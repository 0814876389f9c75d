/*
 * json.h - a small strict JSON reader (for safetensors headers and index
 * files) and helpers to write JSON. The parser builds a tree in one arena
 * owned by the json_doc; nesting depth and sizes are capped.
 */
#ifndef MOE_JSON_H
#define MOE_JSON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/moe.h"

typedef enum json_type { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } json_type;

typedef struct json_node {
    json_type type;
    double num;             /* J_NUM; J_BOOL: 0/1 */
    char *str;              /* J_STR: NUL-terminated, unescaped; J_OBJ member: key */
    size_t len;             /* J_STR length; J_ARR/J_OBJ: number of children */
    struct json_node *kids; /* J_ARR/J_OBJ children (object members carry .key) */
    char *key;              /* set on object members */
} json_node;

typedef struct json_doc json_doc;

/* json_parse parses text (len bytes). *root points into the doc. The doc is
 * owned by the caller (json_free). Errors: MOE_EINVAL with a reason. */
moe_err json_parse(const char *text, size_t len, json_doc **doc, json_node **root, char *err,
                   size_t errlen);
void json_free(json_doc *doc);
/* json_get returns the member `key` of an object, or NULL. */
const json_node *json_get(const json_node *obj, const char *key);
/* json_write_str writes s as a JSON string literal (escaped) to f. */
void json_write_str(FILE *f, const char *s);

#endif
