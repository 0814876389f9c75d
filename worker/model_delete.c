/*
 * model_delete.c - worker.model_delete (the coordinator's model.delete and
 * the roll back of a failed model.create), and the memory this worker
 * reports in worker.register and worker.heartbeat ("mem"), which the
 * coordinator checks a model.create against.
 */
#include <stdio.h>
#include <string.h>

#include "worker/gpu.h"
#include "common/log.h"
#include "common/params.h"
#include "worker/worker.h"

/* host_mem_available: MemAvailable of /proc/meminfo in bytes; -1 if unknown */
static int64_t host_mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kb = -1;
    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1)
            break;
    fclose(f);
    return kb < 0 ? -1 : (int64_t)kb * 1024;
}

void wkr_write_mem(const wkr *w, mp_writer *pw)
{
    int64_t host = host_mem_available();
    if (w->mem_report_mb > 0) /* --mem-report-mb: an operator's (or a test's) bound */
        host = w->mem_report_mb << 20;
    mp_write_cstr(pw, "mem");
    mp_write_map(pw, 2);
    mp_write_cstr(pw, "host_available");
    mp_write_i64(pw, host);
    mp_write_cstr(pw, "gpu_free");
    mp_write_i64(pw, w->use_gpu ? wkr_gpu_mem_free((int)w->device_index) : -1);
}

/* worker.model_delete {model}: frees the model and its train states here.
 * A model this worker does not hold is no error (deleted: false). */
void wkr_op_model_delete(wkr *w, rpc_call *c)
{
    char name[MODEL_NAME_MAX];
    pspec sp[] = {{"model", P_STR, name, true, 0, 0, sizeof(name), false}};
    if (!wkr_parse_or_reply(c, sp, 1))
        return;
    int found = 0;
    for (int i = 0; i < w->nmodels; i++) {
        if (strcmp(w->models[i]->cfg.name, name) != 0)
            continue;
        wkr_model *m = w->models[i];
        wkr_handle_drop_model(w, m);
        w->models[i] = w->models[--w->nmodels];
        w->models[w->nmodels] = NULL;
        wkr_model_free(m);
        found = 1;
        LOG_I("model %s deleted", name);
        break;
    }
    mp_writer wr;
    mp_writer_init(&wr);
    moe_rpc_write_response_ok_head(&wr, c->req.msgid);
    mp_write_map(&wr, 1);
    mp_write_cstr(&wr, "deleted");
    mp_write_bool(&wr, found != 0);
    rpc_reply(c, &wr);
}
