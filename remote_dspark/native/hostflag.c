/* hostflag.c: the hand-off primitives shared by the engine and the proxy process.
 *
 * Thin on purpose: plain integers, pointers and status codes in and out. The region's
 * layout is not known here; Python (remote_dspark.shm) computes it once and passes the
 * addresses of the words and the geometry of the drafts slots (struct hf_ring).
 *
 * Memory ordering: sequence words are loaded with acquire and stored with release, the
 * claim word is a compare-and-swap, counters are relaxed fetch-adds. Everything a
 * claimer writes into a drafts slot is published by its release store of `released`
 * and read by the engine after its acquire load of that word.
 *
 * Sequence words are 32-bit and compared cyclically: a >= b iff (int32_t)(a - b) >= 0,
 * so a run may start near 2^32 and wrap (the ring depth is a power of two, so
 * round % depth stays continuous across the wrap).
 *
 * Status codes: HF_OK, HF_TIMEOUT (deadline passed), HF_LATE (the round was already
 * claimed), HF_ORDER (the previous round is not claimed yet: a caller bug), HF_STATE
 * (a word holds a value its protocol forbids), HF_NOMEM, HF_SYS (errno is set).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HF_ABI 3

enum { HF_OK = 0, HF_TIMEOUT = 1, HF_LATE = 2, HF_ORDER = 3, HF_STATE = 4, HF_NOMEM = 5, HF_SYS = 6 };

/* Where the words and the drafts slots of one region are, in this process. */
struct hf_ring {
    uint32_t *gathered;      /* engine stream: last round gathered into staging */
    uint32_t *released;      /* claimer: last round whose drafts are published */
    uint32_t *claim;         /* CAS: last round claimed by the proxy, watchdog or engine */
    uint64_t *gathered_ns;   /* [depth] CLOCK_MONOTONIC ns of each slot's gather; 0 = unknown */
    uint8_t *drafts;         /* drafts slot 0 */
    uint64_t drafts_stride;  /* bytes between drafts slots */
    uint32_t depth;          /* ring depth, a power of two */
    uint32_t d_round;        /* offset of the slot's round word */
    uint32_t d_status;       /* offset of the slot's status word */
    uint32_t d_zero;         /* first byte zeroed for an empty answer (n_entries, flags, counts) */
    uint32_t zero_bytes;     /* how many bytes from d_zero */
    uint32_t pad;
};

static inline int cyc_geq(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

uint64_t hf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void nap_ns(uint64_t ns)
{
    struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
    nanosleep(&ts, NULL);
}

/* The ABI this file implements; the loader refuses a library built from another one. */
int hf_abi_version(void) { return HF_ABI; }

/* Bit 0: 32-bit words are always lock-free; bit 1: 64-bit words are. The loader needs 3:
 * a word that falls back to a lock is not shared safely between processes. */
int hf_lock_free(void)
{
    return (__atomic_always_lock_free(sizeof(uint32_t), 0) ? 1 : 0)
         | (__atomic_always_lock_free(sizeof(uint64_t), 0) ? 2 : 0);
}

uint32_t hf_load32(const uint32_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
void hf_store32(uint32_t *w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }
uint64_t hf_load64(const uint64_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
void hf_store64(uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

/* Counters: relaxed, one writer per word, read by whoever exports them. */
void hf_add64(uint64_t *w, uint64_t v) { __atomic_fetch_add(w, v, __ATOMIC_RELAXED); }

/* Copy n 64-bit words one atomic load at a time (a consistent value per word). */
void hf_snapshot64(const uint64_t *src, uint64_t *dst, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

/* Wait until *word >= value (cyclic). Spins for spin_us, then, when nap_us > 0, sleeps
 * nap_us between checks; nap_us == 0 spins to the end. HF_TIMEOUT once deadline_ns
 * (CLOCK_MONOTONIC) passes with the word still behind. */
int hf_wait_geq(const uint32_t *word, uint32_t value, uint32_t spin_us, uint32_t nap_us,
                uint64_t deadline_ns)
{
    uint64_t start = 0, now;
    for (uint32_t n = 0;; n++) {
        if (cyc_geq(__atomic_load_n(word, __ATOMIC_ACQUIRE), value))
            return HF_OK;
        if (n & 63) {           /* read the clock every 64 checks: keeps the spin tight */
            cpu_relax();
            continue;
        }
        now = hf_now_ns();
        if (!start)
            start = now;
        if (now >= deadline_ns)
            return cyc_geq(__atomic_load_n(word, __ATOMIC_ACQUIRE), value) ? HF_OK : HF_TIMEOUT;
        if (nap_us && now - start >= (uint64_t)spin_us * 1000u) {
            uint64_t left = deadline_ns - now, nap = (uint64_t)nap_us * 1000u;
            nap_ns(nap < left ? nap : left);
        } else {
            cpu_relax();
        }
    }
}

/* hf_wait_geq, and the CLOCK_MONOTONIC time of the look that ended it in *seen_ns. */
int hf_wait_at(const uint32_t *word, uint32_t value, uint32_t spin_us, uint32_t nap_us,
               uint64_t deadline_ns, uint64_t *seen_ns)
{
    int rc = hf_wait_geq(word, value, spin_us, nap_us, deadline_ns);
    *seen_ns = hf_now_ns();
    return rc;
}

/* Stream side on the CPU: record when, publish `gathered = round`. */
void hf_signal(uint32_t *gathered, uint64_t *gathered_ns, uint32_t round)
{
    if (gathered_ns)
        __atomic_store_n(gathered_ns, hf_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(gathered, round, __ATOMIC_RELEASE);
}

/* One CPU hand-off: signal, then wait for `released >= round`. out_ns[0] is taken just
 * before the store of gathered, out_ns[1] just after released was seen, both here, so
 * the caller's wait for its GIL afterwards is not part of the measure. */
int hf_handoff(uint32_t *gathered, uint64_t *gathered_ns, const uint32_t *released,
               uint32_t round, uint32_t spin_us, uint32_t nap_us, uint64_t deadline_ns,
               uint64_t *out_ns)
{
    uint64_t t0 = hf_now_ns();
    if (gathered_ns)
        __atomic_store_n(gathered_ns, t0, __ATOMIC_RELAXED);
    __atomic_store_n(gathered, round, __ATOMIC_RELEASE);
    out_ns[0] = t0;
    return hf_wait_at(released, round, spin_us, nap_us, deadline_ns, &out_ns[1]);
}

/* Take the right to answer `round`: exactly one caller gets HF_OK per round. Rounds are
 * claimed in order (claim holds the last claimed round): HF_LATE when round is already
 * claimed, HF_ORDER when round - 1 is not claimed yet. */
int hf_claim(uint32_t *claim, uint32_t round)
{
    uint32_t cur = __atomic_load_n(claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if (cyc_geq(cur, round))
            return HF_LATE;
        if (cur != round - 1)
            return HF_ORDER;
        if (__atomic_compare_exchange_n(claim, &cur, round, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return HF_OK;
    }
}

/* Publish `released = round` after a successful claim. The claimer of round - 1 may
 * still be between its claim and its release (a few instructions when it is the
 * watchdog): wait for it, so `released` only moves forward, one round at a time. */
int hf_publish(uint32_t *released, uint32_t round, uint64_t deadline_ns)
{
    int rc = hf_wait_geq(released, round - 1, 20, 20, deadline_ns);
    if (rc != HF_OK)
        return rc;
    if (cyc_geq(__atomic_load_n(released, __ATOMIC_ACQUIRE), round))
        return HF_STATE;   /* somebody released a round this caller holds the claim of */
    __atomic_store_n(released, round, __ATOMIC_RELEASE);
    return HF_OK;
}

/* Write an empty answer (zero drafts, `status`) for `round` into its drafts slot.
 * Only the holder of the round's claim may call this. */
void hf_zero_drafts(const struct hf_ring *ring, uint32_t round, uint32_t status)
{
    uint8_t *slot = ring->drafts + (uint64_t)(round & (ring->depth - 1)) * ring->drafts_stride;
    memset(slot + ring->d_zero, 0, ring->zero_bytes);
    __atomic_store_n((uint32_t *)(slot + ring->d_status), status, __ATOMIC_RELAXED);
    __atomic_store_n((uint32_t *)(slot + ring->d_round), round, __ATOMIC_RELAXED);
}

/* Claim `round`, answer it empty with `status`, release it. HF_LATE: somebody else
 * answered it; HF_TIMEOUT: claimed and answered, but the previous claimer did not
 * release round - 1 before deadline_ns (round stays claimed, not released). */
int hf_release_empty(const struct hf_ring *ring, uint32_t round, uint32_t status,
                     uint64_t deadline_ns)
{
    int rc = hf_claim(ring->claim, round);
    if (rc != HF_OK)
        return rc;
    hf_zero_drafts(ring, round, status);
    return hf_publish(ring->released, round, deadline_ns);
}

/* The C peer (the latency floor of the benchmark): answer `count` rounds from `first`,
 * empty with `status`, as soon as each is gathered. */
int hf_serve(const struct hf_ring *ring, uint32_t first, uint32_t count, uint32_t status,
             uint32_t spin_us, uint32_t nap_us, uint64_t round_timeout_ns)
{
    for (uint32_t i = 0; i < count; i++) {
        uint32_t r = first + i;
        int rc = hf_wait_geq(ring->gathered, r, spin_us, nap_us, hf_now_ns() + round_timeout_ns);
        if (rc == HF_OK)
            rc = hf_release_empty(ring, r, status, hf_now_ns() + round_timeout_ns);
        if (rc != HF_OK && rc != HF_LATE)
            return rc;
    }
    return HF_OK;
}

/* ------------------------------------------------------------------ the proxy's side */

enum { HF_PROXY_OUTCOMES = 4 };   /* ring.Outcome OK, TIMEOUT, ERROR, BREAKER_SKIP */

/* One proxy's view of one region, in the proxy's process: the ring, its counters block,
 * and the rounds it has taken. Filled by remote_dspark.ring.ProxyEnd; one thread uses it.
 * The proxy's whole critical path is two calls: hf_take, then (after the network)
 * hf_answer, which claims, writes, publishes and counts, so after a release only the
 * return to the proxy's loop stands between it and the wait for the next round. */
struct hf_proxy {
    struct hf_ring ring;
    uint64_t *heartbeat;          /* header word: CLOCK_MONOTONIC ns of the last take */
    uint64_t *counters;           /* the proxy counters block (word indexes below) */
    const uint64_t *bounds;       /* histogram bucket upper bounds (ns), ascending */
    uint64_t *seen_ns;            /* [depth], private: when each taken round was seen */
    uint64_t publish_timeout_ns;  /* how long to wait for the previous claimer's release */
    uint32_t n_bounds;            /* a histogram is n_bounds + 1 buckets, then the sum */
    uint32_t next;                /* the next round to take */
    uint32_t spin_us, nap_us;     /* hf_wait_geq's, for the wait for a round */
    uint32_t c_outcome[HF_PROXY_OUTCOMES];   /* rounds_ok .. rounds_breaker_skip */
    uint32_t c_late, c_drafts, c_draft_tokens;
    uint32_t h_round, h_handoff;  /* round_latency, handoff_latency histograms */
    uint32_t d_counts, d_entry_status, d_tokens, d_margins;   /* drafts slot offsets */
    uint32_t num_spec, max_slots;
};

/* The sizes of the structs Python mirrors with ctypes; the loader compares them. */
uint64_t hf_sizeof(int which)
{
    return which == 0 ? sizeof(struct hf_ring) : which == 1 ? sizeof(struct hf_proxy) : 0;
}

static void observe(const struct hf_proxy *p, uint32_t hist, uint64_t ns)
{
    uint32_t b = 0;
    while (b < p->n_bounds && p->bounds[b] < ns)
        b++;
    uint64_t *h = p->counters + hist;
    __atomic_fetch_add(&h[b], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&h[p->n_bounds + 1], ns, __ATOMIC_RELAXED);
}

static inline void count(const struct hf_proxy *p, uint32_t word, uint64_t n)
{
    __atomic_fetch_add(&p->counters[word], n, __ATOMIC_RELAXED);
}

/* Beat, then wait up to timeout_ns for the next gathered round nobody has claimed;
 * rounds another claimer answered meanwhile are skipped, never returned. Returns the
 * round id (0 .. 2^32-1), or -HF_TIMEOUT. */
int64_t hf_take(struct hf_proxy *p, uint64_t timeout_ns)
{
    uint64_t now = hf_now_ns(), deadline = now + timeout_ns;
    __atomic_store_n(p->heartbeat, now, __ATOMIC_RELEASE);
    for (;;) {
        uint32_t r = p->next;
        int rc = hf_wait_geq(p->ring.gathered, r, p->spin_us, p->nap_us, deadline);
        if (rc != HF_OK)
            return -(int64_t)rc;
        uint32_t claim = __atomic_load_n(p->ring.claim, __ATOMIC_ACQUIRE);
        if (cyc_geq(claim, r)) {
            p->next = claim + 1;
            continue;
        }
        p->seen_ns[r & (p->ring.depth - 1)] = hf_now_ns();
        p->next = r + 1;
        return r;
    }
}

/* Answer `round` with `status`: claim it, write its drafts slot, publish, count. With
 * `image` (status OK only) the drafts come from a private buffer shaped like a drafts
 * slot: n_entries and flags at d_zero, then counts, entry statuses, tokens and (flag
 * bit 0) margins at the slot's offsets; only the n entries' bytes are copied. Without
 * it the answer is empty. HF_LATE (counted rounds_late): another claimer answered it;
 * HF_TIMEOUT: claimed and written, but round - 1 was not released in time; HF_STATE: a
 * status that is not the proxy's, or an image with more entries than the slot holds. */
int hf_answer(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image)
{
    const struct hf_ring *ring = &p->ring;
    uint32_t n = 0, flags = 0, answered = 0;
    uint64_t tokens = 0;
    if (status >= HF_PROXY_OUTCOMES || (image && status != 0))
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
    uint64_t gathered = __atomic_load_n(&ring->gathered_ns[i], __ATOMIC_RELAXED);
    uint8_t *slot = ring->drafts + (uint64_t)i * ring->drafts_stride;
    if (image) {
        uint64_t row = 4u * (uint64_t)n, grid = row * p->num_spec;
        memcpy(slot + ring->d_zero, image + ring->d_zero, 8);
        memcpy(slot + p->d_counts, image + p->d_counts, row);
        memcpy(slot + p->d_entry_status, image + p->d_entry_status, row);
        memcpy(slot + p->d_tokens, image + p->d_tokens, grid);
        if (flags & 1)
            memcpy(slot + p->d_margins, image + p->d_margins, grid);
        for (uint32_t e = 0; e < n; e++) {
            int32_t k;
            memcpy(&k, image + p->d_counts + 4u * e, 4);
            answered += k != 0;
            tokens += (uint64_t)(k > 0 ? k : 0);
        }
        __atomic_store_n((uint32_t *)(slot + ring->d_status), status, __ATOMIC_RELAXED);
        __atomic_store_n((uint32_t *)(slot + ring->d_round), round, __ATOMIC_RELAXED);
    } else {
        hf_zero_drafts(ring, round, status);
    }
    rc = hf_publish(ring->released, round, hf_now_ns() + p->publish_timeout_ns);
    if (rc != HF_OK)
        return rc;
    uint64_t now = hf_now_ns(), seen = p->seen_ns[i];
    count(p, p->c_outcome[status], 1);
    if (seen && seen <= now)
        observe(p, p->h_round, now - seen);
    if (gathered && gathered <= seen)
        observe(p, p->h_handoff, seen - gathered);
    p->seen_ns[i] = 0;
    if (answered) {
        count(p, p->c_drafts, answered);
        count(p, p->c_draft_tokens, tokens);
    }
    return HF_OK;
}

/* ------------------------------------------------------------------ the watchdog */

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
