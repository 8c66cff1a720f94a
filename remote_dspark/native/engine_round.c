/* engine_round.c: the engine's host side of a round (remote_dspark.engine.writers.host_round).
 *
 * hf_host_round hands a reserved round over: the batch's metadata checked and written into
 * the round's descriptor (hf_host_meta), the descriptor's round word, `gathered` published
 * (hf_signal), then its rows gathered into the staging slot while the proxy sends the
 * first of them, and, when the engine holds its GIL for the first microseconds of a wait
 * (streamsync's hold), that spin for `released` too. hf_host_answer copies a released
 * round's answer out of its drafts slot into the engine's arrays and sums it as
 * hf_drafts_summary does, or only sums it (a round launch() enqueued, counted once
 * released). Through Python the same steps are about forty calls of a microsecond each
 * on the engine's critical path.
 *
 * The Python steps stay the reference these calls are tested against, byte for byte and
 * verdict for verdict (tests/engine/writers/test_host_round.py). A batch refused here is checked
 * again in Python, whose ValueError names the culprit: messages are written once. */
#include "hostflag.h"

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The first of n entries whose row index (index_bytes 4 or 8) is outside 0..src_rows-1,
 * or n. */
static uint64_t bad_index(const struct hf_host_round *h, uint64_t n)
{
    const int64_t *i64 = h->index;
    const int32_t *i32 = h->index;
    for (uint64_t e = 0; e < n; e++) {
        int64_t at = h->index_bytes == 8 ? i64[e] : (int64_t)i32[e];
        if (at < 0 || (uint64_t)at >= h->src_rows)
            return e;
    }
    return n;
}

/* Rows a published round's count of pending entries steps down by: about this many
 * bytes at a time, so the proxy sends the first ones while the rest are copied. */
enum { STREAM_BYTES = 64 << 10 };

/* Gather n checked rows by index into dst, packed, counting down `pending` (the round's
 * DESC_PENDING word, n when called) with a release store after every STREAM_BYTES or so
 * and after the last row. */
static void gather(const struct hf_host_round *h, uint8_t *dst, uint64_t n, uint32_t *pending)
{
    const int64_t *i64 = h->index;
    const int32_t *i32 = h->index;
    uint64_t step = h->row_bytes < STREAM_BYTES ? STREAM_BYTES / h->row_bytes : 1;
    for (uint64_t e = 0; e < n; ) {
        uint64_t end = n - e < step ? n : e + step;
        for (; e < end; e++) {
            uint64_t at = h->index_bytes == 8 ? (uint64_t)i64[e] : (uint64_t)i32[e];
            memcpy(dst + e * h->row_bytes, h->rows + at * h->src_stride, h->row_bytes);
        }
        __atomic_store_n(pending, (uint32_t)(n - e), __ATOMIC_RELEASE);
    }
}

/* Hand round h->round over (reserved by the caller). HF_HR_META: the metadata broke the
 * rule h->meta_rule; HF_HR_ROW: entry h->bad_entry's row index is outside the rows;
 * HF_HR_ARGS: the caller's bug (no metadata struct, no rows where the round's entries need
 * them, an index size). Each leaves `gathered` alone: the round is still the caller's to
 * give back. HF_HR_OK: handed over;
 * h->released_now says whether the release came within h->hold_ns, and h->spin_cpu_ns is
 * the thread's CPU time in that spin (the engine counts it as its wait's: on a busy
 * machine the spin's wall time is more than what it cost).
 *
 * The round is published before its rows are copied: its descriptor's DESC_PENDING word
 * says how many entries' rows are still to come, and the copy counts it down, so the
 * proxy sends the frame's head and first rows while the rest are copied. Every check is
 * made before the round is published. */
int hf_host_round(struct hf_host_round *h)
{
    const struct hf_ring *g = h->ring;
    uint32_t r = h->round, i = r & (g->depth - 1);
    uint8_t *desc = h->desc + (uint64_t)i * h->desc_stride;
    h->released_now = 0;
    h->spin_cpu_ns = 0;
    h->bad_entry = 0;
    if (!h->meta || (h->row_bytes && h->index_bytes != 4 && h->index_bytes != 8))
        return HF_HR_ARGS;
    h->meta_rule = (uint32_t)hf_host_meta(h->meta, desc + DESC_FIXED, h->desc_room);
    if (h->meta_rule)
        return HF_HR_META;
    uint64_t n = h->row_bytes ? h->meta->n : 0;
    if (n) {
        if (!h->rows || !h->index)
            return HF_HR_ARGS;
        h->bad_entry = (uint32_t)bad_index(h, n);
        if (h->bad_entry != n)
            return HF_HR_ROW;
    }
    uint32_t *pending = (uint32_t *)(desc + DESC_PENDING);
    /* n <= max_slots; like the round word, published by the store of gathered (relaxed: a
     * late proxy of the slot's previous round may still be loading it) */
    __atomic_store_n(pending, (uint32_t)n, __ATOMIC_RELAXED);
    memcpy(desc, &r, 4);
    hf_signal(g->gathered, g->gathered_ns + i, r, h->wake);
    if (n)
        gather(h, h->staging + (uint64_t)i * h->staging_stride, n, pending);
    if (h->hold_ns) {
        uint64_t cpu0 = thread_cpu_ns();
        h->released_now = hf_wait_geq(g->released, r, 0, 0, hf_now_ns() + h->hold_ns) == HF_OK;
        h->spin_cpu_ns = thread_cpu_ns() - cpu0;
    }
    return HF_HR_OK;
}

/* Released round `round`'s answer: the drafts slot's head into h->status, h->got and
 * h->flags, and, when the slot holds this round, its first n entries summed into
 * h->drafted, h->draft_tokens and h->n_lost (the lost slots into h->lost). With `copy`:
 * got must be 0 or n, and the counts [n] and tokens [n, num_spec] are copied into the
 * caller's arrays; without, n is got, held to the layout's max_slots (a proxy's check
 * keeps it there). Returns HF_HR_OK, HF_HR_OTHER (the slot holds round h->head_round),
 * HF_HR_GOT (got is neither 0 nor n) or HF_HR_ARGS (n past max_slots: the caller's bug):
 * nothing copied or summed. */
static int read_answer(struct hf_host_round *h, uint32_t round, uint32_t n, int copy, int32_t *counts,
                       int32_t *tokens)
{
    const struct hf_ring *g = h->ring;
    const uint8_t *d = g->drafts + (uint64_t)(round & (g->depth - 1)) * g->drafts_stride;
    uint32_t head[4];
    memcpy(head, d, sizeof head);   /* after the acquire of `released`: the proxy's writes are seen */
    h->head_round = head[0], h->status = head[1], h->got = head[2], h->flags = head[3];
    h->drafted = h->draft_tokens = 0;
    h->n_lost = 0;
    if (head[0] != round)
        return HF_HR_OTHER;
    if (!h->got)
        return HF_HR_OK;
    if (!copy)
        n = h->got < h->max_slots ? h->got : h->max_slots;
    else if (n > h->max_slots)
        return HF_HR_ARGS;
    else if (h->got != n)
        return HF_HR_GOT;
    const int32_t *src_counts = (const int32_t *)(d + h->d_counts);
    if (copy) {
        memcpy(counts, src_counts, 4u * (uint64_t)n);
        memcpy(tokens, d + h->d_tokens, 4u * (uint64_t)n * h->num_spec);
    }
    uint64_t out[3];
    const uint8_t *desc = h->desc + (uint64_t)(round & (g->depth - 1)) * h->desc_stride;
    hf_drafts_summary(src_counts, (const int32_t *)(d + h->d_statuses),
                      (const uint32_t *)(desc + DESC_FIXED + W_ROUND_FIXED), n, out, h->lost);
    h->drafted = out[0], h->draft_tokens = out[1], h->n_lost = (uint32_t)out[2];
    return HF_HR_OK;
}

/* Released round `round`'s answer for an engine that asked for no margins and no
 * distributions, as read_answer copies it: got is 0 or n (any answer the proxy wrote:
 * hf_unpack holds it to the round's entries). */
int hf_host_answer(struct hf_host_round *h, uint32_t round, uint32_t n, int32_t *counts, int32_t *tokens)
{
    return read_answer(h, round, n, 1, counts, tokens);
}

/* A launched round's count (read_answer without a copy). */
int hf_host_summary(struct hf_host_round *h, uint32_t round)
{
    return read_answer(h, round, 0, 0, NULL, NULL);
}
