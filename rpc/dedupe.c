/* dedupe.c - reply cache keyed by request id; see dedupe.h. */
#include "rpc/dedupe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

typedef enum dd_state { DD_RUNNING, DD_ANSWERED } dd_state;

/* a duplicate waiting for its original; owned by the entry */
typedef struct dd_waiter {
    struct dd_waiter *next;
    rpc_call *call; /* held (unanswered) until the original is answered */
} dd_waiter;

/* dd_entry: one rid. Owned by the dedupe (hash chain + age list). While
 * RUNNING, the original's call carries a pointer to it as its reply hook
 * argument: a RUNNING entry is never freed (eviction takes ANSWERED ones). */
typedef struct dd_entry {
    struct dd_entry *hnext;       /* hash chain */
    struct dd_entry *prev, *next; /* age list of ANSWERED entries, oldest first */
    struct dedupe *d;
    uint64_t client, seq;
    uint32_t msgid;  /* the original's, for the duplicate check */
    char method[24]; /* the original's (mutating names are short) */
    dd_state state;
    uint8_t *reply; /* owned: the reply bytes; NULL = not kept */
    size_t len;     /* reply length (also when not kept, for messages) */
    dd_waiter *waiters;
    int nwaiters;
} dd_entry;

struct dedupe {
    dd_entry **buckets; /* nbuckets chains */
    size_t nbuckets;    /* a power of two >= 2 * max_entries */
    size_t count;       /* entries, RUNNING and ANSWERED */
    size_t bytes;       /* sum of kept reply lengths */
    size_t max_entries, max_bytes, max_reply;
    dd_entry *old_head, *old_tail; /* ANSWERED entries by answer time */
    int warned_full;
};

dedupe *dedupe_new(size_t max_entries, size_t max_bytes, size_t max_reply)
{
    dedupe *d = calloc(1, sizeof(*d));
    if (!d)
        return NULL;
    d->max_entries = max_entries ? max_entries : 1;
    d->max_bytes = max_bytes;
    d->max_reply = max_reply;
    d->nbuckets = 16;
    while (d->nbuckets < 2 * d->max_entries)
        d->nbuckets *= 2;
    if (!(d->buckets = calloc(d->nbuckets, sizeof(dd_entry *)))) {
        free(d);
        return NULL;
    }
    return d;
}

static void entry_free(dd_entry *e)
{
    while (e->waiters) { /* only at dedupe_free: the calls are the server's */
        dd_waiter *w = e->waiters;
        e->waiters = w->next;
        free(w);
    }
    free(e->reply);
    free(e);
}

void dedupe_free(dedupe *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->nbuckets; i++)
        while (d->buckets[i]) {
            dd_entry *e = d->buckets[i];
            d->buckets[i] = e->hnext;
            entry_free(e);
        }
    free(d->buckets);
    free(d);
}

static size_t bucket_of(const dedupe *d, uint64_t client, uint64_t seq)
{
    uint64_t x = client ^ (seq * 0x9e3779b97f4a7c15ull);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return (size_t)x & (d->nbuckets - 1);
}

static dd_entry *lookup(dedupe *d, uint64_t client, uint64_t seq)
{
    for (dd_entry *e = d->buckets[bucket_of(d, client, seq)]; e; e = e->hnext)
        if (e->client == client && e->seq == seq)
            return e;
    return NULL;
}

/* forget removes the oldest ANSWERED entry; 0 if there is none. */
static int forget_oldest(dedupe *d)
{
    dd_entry *e = d->old_head;
    if (!e)
        return 0;
    d->old_head = e->next;
    if (d->old_head)
        d->old_head->prev = NULL;
    else
        d->old_tail = NULL;
    dd_entry **pp = &d->buckets[bucket_of(d, e->client, e->seq)];
    while (*pp != e)
        pp = &(*pp)->hnext;
    *pp = e->hnext;
    d->bytes -= e->reply ? e->len : 0;
    d->count--;
    entry_free(e);
    return 1;
}

/* on_reply: the reply hook of an original (see rpc_reply_hook). Runs once,
 * on the loop thread; buf is borrowed. The waiting duplicates get the same
 * bytes, then the reply is kept if the bounds allow. */
static void on_reply(rpc_call *call, const void *buf, size_t len, void *arg)
{
    dd_entry *e = arg;
    dedupe *d = e->d;
    (void)call;
    while (e->waiters) {
        dd_waiter *w = e->waiters;
        e->waiters = w->next;
        rpc_reply_bytes(w->call, buf, len);
        free(w);
    }
    e->nwaiters = 0;
    e->state = DD_ANSWERED;
    e->len = len;
    e->prev = d->old_tail;
    e->next = NULL;
    if (d->old_tail)
        d->old_tail->next = e;
    else
        d->old_head = e;
    d->old_tail = e;
    if (len > d->max_reply || len > d->max_bytes)
        return; /* remembered as answered, not kept */
    /* make room: drop the oldest kept replies (their rids stay known) */
    for (dd_entry *o = d->old_head; o && d->bytes + len > d->max_bytes; o = o->next)
        if (o->reply) {
            d->bytes -= o->len;
            free(o->reply);
            o->reply = NULL;
        }
    if ((e->reply = malloc(len ? len : 1)) != NULL) {
        memcpy(e->reply, buf, len);
        d->bytes += len;
    }
}

/* scan_params walks the params map once: the "rid" (found: 1, absent: 0,
 * malformed: -1 after answering the call) and whether "train" is true. A map
 * that cannot be walked (a key that is not a str) is left to the handler,
 * which refuses it. */
static int scan_params(rpc_call *call, uint64_t *client, uint64_t *seq, int *train)
{
    mp_reader r = call->req.params;
    int found = 0;
    *train = 0;
    for (uint32_t k = 0; k < call->req.nparams; k++) {
        const char *key;
        uint32_t klen, n;
        if (mp_read_str(&r, &key, &klen, NULL) != MOE_OK)
            return found;
        if (mp_str_eq(key, klen, "train") && mp_peek(&r) == MP_BOOL) {
            bool v = false;
            mp_read_bool(&r, &v, NULL);
            *train = v;
            continue;
        }
        if (!mp_str_eq(key, klen, "rid")) {
            if (mp_skip(&r, NULL) != MOE_OK)
                return found;
            continue;
        }
        if (found) {
            rpc_reply_err(call, MOE_EINVAL, "parameter 'rid' given twice");
            return -1;
        }
        found = 1;
        if (mp_peek(&r) != MP_ARRAY || mp_read_array(&r, &n, NULL) != MOE_OK) {
            rpc_reply_err(call, MOE_EPROTO,
                          "parameter 'rid' must be an array [client_id, seq] of two unsigned "
                          "integers");
            return -1;
        }
        if (n != 2) {
            rpc_reply_err(call, MOE_EINVAL, "parameter 'rid' must have 2 elements, not %u", n);
            return -1;
        }
        for (int i = 0; i < 2; i++) {
            mp_type t = mp_peek(&r);
            if (t == MP_INT) {
                rpc_reply_err(call, MOE_EINVAL, "parameter 'rid' must not be negative");
                return -1;
            }
            if (t != MP_UINT || mp_read_u64(&r, i ? seq : client, NULL) != MOE_OK) {
                rpc_reply_err(call, MOE_EPROTO,
                              "parameter 'rid' must be an array [client_id, seq] of two "
                              "unsigned integers");
                return -1;
            }
        }
    }
    return found;
}

int dedupe_begin(dedupe *d, rpc_call *call, const rpc_method *m)
{
    const moe_rpc_request *q = &call->req;
    uint64_t client = 0, seq = 0;
    int train = 0;
    int found = scan_params(call, &client, &seq, &train);
    if (found < 0)
        return 1;
    if (!found || !rpc_method_mutating(m, train))
        return 0;
    dd_entry *e = lookup(d, client, seq);
    if (e) {
        if (e->msgid != q->msgid || !mp_str_eq(q->method, q->method_len, e->method)) {
            rpc_reply_err(call, MOE_EINVAL,
                          "rid [%llu, %llu] was already used by another request (%s, msgid %u)",
                          (unsigned long long)client, (unsigned long long)seq, e->method, e->msgid);
            return 1;
        }
        if (e->state == DD_RUNNING) {
            dd_waiter *w = e->nwaiters < DEDUPE_MAX_WAITERS ? malloc(sizeof(*w)) : NULL;
            if (!w) {
                rpc_reply_err(call, MOE_EBUSY,
                              "%d duplicates of rid [%llu, %llu] already wait for the original",
                              e->nwaiters, (unsigned long long)client, (unsigned long long)seq);
                return 1;
            }
            w->call = call;
            w->next = e->waiters;
            e->waiters = w;
            e->nwaiters++;
            MOE_LOG(LOG_INFO, q->msgid,
                    "duplicate %s (rid [%llu, %llu]): waits for the original in flight", e->method,
                    (unsigned long long)client, (unsigned long long)seq);
            return 1;
        }
        if (e->reply) {
            MOE_LOG(LOG_INFO, q->msgid,
                    "duplicate %s (rid [%llu, %llu]): answered from the reply cache", e->method,
                    (unsigned long long)client, (unsigned long long)seq);
            rpc_reply_bytes(call, e->reply, e->len);
            return 1;
        }
        MOE_LOG(LOG_INFO, q->msgid, "duplicate %s (rid [%llu, %llu]): reply not kept, refused",
                e->method, (unsigned long long)client, (unsigned long long)seq);
        rpc_reply_err(call, MOE_EPRECOND,
                      "duplicate of a request already answered (rid [%llu, %llu]); its reply "
                      "(%zu bytes) was not kept",
                      (unsigned long long)client, (unsigned long long)seq, e->len);
        return 1;
    }
    if (d->count >= d->max_entries && !forget_oldest(d)) {
        if (!d->warned_full) {
            d->warned_full = 1;
            LOG_W("dedupe: %zu requests in flight fill the table: new ones run unprotected",
                  d->count);
        }
        return 0;
    }
    if (!(e = calloc(1, sizeof(*e)))) {
        LOG_W("dedupe: out of memory: request runs unprotected");
        return 0;
    }
    e->d = d;
    e->client = client;
    e->seq = seq;
    e->msgid = q->msgid;
    snprintf(e->method, sizeof(e->method), "%.*s", (int)q->method_len, q->method);
    e->state = DD_RUNNING;
    size_t b = bucket_of(d, client, seq);
    e->hnext = d->buckets[b];
    d->buckets[b] = e;
    d->count++;
    d->warned_full = 0;
    call->on_reply = on_reply;
    call->on_reply_arg = e;
    return 0;
}
