/* cuda_launch.c: the engine stream's half of a round on CUDA in one call
 * (hf_cuda_launch). In stream order: the rows' gather into the round's staging slot (the
 * kernel of gather.ptx), the store of `gathered`, the wait for `released`, and the
 * copies of the answer out of the round's drafts slot into the engine's tensors. Before
 * them, on the CPU, the round is announced to a sleeping proxy.
 *
 * This library links no CUDA: the caller resolves the driver's entry points and loads
 * the kernel (remote_dspark/shm/cuda_driver.py, through libcuda.so.1, in the engine
 * only) and hands their addresses over once, in struct hf_cuda. Every call acts on the
 * calling thread's current context, torch's. The proxy never calls this file. */
#include "hostflag.h"

#include <stddef.h>

/* The driver's types, as its API declares them (CUresult is an int; handles are pointers). */
typedef int (*cu_launch_kernel)(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared_bytes, void *stream, void **params, void **extra);
typedef int (*cu_value32)(void *stream, uint64_t address, uint32_t value, unsigned flags);
typedef int (*cu_memcpy_async)(uint64_t dst, uint64_t src, size_t bytes, void *stream);

enum { CU_WAIT_GEQ = 0x0, CU_WRITE_DEFAULT = 0x0 };  /* cyclic >=; a barrier before the write */
enum { GATHER_THREADS = 256, GATHER_MAX_GRID_Y = 65535 };

/* Enqueue the gather of l->n rows alone (also the engine's self-check of the kernel): a
 * block of GATHER_THREADS units per (row, stretch). Returns 0 or the driver's error. */
int hf_cuda_gather(const struct hf_cuda *c, const struct hf_launch *l)
{
    uint64_t stretches = (l->row_units + GATHER_THREADS - 1) / GATHER_THREADS;
    if (!l->n || !stretches)
        return 0;  /* nothing to gather (a grid of no blocks is the driver's error) */
    if (stretches > GATHER_MAX_GRID_Y || l->n > UINT32_MAX)
        return HF_LAUNCH_TOO_BIG;  /* the caller's bug: rows are capped far below this */
    uint64_t src = l->src, index = l->index, dst = l->dst;
    uint64_t src_stride = l->src_stride, row_units = l->row_units, src_rows = l->src_rows;
    uint32_t index_bytes = l->index_bytes, unit_bytes = l->unit_bytes;
    void *params[] = {&src, &index, &dst, &src_stride, &row_units, &src_rows, &index_bytes, &unit_bytes};
    return ((cu_launch_kernel)c->launch_kernel)(c->gather, (unsigned)l->n, (unsigned)stretches, 1, GATHER_THREADS,
                                                1, 1, 0, l->stream, params, NULL);
}

/* Enqueue round l->round's stream work (see the file's comment). Returns 0, or the
 * driver's error with l->step naming the step it failed at (HF_STEP_*; the steps before
 * it are enqueued, none after). */
int hf_cuda_launch(const struct hf_cuda *c, struct hf_launch *l)
{
    int rc = 0;
    l->step = HF_STEP_GATHER;
    if ((rc = hf_cuda_gather(c, l)) != 0)
        return rc;
    hf_announce(c->wake, l->round);
    l->step = HF_STEP_SIGNAL;
    if ((rc = ((cu_value32)c->write_value32)(l->stream, c->gathered, l->round, CU_WRITE_DEFAULT)) != 0)
        return rc;
    l->step = HF_STEP_WAIT;
    if ((rc = ((cu_value32)c->wait_value32)(l->stream, c->released, l->round, CU_WAIT_GEQ)) != 0)
        return rc;
    for (uint32_t k = 0; k < l->n_copies && k < HF_LAUNCH_COPIES; k++) {
        l->step = HF_STEP_COPY + (int32_t)k;
        if (l->copy[k].bytes
            && (rc = ((cu_memcpy_async)c->memcpy_async)(l->copy[k].dst, l->copy[k].src, l->copy[k].bytes, l->stream)))
            return rc;
    }
    l->step = HF_STEP_DONE;
    return 0;
}

/* A released round's answer as the engine counts it once launched rounds are collected:
 * of its `got` entries (the drafts slot's counts and statuses, the descriptor's slots),
 * out[0] the entries with drafts, out[1] their draft tokens, out[2] the entries the
 * worker lost (W_RESYNC), whose slots go to lost[0..out[2]) (room for got). */
void hf_drafts_summary(const int32_t *counts, const int32_t *statuses, const uint32_t *slots, uint32_t got,
                       uint64_t *out, uint32_t *lost)
{
    uint64_t drafted = 0, tokens = 0, n_lost = 0;
    for (uint32_t e = 0; e < got; e++) {
        drafted += counts[e] != 0;
        tokens += (uint64_t)(int64_t)counts[e];
        if (statuses[e] == W_RESYNC)
            lost[n_lost++] = slots[e];
    }
    out[0] = drafted, out[1] = tokens, out[2] = n_lost;
}
