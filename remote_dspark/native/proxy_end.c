/* proxy_end.c: the proxy's take and answer of a round (hf_take, hf_answer, and the
 * _seen forms hf_round calls), and its wait for a round's rows (hf_rows_wait). The
 * words they move and the order they move them in are hostflag.c's (its "Memory
 * ordering" and "sleeping when idle"); the structs and codes, hostflag.h's (struct
 * hf_proxy says why the critical path is these two calls). */
#include "hostflag.h"

#include <sched.h>

static void observe(const struct hf_proxy *p, uint32_t hist, uint64_t ns)
{
    uint32_t b = 0;
    while (b < p->n_bounds && p->bounds[b] < ns)
        b++;
    uint64_t *h = p->counters + hist;
    __atomic_fetch_add(&h[b], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&h[p->n_bounds + 1], ns, __ATOMIC_RELAXED);
}


/* Wait until round r is gathered, or deadline. Spin spin_us; then, once nothing is
 * handed over beyond what was served, sleep on `published` (the engine's announce wakes
 * it), whatever nap_us: an idle or stopped engine costs the proxy nothing. While a round
 * is handed over but not gathered yet (the stream is a step behind the CPU), never
 * sleep: keep looking, however long, spinning (nap_us 0) or napping nap_us between
 * looks. Without the wake words (NULL), hf_wait_geq's spin, then nap or spin. */
static int wait_round(struct hf_proxy *p, uint32_t r, uint64_t deadline)
{
    if (!p->wake)
        return hf_wait_geq(p->ring.gathered, r, p->spin_us, p->nap_us, deadline);
    for (;;) {
        /* No spin when the last wait ended asleep with nothing handed over: an idle
         * proxy's periodic returns (its heartbeat, its parent check) cost no spin. */
        uint64_t spin_end = hf_now_ns() + (p->idle ? 0 : (uint64_t)p->spin_us * 1000u);
        int rc = hf_wait_geq(p->ring.gathered, r, 0, 0, spin_end < deadline ? spin_end : deadline);
        if (rc == HF_OK) {
            p->idle = 0;
            return rc;
        }
        if (rc != HF_TIMEOUT)
            return rc;
        uint32_t published = __atomic_load_n(&p->wake[0], __ATOMIC_SEQ_CST);
        if (cyc_geq(published, r)) {
            p->idle = 0;    /* handed over, not gathered yet: look until it is, never sleep */
            if (p->nap_us)
                return hf_wait_geq(p->ring.gathered, r, 0, p->nap_us, deadline);
        } else {
            if (hf_now_ns() >= deadline)
                return HF_TIMEOUT;
            hf_sleep_until_published(p->wake, published, deadline);
            p->idle = !cyc_geq(__atomic_load_n(&p->wake[0], __ATOMIC_ACQUIRE), r);
        }
        if (hf_now_ns() >= deadline)
            return cyc_geq(__atomic_load_n(p->ring.gathered, __ATOMIC_ACQUIRE), r) ? HF_OK : HF_TIMEOUT;
    }
}

/* Beat, then wait up to timeout_ns for the next gathered round nobody has claimed;
 * rounds another claimer answered meanwhile are skipped, never returned. Returns the
 * round id (0 .. 2^32-1) and when it was seen in *seen, or -HF_TIMEOUT. */
int64_t hf_take_seen(struct hf_proxy *p, uint64_t timeout_ns, uint64_t *seen)
{
    uint64_t now = hf_now_ns(), deadline = now + timeout_ns;
    __atomic_store_n(p->heartbeat, now, __ATOMIC_RELEASE);
    for (;;) {
        uint32_t r = p->next;
        int rc = wait_round(p, r, deadline);
        if (rc != HF_OK)
            return -(int64_t)rc;
        uint32_t claim = __atomic_load_n(p->ring.claim, __ATOMIC_ACQUIRE);
        if (cyc_geq(claim, r)) {
            p->next = claim + 1;
            continue;
        }
        *seen = hf_now_ns();
        /* Beat again on seeing it: a serving proxy is silent at most one network wait
         * (TIMEOUT_MS) between beats, however long it idled before the round came. */
        __atomic_store_n(p->heartbeat, *seen, __ATOMIC_RELEASE);
        p->next = r + 1;
        return r;
    }
}

/* Wait until fewer than `below` entries of the round in descriptor slot `desc` have rows
 * still to come (hf_rows_pending), or deadline_ns: the count then. The engine is copying
 * them at memory speed, so this spins, yielding the CPU between looks once it has spun
 * ROWS_SPIN_NS (an engine thread preempted mid-copy may need this core); a copy still
 * unfinished after ROWS_YIELD_NS is not being made (an engine stopped, or starved), so
 * from then on it naps ROWS_NAP_NS between looks: a stopped engine costs the proxy a few
 * wake-ups a millisecond until the round's deadline, not a core. A count that has not
 * fallen by the deadline is returned as it is. */
uint32_t hf_rows_wait(const uint8_t *desc, uint32_t below, uint64_t deadline_ns)
{
    enum { ROWS_SPIN_NS = 50000, ROWS_YIELD_NS = 1000000, ROWS_NAP_NS = 100000 };
    uint64_t yield_at = 0;
    for (uint32_t k = 1;; k++) {
        uint32_t pending = hf_rows_pending(desc);
        if (pending < below)
            return pending;
        if (k % 256 == 0) {
            uint64_t now = hf_now_ns();
            if (now >= deadline_ns)
                return pending;
            if (!yield_at)
                yield_at = now + ROWS_SPIN_NS;
            else if (now >= yield_at + ROWS_YIELD_NS)
                hf_nap_ns(deadline_ns - now < ROWS_NAP_NS ? deadline_ns - now : ROWS_NAP_NS);
            else if (now >= yield_at)
                sched_yield();
        }
        cpu_relax();
    }
}

/* hf_take_seen, for a caller that answers with hf_answer and sends the round itself (a
 * Python network round): the seen time is kept for it, and a round is returned once its
 * rows are all in staging (a CPU engine publishes it before them); one whose rows are not
 * all in by the deadline is left to the next call (-HF_TIMEOUT). */
int64_t hf_take(struct hf_proxy *p, uint64_t timeout_ns)
{
    uint64_t seen = 0, deadline = hf_now_ns() + timeout_ns;
    int64_t r = hf_take_seen(p, timeout_ns, &seen);
    if (r < 0)
        return r;
    uint32_t index = (uint32_t)r & (p->ring.depth - 1);
    if (hf_rows_wait(p->desc + (uint64_t)index * p->desc_stride, 1, deadline)) {
        p->next = (uint32_t)r;
        return -HF_TIMEOUT;
    }
    p->seen_ns[index] = seen;
    return r;
}

/* Publish `round`; the clock is read (for hf_publish's wait) only when round - 1 is not
 * released yet, so the common case between seeing a round and releasing it touches
 * nothing but the ring's words. */
static int publish_within(const struct hf_ring *ring, uint32_t round, uint64_t timeout_ns)
{
    if (__atomic_load_n(ring->released, __ATOMIC_ACQUIRE) == round - 1) {
        hf_release_store(ring->released, ring->waiters, round);
        return HF_OK;
    }
    return hf_publish(ring->released, ring->waiters, round, hf_now_ns() + timeout_ns);
}

/* Answer `round` with `status`: claim it, write its drafts slot, publish, count. With
 * `image` (status OK only) the drafts come from a private buffer shaped like a drafts
 * slot: n_entries and flags at d_zero, then counts, entry statuses, tokens and (flag
 * bit 0) margins at the slot's offsets; only the n entries' bytes are copied. Without
 * it the answer is empty. HF_LATE (counted rounds_late): another claimer answered it;
 * HF_TIMEOUT: claimed and written, but round - 1 was not released in time; HF_STATE: a
 * status that is not the proxy's, or an image with more entries than the slot holds. */
int hf_answer_seen(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image,
                   uint64_t seen)
{
    const struct hf_ring *ring = &p->ring;
    uint32_t n = 0, flags = 0, answered = 0;
    uint64_t tokens = 0;
    if (status >= HF_PROXY_OUTCOMES || (image && status != ST_OK))
        return HF_STATE;
    if (image) {
        memcpy(&n, image + ring->d_zero, 4);
        memcpy(&flags, image + ring->d_zero + 4, 4);
        if (n > p->max_slots)
            return HF_STATE;
    }
    int rc = hf_claim(ring->claim, round);
    if (rc == HF_LATE)
        count(p, p->c_late, 1);
    if (rc != HF_OK)
        return rc;
    uint32_t i = round & (ring->depth - 1);
    uint8_t *slot = ring->drafts + (uint64_t)i * ring->drafts_stride;
    if (image) {
        uint64_t row = 4u * (uint64_t)n, grid = row * p->num_spec;
        memcpy(slot + ring->d_zero, image + ring->d_zero, 8);
        memcpy(slot + p->d_counts, image + p->d_counts, row);
        memcpy(slot + p->d_entry_status, image + p->d_entry_status, row);
        memcpy(slot + p->d_tokens, image + p->d_tokens, grid);
        if (flags & W_MARGINS)
            memcpy(slot + p->d_margins, image + p->d_margins, grid);
        if (flags & W_SAMPLED) {   /* the distributions: W_TOP ids (i32, as a token) and weights (u16) a position */
            memcpy(slot + p->d_q_ids, image + p->d_q_ids, (uint64_t)W_TOP * grid);
            memcpy(slot + p->d_q_weights, image + p->d_q_weights, (uint64_t)W_TOP * grid / 2);
        }
        __atomic_store_n((uint32_t *)(slot + ring->d_status), status, __ATOMIC_RELAXED);
        __atomic_store_n((uint32_t *)(slot + ring->d_round), round, __ATOMIC_RELAXED);
    } else {
        hf_zero_drafts(ring, round, status);
    }
    rc = publish_within(ring, round, p->publish_timeout_ns);
    if (rc != HF_OK)
        return rc;
    /* The engine has the round; the bookkeeping comes after. A later round's gather in
     * this slot is stamped after `seen`, so the check below drops it. */
    uint64_t now = hf_now_ns(), gathered = __atomic_load_n(&ring->gathered_ns[i], __ATOMIC_RELAXED);
    count(p, p->c_outcome[status], 1);
    if (seen && seen <= now)
        observe(p, p->h_round, now - seen);
    if (gathered && gathered <= seen)
        observe(p, p->h_handoff, seen - gathered);
    for (uint32_t e = 0; e < n; e++) {
        int32_t k;
        memcpy(&k, image + p->d_counts + 4u * e, 4);
        answered += k != 0;
        tokens += (uint64_t)(k > 0 ? k : 0);
    }
    if (answered) {
        count(p, p->c_drafts, answered);
        count(p, p->c_draft_tokens, tokens);
    }
    return HF_OK;
}

/* hf_answer_seen, for a caller that took the round with hf_take. */
int hf_answer(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image)
{
    uint64_t *seen = &p->seen_ns[round & (p->ring.depth - 1)];
    int rc = hf_answer_seen(p, round, status, image, *seen);
    if (rc == HF_OK)
        *seen = 0;
    return rc;
}
