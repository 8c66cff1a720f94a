/* watchdog.c: the engine's native watchdog thread (it answers a round gathered long ago
 * and never released, so a proxy that cannot run never parks the engine for good) and
 * the release of a dead claimer's rounds under its lock. Apart from hostflag.c because
 * it is a concern of its own: a thread with its own lock over the ring's words, which it
 * reads and releases through hostflag.c's claim and publish (hostflag.h).
 */
#include "hostflag.h"

#include <pthread.h>
#include <stdlib.h>

struct hf_watch {
    struct hf_ring ring;
    uint64_t *counter;       /* engine counters block: rounds this watchdog released */
    uint32_t status;         /* drafts status written for those rounds */
    uint64_t limit_ns;       /* release a round gathered this long ago and not released */
    uint64_t poll_ns;        /* longest sleep between looks */
    int stop;                /* under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* CLOCK_MONOTONIC; signalled by hf_watchdog_stop */
    pthread_t thread;
};

/* Look once. Returns how long to sleep before the next look (0: look again now). The
 * watchdog only claims when no claim is in flight (claim == released), so its own
 * publish never waits; a round a live claimer holds is that claimer's to release. */
static uint64_t watch_once(struct hf_watch *w, uint32_t *tracked, uint64_t *seen)
{
    const struct hf_ring *ring = &w->ring;
    uint32_t rel = __atomic_load_n(ring->released, __ATOMIC_ACQUIRE);
    uint32_t claim = __atomic_load_n(ring->claim, __ATOMIC_ACQUIRE);
    uint32_t gathered = __atomic_load_n(ring->gathered, __ATOMIC_ACQUIRE);
    uint64_t now = hf_now_ns();
    if (claim != rel || cyc_geq(rel, gathered)) {
        *seen = 0;
        return w->poll_ns;
    }
    uint32_t r = rel + 1;
    if (!*seen || *tracked != r) {  /* first look at this round: the fallback start */
        *tracked = r;
        *seen = now;
    }
    uint64_t t0 = __atomic_load_n(&ring->gathered_ns[r & (ring->depth - 1)], __ATOMIC_RELAXED);
    uint64_t start = (t0 && t0 <= now) ? t0 : *seen;
    if (now - start < w->limit_ns) {
        uint64_t left = start + w->limit_ns - now;
        return left < w->poll_ns ? left : w->poll_ns;
    }
    if (hf_release_empty(ring, r, w->status, now + w->limit_ns) == HF_OK)
        __atomic_fetch_add(w->counter, 1, __ATOMIC_RELAXED);
    *seen = 0;
    return 0;
}

static void *watch_main(void *arg)
{
    struct hf_watch *w = arg;
    uint32_t tracked = 0;
    uint64_t seen = 0;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        uint64_t sleep = watch_once(w, &tracked, &seen);
        if (!sleep)
            continue;
        uint64_t until = hf_now_ns() + sleep;
        struct timespec ts = { (time_t)(until / 1000000000u), (long)(until % 1000000000u) };
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Start the watchdog thread. NULL on failure (errno set). The ring is copied. */
void *hf_watchdog_start(const struct hf_ring *ring, uint64_t *counter, uint32_t status,
                        uint64_t limit_ns, uint64_t poll_ns)
{
    struct hf_watch *w = calloc(1, sizeof(*w));
    pthread_condattr_t ca;
    if (!w)
        return NULL;
    w->ring = *ring;
    w->counter = counter;
    w->status = status;
    w->limit_ns = limit_ns;
    w->poll_ns = poll_ns ? poll_ns : 1000000u;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    int err = pthread_create(&w->thread, NULL, watch_main, w);
    if (err) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        errno = err;
        return NULL;
    }
    return w;
}

/* Release the rounds a dead claimer holds (claim ahead of released), empty with
 * `status`, under the watchdog's lock, so its own claim can never come between the
 * reads of released and claim. The number released, or -HF_STATE when released will not
 * move (a broken ring). Only once the claimer is known dead. */
int hf_watchdog_release_orphans(void *handle, uint32_t status)
{
    struct hf_watch *w = handle;
    const struct hf_ring *ring = &w->ring;
    int n = 0, rc = HF_OK;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        uint32_t rel = __atomic_load_n(ring->released, __ATOMIC_ACQUIRE);
        uint32_t claim = __atomic_load_n(ring->claim, __ATOMIC_ACQUIRE);
        if (cyc_geq(rel, claim))
            break;
        hf_zero_drafts(ring, rel + 1, status);
        rc = hf_publish(ring->released, ring->waiters, rel + 1, hf_now_ns() + 1000000000u);
        if (rc != HF_OK)
            break;
        n++;
    }
    pthread_mutex_unlock(&w->mu);
    return rc == HF_OK ? n : -rc;
}

/* Stop and join the watchdog thread, free it. */
int hf_watchdog_stop(void *handle)
{
    struct hf_watch *w = handle;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    int err = pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    return err ? HF_SYS : HF_OK;
}
