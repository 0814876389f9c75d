/*
 * lane_trace.h - where a lane request's time goes, for one client posting
 * one request at a time (a decode loop on a shared-memory ring). With
 * MOE_LANE_TRACE=N in the worker's environment, each step of a request is
 * stamped, and every N requests the log gets the median of each step's
 * time in microseconds (docs/OPERATIONS.md). Off (one load and a branch
 * per step) without it. Requests in flight at once mix their stamps: the
 * figures then mean nothing.
 */
#ifndef MOE_WORKER_LANE_TRACE_H
#define MOE_WORKER_LANE_TRACE_H

typedef enum {
    LT_SEEN,   /* the ring's thread saw the request's counter */
    LT_QUEUED, /* the lane's job goes onto the compute thread's queue */
    LT_TAKEN,  /* the compute thread took it */
    LT_FWD0,   /* the forward's handler starts computing (its t0) */
    LT_FWD1,   /* the device forward and its statistics are back */
    LT_ANSWER, /* the answer is being written into the ring */
    LT_DONE,   /* the ring's answer counter is stored */
    LT_N
} lane_step;

/* lane_trace stamps step (any thread); LT_DONE closes the request */
void lane_trace(lane_step step);

#endif
