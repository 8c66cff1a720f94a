/* hostflag.c: the hand-off primitives shared by the engine and the proxy process.
 *
 * Thin on purpose: plain integers, pointers and status codes in and out. The region's
 * layout is not known here; Python (remote_dspark.shm) computes it once and passes the
 * addresses of the words and the geometry of the drafts slots (struct hf_ring). The one
 * exception is hf_round, the proxy's round on a TCP socket, with its descriptor check
 * and DRAFTS reader (hf_check_desc, hf_unpack: the same code, for a proxy whose network
 * round is in Python): they know the wire's frame formats (remote_dspark/wire.py,
 * protocol 3) and where a descriptor keeps the ROUND payload (shm.DESC_FIXED);
 * tests/test_tcp_round.py checks both against the Python side.
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
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HF_ABI 10

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

/* The engine's row gather on the CPU: dst[i] = src row idx[i] (row_bytes each), for
 * i < n. A plain copy loop on the calling thread: the engine's copies must not fan out
 * to a thread pool competing with the proxy and the worker for the cores. Returns n, or
 * the first i whose index is outside 0..src_rows-1 (rows before it are copied). */
uint32_t hf_gather_rows(uint8_t *dst, const uint8_t *src, uint64_t src_stride, uint64_t src_rows,
                        const int64_t *idx, uint32_t n, uint32_t row_bytes)
{
    for (uint32_t i = 0; i < n; i++) {
        if (idx[i] < 0 || (uint64_t)idx[i] >= src_rows)
            return i;
        memcpy(dst + (uint64_t)i * row_bytes, src + (uint64_t)idx[i] * src_stride, row_bytes);
    }
    return n;
}

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

/* ------------------------------------------------------------------ sleeping when idle
 *
 * The wake words, adjacent in the region's words page: wake[0] `published`, the last
 * round the engine's CPU handed over (written before the stream, or the CPU stand-in,
 * writes `gathered`), and wake[1] `sleeping`, 1 while the proxy sleeps on `published`.
 * Both sides use sequentially consistent accesses in the order that loses no wake-up:
 * the engine stores published then loads sleeping; the proxy stores sleeping then loads
 * published. One of them sees the other's store: the engine wakes a sleeper, or the
 * proxy sees the new round and does not sleep (and FUTEX_WAIT itself re-checks the
 * word). The futex is shared (no FUTEX_PRIVATE_FLAG): both processes map the memfd. */

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout)
{
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

/* Engine: round `round` is handed over; wake the proxy only if it said it sleeps (a
 * store and a load on the fast path, a syscall only on a wake-up). */
void hf_announce(uint32_t *wake, uint32_t round)
{
    __atomic_store_n(&wake[0], round, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake[1], __ATOMIC_SEQ_CST))
        futex(&wake[0], FUTEX_WAKE, INT_MAX, NULL);
}

/* Sleep on `word` while it holds `seen`, until deadline_ns at the latest. */
static void futex_sleep(uint32_t *word, uint32_t seen, uint64_t deadline_ns)
{
    uint64_t now = hf_now_ns();
    if (now >= deadline_ns)
        return;
    uint64_t left = deadline_ns - now;
    struct timespec ts = {(time_t)(left / 1000000000u), (long)(left % 1000000000u)};
    futex(word, FUTEX_WAIT, seen, &ts);   /* woken, changed (EAGAIN), timed out or EINTR */
}

/* Proxy: announce, re-check, sleep until a round is handed over (or deadline_ns). */
static void sleep_until_published(uint32_t *wake, uint32_t seen, uint64_t deadline_ns)
{
    __atomic_store_n(&wake[1], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake[0], __ATOMIC_SEQ_CST) == seen)
        futex_sleep(&wake[0], seen, deadline_ns);
    __atomic_store_n(&wake[1], 0, __ATOMIC_RELAXED);
}

/* A standby proxy: sleep while *word is not `me` (its pid), until deadline_ns; the
 * word's value. The supervisor promotes a standby by storing its pid there and waking
 * it (hf_wake); a pid, not a flag, so the word never needs resetting for the next one. */
uint32_t hf_standby_wait(uint32_t *word, uint32_t me, uint64_t deadline_ns)
{
    uint32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (v != me) {
        futex_sleep(word, v, deadline_ns);
        v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    }
    return v;
}

/* Store `value` into a futex word and wake whoever sleeps on it. */
void hf_wake(uint32_t *word, uint32_t value)
{
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

/* hf_wait_geq, and the CLOCK_MONOTONIC time of the look that ended it in *seen_ns. */
int hf_wait_at(const uint32_t *word, uint32_t value, uint32_t spin_us, uint32_t nap_us,
               uint64_t deadline_ns, uint64_t *seen_ns)
{
    int rc = hf_wait_geq(word, value, spin_us, nap_us, deadline_ns);
    *seen_ns = hf_now_ns();
    return rc;
}

/* Stream side on the CPU: announce the round (`wake`, may be NULL), record when,
 * publish `gathered = round`. */
void hf_signal(uint32_t *gathered, uint64_t *gathered_ns, uint32_t round, uint32_t *wake)
{
    if (wake)
        hf_announce(wake, round);
    if (gathered_ns)
        __atomic_store_n(gathered_ns, hf_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(gathered, round, __ATOMIC_RELEASE);
}

/* One CPU hand-off: signal, then wait for `released >= round`. out_ns[0] is taken just
 * before the store of gathered, out_ns[1] just after released was seen, both here, so
 * the caller's wait for its GIL afterwards is not part of the measure. */
int hf_handoff(uint32_t *gathered, uint64_t *gathered_ns, const uint32_t *released,
               uint32_t round, uint32_t spin_us, uint32_t nap_us, uint64_t deadline_ns,
               uint64_t *out_ns, uint32_t *wake)
{
    if (wake)
        hf_announce(wake, round);
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
 * and the rounds it has taken. Filled by remote_dspark.ring_proxy.ProxyEnd; one thread uses it.
 * The proxy's whole critical path is two calls: hf_take, then (after the network)
 * hf_answer, which claims, writes, publishes and counts, so after a release only the
 * return to the proxy's loop stands between it and the wait for the next round. */
struct hf_proxy {
    struct hf_ring ring;
    uint64_t *heartbeat;          /* header word: CLOCK_MONOTONIC ns of the last take */
    uint64_t *counters;           /* the proxy counters block (word indexes below) */
    const uint64_t *bounds;       /* histogram bucket upper bounds (ns), ascending */
    uint64_t *seen_ns;            /* [depth], private: when each taken round was seen */
    uint32_t *stamps;             /* [max_slots], private: the check that last saw each slot */
    uint64_t publish_timeout_ns;  /* how long to wait for the previous claimer's release */
    uint32_t n_bounds;            /* a histogram is n_bounds + 1 buckets, then the sum */
    uint32_t next;                /* the next round to take */
    uint32_t spin_us, nap_us;     /* hf_wait_geq's, for the wait for a round */
    uint32_t c_outcome[HF_PROXY_OUTCOMES];   /* rounds_ok .. rounds_breaker_skip */
    uint32_t c_late, c_drafts, c_draft_tokens;
    uint32_t h_round, h_handoff;  /* round_latency, handoff_latency histograms */
    uint32_t d_counts, d_entry_status, d_tokens, d_margins;   /* drafts slot offsets */
    uint32_t num_spec, max_slots;
    uint32_t c_bad_desc;          /* rounds_bad_desc */
    uint32_t stamp_gen;           /* the last descriptor check's stamp (0: none yet) */
    uint32_t vocab_size;          /* the engine's vocabulary (HELLO's): token ids 0..vocab_size-1; 0 unknown */
    uint32_t want_margin;         /* 1: HELLO asked for margins, so every DRAFTS carries them */
    uint32_t *wake;               /* the wake words [published, sleeping], or NULL: never sleep */
    uint32_t idle;                /* private: the last wait ended asleep, with nothing handed over */
};

/* One proxy's connection to the worker, for hf_round: the proxy's whole round in C.
 * Python connects and says HELLO, then hands the socket over and reads nothing more
 * from it; it sets fd, send and at_once(_max) before each call and reads the results after.
 * The receive state lives here across calls, so a reply that comes after its round's
 * deadline stays in step (and is dropped as late) instead of breaking the stream. */
struct hf_link {
    const uint8_t *desc;          /* descriptor 0 (the ROUND payload but its rows is sent from it) */
    const uint8_t *staging;       /* staging slot 0 (the rows are sent from it) */
    uint8_t *image;               /* the proxy's private drafts image, hf_answer's */
    uint8_t *rx;                  /* the DRAFTS payload buffer, rx_cap bytes */
    uint64_t desc_stride, staging_stride;
    uint64_t session;             /* the proxy's session, in every ROUND header */
    uint32_t row_bytes, max_tokens;
    uint32_t rx_cap;              /* the largest DRAFTS payload the wire allows */
    uint32_t max_entries, max_n_out;   /* wire caps of a DRAFTS frame */
    uint32_t default_deadline_ms; /* a descriptor's deadline 0 means this */
    int32_t fd;                   /* the worker connection (HELLO done, non-blocking), or -1 */
    uint32_t send;                /* 1: the breaker lets this round use the network */
    uint32_t at_once;             /* the status of a round answered without the network */
    uint32_t at_once_max;         /* how many such rounds one call may answer */
    uint32_t got;                 /* bytes of the current reply frame read (header, payload) */
    uint8_t hdr[24];              /* the current reply frame's header */
    uint32_t served;              /* results: the rounds answered, */
    uint32_t round;               /* the last one, */
    uint32_t late;                /* replies to earlier rounds dropped, */
    uint32_t sent;                /* 1 when the round went on the network, */
    int32_t answer;               /* hf_answer's status (HF_LATE: another claimer was first), */
    int32_t err;                  /* errno of a failed send or receive, */
    uint64_t net_ns;              /* the time from the send to the reply or giving up, */
    char why[200];                /* and what broke (any event but OK and AT_ONCE). */
};

/* The sizes of the structs Python mirrors with ctypes; the loader compares them. */
uint64_t hf_sizeof(int which)
{
    return which == 0 ? sizeof(struct hf_ring) : which == 1 ? sizeof(struct hf_proxy)
         : which == 2 ? sizeof(struct hf_link) : 0;
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

/* Wait until round r is gathered, or deadline. Spin spin_us; then nap nap_us between
 * looks when nap_us > 0; with nap_us == 0 sleep on `published` once nothing is handed
 * over beyond what was served. While a round is handed over but not gathered yet (the
 * stream is a step behind the CPU), never sleep: keep spinning, however long. */
static int wait_round(struct hf_proxy *p, uint32_t r, uint64_t deadline)
{
    if (p->nap_us || !p->wake)
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
            p->idle = 0;    /* handed over, not gathered yet: spin, never sleep */
        } else {
            if (hf_now_ns() >= deadline)
                return HF_TIMEOUT;
            sleep_until_published(p->wake, published, deadline);
            p->idle = !cyc_geq(__atomic_load_n(&p->wake[0], __ATOMIC_ACQUIRE), r);
        }
        if (hf_now_ns() >= deadline)
            return cyc_geq(__atomic_load_n(p->ring.gathered, __ATOMIC_ACQUIRE), r) ? HF_OK : HF_TIMEOUT;
    }
}

/* Beat, then wait up to timeout_ns for the next gathered round nobody has claimed;
 * rounds another claimer answered meanwhile are skipped, never returned. Returns the
 * round id (0 .. 2^32-1) and when it was seen in *seen, or -HF_TIMEOUT. */
static int64_t take(struct hf_proxy *p, uint64_t timeout_ns, uint64_t *seen)
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

/* take, for a caller that answers with hf_answer: the seen time is kept for it. */
int64_t hf_take(struct hf_proxy *p, uint64_t timeout_ns)
{
    uint64_t seen = 0;
    int64_t r = take(p, timeout_ns, &seen);
    if (r >= 0)
        p->seen_ns[r & (p->ring.depth - 1)] = seen;
    return r;
}

/* Publish `round`; the clock is read (for hf_publish's wait) only when round - 1 is not
 * released yet, so the common case between seeing a round and releasing it touches
 * nothing but the ring's words. */
static int publish_within(uint32_t *released, uint32_t round, uint64_t timeout_ns)
{
    if (__atomic_load_n(released, __ATOMIC_ACQUIRE) == round - 1) {
        __atomic_store_n(released, round, __ATOMIC_RELEASE);
        return HF_OK;
    }
    return hf_publish(released, round, hf_now_ns() + timeout_ns);
}

/* Answer `round` with `status`: claim it, write its drafts slot, publish, count. With
 * `image` (status OK only) the drafts come from a private buffer shaped like a drafts
 * slot: n_entries and flags at d_zero, then counts, entry statuses, tokens and (flag
 * bit 0) margins at the slot's offsets; only the n entries' bytes are copied. Without
 * it the answer is empty. HF_LATE (counted rounds_late): another claimer answered it;
 * HF_TIMEOUT: claimed and written, but round - 1 was not released in time; HF_STATE: a
 * status that is not the proxy's, or an image with more entries than the slot holds. */
static int answer(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image,
                  uint64_t seen)
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
    uint8_t *slot = ring->drafts + (uint64_t)i * ring->drafts_stride;
    if (image) {
        uint64_t row = 4u * (uint64_t)n, grid = row * p->num_spec;
        memcpy(slot + ring->d_zero, image + ring->d_zero, 8);
        memcpy(slot + p->d_counts, image + p->d_counts, row);
        memcpy(slot + p->d_entry_status, image + p->d_entry_status, row);
        memcpy(slot + p->d_tokens, image + p->d_tokens, grid);
        if (flags & 1)
            memcpy(slot + p->d_margins, image + p->d_margins, grid);
        __atomic_store_n((uint32_t *)(slot + ring->d_status), status, __ATOMIC_RELAXED);
        __atomic_store_n((uint32_t *)(slot + ring->d_round), round, __ATOMIC_RELAXED);
    } else {
        hf_zero_drafts(ring, round, status);
    }
    rc = publish_within(ring->released, round, p->publish_timeout_ns);
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

/* answer, for a caller that took the round with hf_take. */
int hf_answer(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image)
{
    uint64_t *seen = &p->seen_ns[round & (p->ring.depth - 1)];
    int rc = answer(p, round, status, image, *seen);
    if (rc == HF_OK)
        *seen = 0;
    return rc;
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
        rc = hf_publish(ring->released, rel + 1, hf_now_ns() + 1000000000u);
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

/* ------------------------------------------------------------------ the proxy's round on TCP */

/* What hf_round did with the round it took (ring.RoundEvent mirrors these). */
enum { HF_EV_OK, HF_EV_AT_ONCE, HF_EV_TIMEOUT, HF_EV_LOST, HF_EV_PROTOCOL, HF_EV_BAD_REPLY,
       HF_EV_BAD_DESC };

/* The wire contract's fixed parts (remote_dspark/wire.py, protocol 3): the header, the
 * fixed parts of ROUND and DRAFTS, and where a descriptor keeps the ROUND payload
 * (shm.DESC_FIXED). W_MAX_PAYLOAD is wire.MAX_PAYLOAD, the cap a ROUND must keep. */
enum { W_HEADER = 24, W_VERSION = 3, W_ROUND = 3, W_DRAFTS = 4, W_BYE = 5,
       W_ROUND_FIXED = 16, W_DRAFTS_FIXED = 8, W_NEW_GEN = 1, W_MARGINS = 1, W_RESYNC = 1,
       DESC_FIXED = 8 };
#define W_MAX_PAYLOAD (64ull << 20)
enum { ST_OK = 0, ST_TIMEOUT = 1, ST_ERROR = 2 };   /* ring.Outcome */

static uint32_t get32(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static uint16_t get16(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

/* Bytes of a ROUND's fixed part and entry arrays (wire.round_meta_bytes). */
static inline uint64_t round_meta(uint32_t n) { return W_ROUND_FIXED + 4u * (5u * (uint64_t)n + 1); }

/* A checked descriptor: the ROUND's fixed fields and where its arrays are. */
struct round_view {
    const uint8_t *payload;       /* the ROUND payload (descriptor + DESC_FIXED) */
    uint32_t deadline_ms, n, row_bytes, n_tokens;
    const uint8_t *slots, *positions, *n_out, *flags, *offsets;
};

/* Record what broke (l->why, l->err) and return `event`. */
static int fail(struct hf_link *l, int event, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(struct hf_link *l, int event, int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof l->why, fmt, ap);
    va_end(ap);
    l->err = err;
    return event;
}

/* Wait for `events` on fd until deadline_ns: 1 ready (or in error: the next call says
 * which), 0 deadline, -1 poll failed (errno). */
static int ready(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = hf_now_ns();
        if (now >= deadline_ns)
            return 0;
        uint64_t left = deadline_ns - now;
        struct timespec ts = { (time_t)(left / 1000000000u), (long)(left % 1000000000u) };
        struct pollfd pfd = { fd, events, 0 };
        int rc = ppoll(&pfd, 1, &ts, NULL);
        if (rc > 0)
            return 1;
        if (rc < 0 && errno != EINTR)
            return -1;
    }
}

/* Send the ROUND frame: the header, the descriptor's block (fixed part, entry arrays,
 * tokens) and the staging rows, straight from the region. A frame cannot be taken back
 * once in part on the wire, so a send that cannot finish by the round's deadline loses
 * the connection. */
static int send_round(struct hf_link *l, uint32_t round, uint32_t index, const struct round_view *v,
                      uint64_t deadline_ns)
{
    uint64_t block = round_meta(v->n) + 4u * (uint64_t)v->n_tokens, rows = (uint64_t)v->n * l->row_bytes;
    uint32_t len = (uint32_t)(block + rows), version = W_VERSION | (W_ROUND << 16);
    uint8_t hdr[W_HEADER];
    memcpy(hdr, "DSPW", 4);
    memcpy(hdr + 4, &version, 4);
    memcpy(hdr + 8, &len, 4);
    memcpy(hdr + 12, &l->session, 8);
    memcpy(hdr + 20, &round, 4);
    struct iovec iov[3] = {
        { hdr, W_HEADER },
        { (void *)v->payload, block },
        { (void *)(l->staging + (uint64_t)index * l->staging_stride), rows },
    };
    struct msghdr msg = { .msg_iov = iov, .msg_iovlen = 3 };
    for (;;) {
        while (msg.msg_iovlen && msg.msg_iov->iov_len == 0) {
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (!msg.msg_iovlen)
            return HF_EV_OK;
        ssize_t k = sendmsg(l->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = ready(l->fd, POLLOUT, deadline_ns);
            if (w > 0)
                continue;
            if (w == 0)
                return fail(l, HF_EV_LOST, 0, "send of round %u stalled past its deadline", round);
        }
        if (k < 0)
            return fail(l, HF_EV_LOST, errno, "send failed: %s", strerror(errno));
        for (size_t sent = (size_t)k; sent; ) {
            size_t take = sent < msg.msg_iov->iov_len ? sent : msg.msg_iov->iov_len;
            msg.msg_iov->iov_base = (uint8_t *)msg.msg_iov->iov_base + take;
            msg.msg_iov->iov_len -= take;
            sent -= take;
            if (msg.msg_iov->iov_len == 0) {
                msg.msg_iov++;
                msg.msg_iovlen--;
            }
        }
    }
}

/* Read the current frame up to `want` bytes (header, then payload into rx): spin on the
 * socket until spin_until_ns, then poll. 1 done, 0 deadline (what was read is kept),
 * or -HF_EV_LOST. */
static int fill(struct hf_link *l, uint32_t want, uint64_t deadline_ns, uint64_t spin_until_ns)
{
    while (l->got < want) {
        int in_header = l->got < W_HEADER;
        uint8_t *dst = in_header ? l->hdr + l->got : l->rx + (l->got - W_HEADER);
        size_t room = (in_header ? W_HEADER : want) - l->got;
        ssize_t k = recv(l->fd, dst, room, MSG_DONTWAIT);
        if (k > 0) {
            l->got += (uint32_t)k;
            continue;
        }
        if (k == 0)
            return -fail(l, HF_EV_LOST, 0, "the worker closed the connection");
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -fail(l, HF_EV_LOST, errno, "receive failed: %s", strerror(errno));
        if (hf_now_ns() < spin_until_ns) {
            cpu_relax();
            continue;
        }
        int w = ready(l->fd, POLLIN, deadline_ns);
        if (w == 0)
            return 0;
        if (w < 0)
            return -fail(l, HF_EV_LOST, errno, "poll failed: %s", strerror(errno));
    }
    return 1;
}

/* Wait for the DRAFTS of `round` (dropping, and counting, replies to earlier rounds);
 * its payload is then in rx and its length in *len. */
static int recv_reply(struct hf_link *l, uint32_t round, uint64_t deadline_ns,
                      uint64_t spin_until_ns, uint32_t *len)
{
    for (;;) {
        int rc = fill(l, W_HEADER, deadline_ns, spin_until_ns);
        if (rc <= 0)
            return rc == 0 ? HF_EV_TIMEOUT : -rc;
        uint16_t version = get16(l->hdr + 4), type = get16(l->hdr + 6);
        uint32_t plen = get32(l->hdr + 8), of = get32(l->hdr + 20);
        uint64_t session;
        memcpy(&session, l->hdr + 12, 8);
        if (memcmp(l->hdr, "DSPW", 4) != 0)
            return fail(l, HF_EV_PROTOCOL, 0, "bad magic %02x%02x%02x%02x", l->hdr[0], l->hdr[1],
                        l->hdr[2], l->hdr[3]);
        if (version != W_VERSION)
            return fail(l, HF_EV_PROTOCOL, 0, "protocol version %u, this side speaks %u", version,
                        W_VERSION);
        if (type == W_BYE)
            return fail(l, HF_EV_LOST, 0, "the worker said BYE");
        if (type != W_DRAFTS)
            return fail(l, HF_EV_PROTOCOL, 0, "frame type %u where DRAFTS was expected", type);
        /* Mirrors client.DraftClient.recv_drafts: a reply of another session is never this
         * round's, nor a late one of this connection's. */
        if (session != l->session)
            return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS of session %#llx on session %#llx's connection",
                        (unsigned long long)session, (unsigned long long)l->session);
        if (plen > l->rx_cap)
            return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes exceeds the cap %u", plen,
                        l->rx_cap);
        rc = fill(l, W_HEADER + plen, deadline_ns, spin_until_ns);
        if (rc <= 0)
            return rc == 0 ? HF_EV_TIMEOUT : -rc;
        l->got = 0;
        if (of == round) {
            *len = plen;
            return HF_EV_OK;
        }
        if (cyc_geq(of, round))
            return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS for round %u, which was never sent", of);
        l->late++;
    }
}

/* Check round `round`'s descriptor before a byte of it is sent or trusted: its
 * metadata may have been written by a GPU stream the host never checked. The rules are
 * the wire's (wire.decode_round) plus the region's (its slot range and sizes) and the
 * receiver's (unique slots). HF_EV_OK with *v filled, or HF_EV_BAD_DESC naming the field
 * and entry in l->why. */
static int check_desc(struct hf_proxy *p, struct hf_link *l, uint32_t round, struct round_view *v)
{
    uint32_t index = round & (p->ring.depth - 1);
    const uint8_t *d = l->desc + (uint64_t)index * l->desc_stride, *f = d + DESC_FIXED;
    uint32_t of = get32(d);
    v->payload = f;
    v->deadline_ms = get32(f);
    v->n = get32(f + 4);
    v->row_bytes = get32(f + 8);
    v->n_tokens = get32(f + 12);
    if (of != round)
        return fail(l, HF_EV_BAD_DESC, 0, "descriptor %u holds round %u, not round %u", index, of, round);
    if (v->n > p->max_slots)
        return fail(l, HF_EV_BAD_DESC, 0, "n_entries %u over max_slots=%u", v->n, p->max_slots);
    if (v->row_bytes != l->row_bytes)
        return fail(l, HF_EV_BAD_DESC, 0, "row_bytes %u, the layout's is %u", v->row_bytes, l->row_bytes);
    if (v->n_tokens > l->max_tokens)
        return fail(l, HF_EV_BAD_DESC, 0, "n_tokens %u over max_tokens=%u", v->n_tokens, l->max_tokens);
    uint64_t size = round_meta(v->n) + 4u * (uint64_t)v->n_tokens + (uint64_t)v->n * v->row_bytes;
    if (size > W_MAX_PAYLOAD)
        return fail(l, HF_EV_BAD_DESC, 0, "ROUND of %llu bytes over the cap %llu",
                    (unsigned long long)size, (unsigned long long)W_MAX_PAYLOAD);
    uint64_t n4 = 4u * (uint64_t)v->n;
    v->slots = f + W_ROUND_FIXED;
    v->positions = v->slots + n4;
    v->n_out = v->positions + n4;
    v->flags = v->n_out + n4;
    v->offsets = v->flags + n4;
    uint32_t first = get32(v->offsets), last = get32(v->offsets + n4);
    if (first != 0 || last != v->n_tokens)
        return fail(l, HF_EV_BAD_DESC, 0, "offsets run from %u to %u, expected 0 to n_tokens=%u",
                    first, last, v->n_tokens);
    /* Unique slots without clearing anything: a slot is taken in this check when its stamp
     * holds this check's number. Numbers are the proxy's own count of checks, not round
     * ids: a fresh array is zeros (round 0) and round ids recur; on the count's wrap the
     * array is cleared once. */
    uint32_t gen = ++p->stamp_gen;
    if (gen == 0) {
        memset(p->stamps, 0, 4u * (uint64_t)p->max_slots);
        gen = p->stamp_gen = 1;
    }
    for (uint32_t e = 0; e < v->n; e++) {
        uint32_t slot = get32(v->slots + 4u * e), n_out = get32(v->n_out + 4u * e);
        uint32_t flags = get32(v->flags + 4u * e), at = get32(v->offsets + 4u * e);
        uint32_t next = get32(v->offsets + 4u * (e + 1));
        if (next < at)
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: offsets go back (%u, then %u)", e, at, next);
        if (slot >= p->max_slots)
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: slot %u not below max_slots=%u", e, slot,
                        p->max_slots);
        if (p->stamps[slot] == gen)
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: slot %u twice in the round", e, slot);
        p->stamps[slot] = gen;
        if (n_out > p->num_spec)
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: n_out %u over num_spec=%u", e, n_out,
                        p->num_spec);
        if (flags & ~(uint32_t)W_NEW_GEN)
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: flags %#x, only NEW_GEN (1) is known", e, flags);
    }
    /* Token ids in the engine's vocabulary, when it is known: batch.host_meta's rule, for
     * metadata written on the device that no host ever read (batch.write_meta_in_stream). */
    if (p->vocab_size) {
        const uint8_t *tokens = f + round_meta(v->n);
        for (uint32_t j = 0; j < v->n_tokens; j++) {
            int32_t t = (int32_t)get32(tokens + 4u * j);
            if (t < 0 || (uint32_t)t >= p->vocab_size)
                return fail(l, HF_EV_BAD_DESC, 0, "tokens: %d (token %u) outside 0..%u, the vocabulary", t, j,
                            p->vocab_size - 1);
        }
    }
    return HF_EV_OK;
}

/* Copy entry rows of `width` 32-bit values into rows of K, `count` values each and the
 * rest zero, so the engine may copy the whole block. One memcpy when the rows are full. */
static void widen(uint8_t *dst, const uint8_t *src, const uint8_t *counts, uint32_t n,
                  uint32_t width, uint32_t K, int full)
{
    if (full) {
        memcpy(dst, src, 4u * (uint64_t)n * K);
        return;
    }
    for (uint32_t e = 0; e < n; e++) {
        uint64_t k = get16(counts + 2u * e);
        uint8_t *row = dst + 4u * (uint64_t)K * e;
        memcpy(row, src + 4u * (uint64_t)width * e, 4u * k);
        memset(row + 4u * k, 0, 4u * (K - k));
    }
}

/* What a reply's entries must be beyond the frame's own rules, checked before anything
 * is delivered. THE RULE HAS A PYTHON TWIN: remote_dspark/engine/reply.py (check_reply,
 * sync mode) makes the same checks in the same order with the same words, and
 * tests/test_reply_check.py runs the same replies through both and holds their verdicts
 * equal. Per entry, in order: count <= the round's n_out; a RESYNC entry has no drafts;
 * every counted token in 0..vocab_size-1 (0..INT32_MAX when the vocabulary is unknown);
 * with margins, every counted margin in [0, 1] (NaN fails both comparisons). */
static int check_entries(struct hf_link *l, const struct hf_proxy *p, const struct round_view *v,
                         uint32_t n, uint32_t width, const uint8_t *counts, const uint8_t *statuses,
                         const uint8_t *tokens, const uint8_t *margins)
{
    int64_t top = p->vocab_size ? (int64_t)p->vocab_size - 1 : INT32_MAX;
    for (uint32_t e = 0; e < n; e++) {
        uint32_t c = get16(counts + 2u * e), n_out = get32(v->n_out + 4u * e);
        uint64_t row = (uint64_t)width * e;
        if (c > n_out)
            return fail(l, HF_EV_PROTOCOL, 0, "entry %u: %u drafts, the round asked for %u", e, c, n_out);
        if (c && get16(statuses + 2u * e) == W_RESYNC)
            return fail(l, HF_EV_PROTOCOL, 0, "entry %u: RESYNC with %u drafts", e, c);
        for (uint32_t j = 0; j < c; j++) {
            int32_t t = (int32_t)get32(tokens + 4u * (row + j));
            if (t < 0 || t > top)
                return fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft token %d outside 0..%lld", e, t,
                            (long long)top);
        }
        for (uint32_t j = 0; margins && j < c; j++) {
            float m;
            memcpy(&m, margins + 4u * (row + j), 4);
            if (!(m >= 0.0f && m <= 1.0f))   /* printed as Python prints it: NaN unsigned */
                return fail(l, HF_EV_PROTOCOL, 0, "entry %u: margin %g not in [0, 1]", e,
                            m != m ? (double)NAN : (double)m);
        }
    }
    return HF_EV_OK;
}

/* Check the DRAFTS payload in rx (the wire's rules, then against round view v and what
 * the session asked: check_entries) and write it into the drafts image: counts and
 * statuses as i32, each row widened to num_spec. */
static int unpack_drafts(struct hf_link *l, const struct hf_proxy *p, const struct round_view *v,
                         uint32_t len)
{
    const uint8_t *b = l->rx;
    if (len > l->rx_cap)
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes exceeds the cap %u", len, l->rx_cap);
    if (len < W_DRAFTS_FIXED)
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes, under %u", len, W_DRAFTS_FIXED);
    uint32_t n = get32(b), width = get16(b + 4), flags = get16(b + 6), K = p->num_spec;
    if (n > l->max_entries || width > l->max_n_out)
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS of %u entries x %u over the caps", n, width);
    if (flags & ~(uint32_t)W_MARGINS)
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS unknown flags %#x", flags);
    uint64_t grid = 4u * (uint64_t)n * width;
    const uint8_t *slots = b + W_DRAFTS_FIXED, *counts = slots + 4u * (uint64_t)n;
    const uint8_t *statuses = counts + 2u * (uint64_t)n, *tokens = statuses + 2u * (uint64_t)n;
    uint64_t want = (uint64_t)(tokens - b) + grid * ((flags & W_MARGINS) ? 2 : 1);
    if (len != want)
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes, its fields say %llu", len,
                    (unsigned long long)want);
    int full = width == K;
    for (uint32_t e = 0; e < n; e++) {
        uint32_t c = get16(counts + 2u * e), st = get16(statuses + 2u * e);
        if (c > width || st > W_RESYNC)
            return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS entry %u: count %u (width %u), status %u", e, c,
                        width, st);
        full &= c == width;
    }
    if (n != v->n)
        return fail(l, HF_EV_BAD_REPLY, 0, "drafts for %u entries, the round has %u", n, v->n);
    if (memcmp(slots, v->slots, 4u * (uint64_t)n) != 0)
        for (uint32_t e = 0; e < n; e++)
            if (get32(slots + 4u * e) != get32(v->slots + 4u * e))
                return fail(l, HF_EV_BAD_REPLY, 0, "entry %u: drafts for slot %u, the round has slot %u",
                            e, get32(slots + 4u * e), get32(v->slots + 4u * e));
    /* From here the reply breaks what the session asked (HELLO) or what the round asked:
     * a protocol error (the connection is dropped), as in engine/reply.py. */
    if (width > K)
        return fail(l, HF_EV_PROTOCOL, 0, "drafts width %u over num_spec=%u", width, K);
    if (!(flags & W_MARGINS) != !p->want_margin)
        return fail(l, HF_EV_PROTOCOL, 0, p->want_margin ? "DRAFTS without margins, the session asked for them"
                                                          : "DRAFTS with margins, the session did not ask for them");
    int event = check_entries(l, p, v, n, width, counts, statuses, tokens,
                              (flags & W_MARGINS) ? tokens + grid : NULL);
    if (event != HF_EV_OK)
        return event;
    uint8_t *img = l->image;
    memcpy(img + p->ring.d_zero, &n, 4);
    memcpy(img + p->ring.d_zero + 4, &flags, 4);
    for (uint32_t e = 0; e < n; e++) {
        int32_t c = get16(counts + 2u * e), st = get16(statuses + 2u * e);
        memcpy(img + p->d_counts + 4u * e, &c, 4);
        memcpy(img + p->d_entry_status + 4u * e, &st, 4);
    }
    widen(img + p->d_tokens, tokens, counts, n, width, K, full);
    if (flags & W_MARGINS)
        widen(img + p->d_margins, tokens + grid, counts, n, width, K, full);
    return HF_EV_OK;
}

/* Check `round`'s descriptor (check_desc) for a caller that sends the round itself (the
 * ofl transports): HF_EV_OK, or HF_EV_BAD_DESC with l->why. Counts nothing. */
int hf_check_desc(struct hf_proxy *p, struct hf_link *l, uint32_t round)
{
    struct round_view v;
    l->why[0] = 0;
    return check_desc(p, l, round, &v);
}

/* hf_round's reader of a DRAFTS reply, for a caller that received it itself: the `len`
 * bytes of payload in l->rx are checked against `round`'s descriptor (checked again
 * first) and written into l->image for hf_answer. HF_EV_OK, or HF_EV_BAD_DESC,
 * HF_EV_PROTOCOL or HF_EV_BAD_REPLY with l->why. Counts nothing. */
int hf_unpack(struct hf_proxy *p, struct hf_link *l, uint32_t round, uint32_t len)
{
    struct round_view v;
    l->why[0] = 0;
    int event = check_desc(p, l, round, &v);
    return event == HF_EV_OK ? unpack_drafts(l, p, &v, len) : event;
}

static void clear_results(struct hf_link *l)
{
    l->late = l->sent = 0;
    l->err = 0;
    l->net_ns = 0;
    l->why[0] = 0;
}

/* One round: take the next (as hf_take), send it and wait for its DRAFTS when the link
 * has a connection and `send` is set, answer it (as hf_answer). The result fields are
 * only touched once a round is taken. */
static int64_t round_once(struct hf_proxy *p, struct hf_link *l, uint64_t idle_ns)
{
    int fd = l->fd, send = fd >= 0 && l->send;   /* read before the wait, not after */
    uint32_t status = l->at_once;
    uint64_t seen = 0;
    int64_t taken = take(p, idle_ns, &seen);
    if (taken < 0)
        return taken;
    uint32_t round = (uint32_t)taken, index = round & (p->ring.depth - 1);
    int event = HF_EV_AT_ONCE;
    if (!send) {   /* nothing but the ring's words and the drafts slot before the release */
        int rc = answer(p, round, status, NULL, seen);
        clear_results(l);
        l->round = round;
        l->answer = rc;
        return event;
    }
    clear_results(l);
    struct round_view v;
    uint32_t len = 0;
    event = check_desc(p, l, round, &v);
    if (event == HF_EV_OK) {   /* a bad descriptor is not sent: answered ERROR at once */
        uint64_t t0 = hf_now_ns();
        uint32_t ms = v.deadline_ms ? v.deadline_ms : l->default_deadline_ms;
        uint64_t deadline = t0 + (uint64_t)ms * 1000000u;
        l->sent = 1;
        event = send_round(l, round, index, &v, deadline);
        if (event == HF_EV_OK)
            event = recv_reply(l, round, deadline, t0 + (uint64_t)p->spin_us * 1000u, &len);
        if (event == HF_EV_OK)
            event = unpack_drafts(l, p, &v, len);
        l->net_ns = hf_now_ns() - t0;
    }
    status = event == HF_EV_OK ? ST_OK : event == HF_EV_TIMEOUT ? ST_TIMEOUT : ST_ERROR;
    l->round = round;
    l->answer = answer(p, round, status, event == HF_EV_OK ? l->image : NULL, seen);
    /* After the release: bookkeeping never delays it. Only a round this call answered:
     * one the watchdog answered first may have had its descriptor reused meanwhile. */
    if (event == HF_EV_BAD_DESC && l->answer == HF_OK)
        count(p, p->c_bad_desc, 1);
    return event;
}

/* The proxy's round, without returning to the caller between a round's `gathered` and
 * its `released`. Returns -HF_TIMEOUT when no round came within idle_ns, else the
 * HF_EV_* of the last round served, with that round in l->round and hf_answer's status
 * in l->answer (HF_LATE: another claimer answered first, counted rounds_late). A round
 * not sent is answered with l->at_once; a failed one with TIMEOUT (no reply by its
 * deadline: the connection is kept) or ERROR.
 *
 * Rounds answered at once need nothing from the caller in between, so one call answers
 * up to l->at_once_max of them (l->served counts them) and returns at the first round
 * that is not, at an hf_answer failure, or once idle_ns have passed and no further
 * round is waiting. */
int64_t hf_round(struct hf_proxy *p, struct hf_link *l, uint64_t idle_ns)
{
    uint64_t end = hf_now_ns() + idle_ns;
    int64_t event = round_once(p, l, idle_ns);
    l->served = event >= 0;
    while (event == HF_EV_AT_ONCE && (l->answer == HF_OK || l->answer == HF_LATE)
           && l->served < l->at_once_max) {
        uint64_t now = hf_now_ns();
        int64_t next = round_once(p, l, now < end ? end - now : 0);
        if (next < 0)
            break;
        event = next;
        l->served++;
    }
    return event;
}
