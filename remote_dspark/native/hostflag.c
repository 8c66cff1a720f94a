/* hostflag.c: the hand-off primitives shared by the engine and the proxy process: the
 * ring's words, the CPU hand-off, the engine's sleep on `released`, the proxy's sleep
 * when idle, the standby's promotion, and the proxy's take and answer. The proxy's round
 * on a TCP socket is in tcp_round.c, the engine's watchdog thread in watchdog.c; what
 * the files share (the structs Python mirrors, the status codes) is in hostflag.h.
 *
 * Thin on purpose: plain integers, pointers and status codes in and out. The region's
 * layout is not known here; Python (remote_dspark.shm.layout) computes it once and
 * passes the addresses of the words and the geometry of the drafts slots (struct hf_ring).
 *
 * Memory ordering: sequence words are loaded with acquire and stored with release, the
 * claim word is a compare-and-swap, counters are relaxed fetch-adds. Everything a
 * claimer writes into a drafts slot is published by its store of `released` (release,
 * and sequentially consistent: see "the engine's sleep") and read by the engine after
 * its acquire load of that word.
 *
 * Sequence words are 32-bit and compared cyclically: a >= b iff (int32_t)(a - b) >= 0,
 * so a run may start near 2^32 and wrap (the ring depth is a power of two, so
 * round % depth stays continuous across the wrap).
 * *
 * Status codes: hostflag.h.
 */
#include "hostflag.h"

#include <math.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* Shared futexes (no FUTEX_PRIVATE_FLAG): both processes map the memfd region. */
static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout)
{
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

/* Sleep on `word` while it holds `seen`, until deadline_ns at the latest: FUTEX_WAIT's
 * result (0 woken; -1 and errno), or 0 at once when the deadline has passed. */
static long futex_sleep(uint32_t *word, uint32_t seen, uint64_t deadline_ns)
{
    uint64_t now = hf_now_ns();
    if (now >= deadline_ns)
        return 0;
    uint64_t left = deadline_ns - now;
    struct timespec ts = {(time_t)(left / 1000000000u), (long)(left % 1000000000u)};
    return futex(word, FUTEX_WAIT, seen, &ts);
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

/* ------------------------------------------------------------------ the engine's sleep
 *
 * The engine's CPU wait for `released` spins spin_us, then sleeps on `released` itself;
 * `waiters`, on its line, counts the engine threads asleep there. No wake-up is lost
 * (docs/design/shm.md, "Idle costs nothing"), every access sequentially consistent:
 *   releaser: store released = r;          then load waiters, FUTEX_WAKE if nonzero
 *   sleeper:  waiters += 1 (a full fence); then load released, FUTEX_WAIT(released, seen)
 * In their one total order the sleeper sees r, or the releaser sees the sleeper; and
 * FUTEX_WAIT sleeps only while the word still holds `seen` (else EAGAIN). */

/* Store `released = round` and wake the engine's sleepers, if any (a store and a load on
 * the fast path; the syscall only when a waiter said it sleeps). `waiters` NULL: none. */
static void release_store(uint32_t *released, uint32_t *waiters, uint32_t round)
{
    __atomic_store_n(released, round, __ATOMIC_SEQ_CST);
    if (waiters && __atomic_load_n(waiters, __ATOMIC_SEQ_CST))
        futex(released, FUTEX_WAKE, INT_MAX, NULL);
}

/* Sleep until *word >= value (cyclic) or deadline_ns, counted in *waiters. HF_OK,
 * HF_TIMEOUT, or HF_SYS (errno set): a futex error but EAGAIN, EINTR or ETIMEDOUT. */
static int sleep_geq(uint32_t *word, uint32_t *waiters, uint32_t value, uint64_t deadline_ns)
{
    int rc = HF_TIMEOUT;
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if (cyc_geq(seen, value)) {
            rc = HF_OK;
            break;
        }
        if (hf_now_ns() >= deadline_ns)
            break;
        if (futex_sleep(word, seen, deadline_ns) && errno != EAGAIN && errno != EINTR && errno != ETIMEDOUT) {
            rc = HF_SYS;
            break;
        }
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);   /* errno stays the futex's */
    return rc;
}

/* The engine's wait for `released >= value`: spin spin_us, then, with nap_us > 0, nap
 * between looks as hf_wait_geq does (ASYNC_NAP_US keeps its meaning), else sleep on the
 * futex until a releaser wakes it; deadline_ns bounds both. `waiters` NULL: hf_wait_geq. */
int hf_wait_released(uint32_t *released, uint32_t *waiters, uint32_t value, uint32_t spin_us, uint32_t nap_us,
                     uint64_t deadline_ns)
{
    if (nap_us || !waiters)
        return hf_wait_geq(released, value, spin_us, nap_us, deadline_ns);
    uint64_t spin_end = hf_now_ns() + (uint64_t)spin_us * 1000u;
    int rc = hf_wait_geq(released, value, 0, 0, spin_end < deadline_ns ? spin_end : deadline_ns);
    if (rc != HF_TIMEOUT)
        return rc;
    return sleep_geq(released, waiters, value, deadline_ns);
}

/* ------------------------------------------------------------------ sleeping when idle
 *
 * The wake words, adjacent in the region's words page: wake[0] `published`, the last
 * round the engine's CPU handed over (written before the stream, or the CPU stand-in,
 * writes `gathered`), and wake[1] `sleeping`, 1 while the proxy sleeps on `published`.
 * Both sides use sequentially consistent accesses in the order that loses no wake-up
 * (the argument of "the engine's sleep" above, the roles swapped): the engine stores
 * published then loads sleeping; the proxy stores sleeping then loads published. */

/* Engine: round `round` is handed over; wake the proxy only if it said it sleeps (a
 * store and a load on the fast path, a syscall only on a wake-up). */
void hf_announce(uint32_t *wake, uint32_t round)
{
    __atomic_store_n(&wake[0], round, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake[1], __ATOMIC_SEQ_CST))
        futex(&wake[0], FUTEX_WAKE, INT_MAX, NULL);
}

/* Proxy: announce, re-check, sleep until a round is handed over (or deadline_ns). */
static void sleep_until_published(uint32_t *wake, uint32_t seen, uint64_t deadline_ns)
{
    __atomic_store_n(&wake[1], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake[0], __ATOMIC_SEQ_CST) == seen)
        futex_sleep(&wake[0], seen, deadline_ns);
    __atomic_store_n(&wake[1], 0, __ATOMIC_RELAXED);
}

/* Store `value` into a futex word and wake whoever sleeps on it. */
static void hf_wake(uint32_t *word, uint32_t value)
{
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

/* ------------------------------------------------------------------ the standby's promotion
 *
 * One futex word, `standby_go`, and a handshake on it with exactly one winner. The
 * supervisor offers the proxy role to the standby whose pid is `pid` by storing `pid`
 * and waking it; the standby accepts from its wait loop by a compare-and-swap
 * pid -> pid | HF_ACCEPTED; the supervisor, at its deadline, withdraws an offer not
 * accepted by a compare-and-swap pid -> 0. Both swaps expect `pid`, so one wins: an
 * accepted standby is the proxy, and one whose offer was withdrawn never takes the role,
 * whenever it runs again (a SIGSTOPped standby, resumed). A running standby answers
 * within a futex wake-up; a stopped, hung or dying one cannot, and the supervisor ends
 * it. A pid, not a flag, so the word never needs resetting between standbys; Linux pids
 * are below 2^22, so the top bit is free. */

#define HF_ACCEPTED 0x80000000u

/* Standby: sleep while *word does not offer it the role (its pid `me`), until
 * deadline_ns; accept an offer and wake the supervisor waiting for the answer. HF_OK:
 * accepted (this process is the proxy now); HF_TIMEOUT: no offer by the deadline, or
 * the offer was withdrawn first. */
int hf_standby_wait(uint32_t *word, uint32_t me, uint64_t deadline_ns)
{
    uint32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (v != me) {
        futex_sleep(word, v, deadline_ns);
        v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    }
    if (v != me || !__atomic_compare_exchange_n(word, &v, me | HF_ACCEPTED, 0, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
        return HF_TIMEOUT;
    futex(word, FUTEX_WAKE, INT_MAX, NULL);
    return HF_OK;
}

/* Supervisor: offer the standby `pid` the role (what this thread stored before the call,
 * the new session, is published to it), wake it, and wait until deadline_ns for its
 * answer; withdraw the offer then if none came. HF_OK: accepted, the standby is the
 * proxy; HF_TIMEOUT: withdrawn, it never will be (end it); HF_STATE: `pid` is not a pid,
 * or another writer changed the word. */
int hf_standby_offer(uint32_t *word, uint32_t pid, uint64_t deadline_ns)
{
    if (pid == 0 || (pid & HF_ACCEPTED))
        return HF_STATE;
    hf_wake(word, pid);
    for (;;) {
        uint32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (v == (pid | HF_ACCEPTED))
            return HF_OK;
        if (v != pid)
            return HF_STATE;
        if (hf_now_ns() >= deadline_ns) {
            if (__atomic_compare_exchange_n(word, &v, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
                return HF_TIMEOUT;
            continue;   /* accepted just now: the next look says so */
        }
        futex_sleep(word, pid, deadline_ns);
    }
}

/* hf_wait_released, and the CLOCK_MONOTONIC time of the look that ended it in *seen_ns. */
int hf_wait_at(uint32_t *released, uint32_t *waiters, uint32_t value, uint32_t spin_us, uint32_t nap_us,
               uint64_t deadline_ns, uint64_t *seen_ns)
{
    int rc = hf_wait_released(released, waiters, value, spin_us, nap_us, deadline_ns);
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

/* One CPU hand-off: signal, then wait for `released >= round` (hf_wait_released). out_ns[0]
 * is taken just before the store of gathered, out_ns[1] just after released was seen,
 * both here, so the caller's wait for its GIL afterwards is not part of the measure. */
int hf_handoff(uint32_t *gathered, uint64_t *gathered_ns, uint32_t *released, uint32_t *waiters,
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
    return hf_wait_at(released, waiters, round, spin_us, nap_us, deadline_ns, &out_ns[1]);
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

/* Publish `released = round` after a successful claim, waking the engine's sleepers
 * (`waiters`, may be NULL). The claimer of round - 1 may still be between its claim and
 * its release (a few instructions when it is the watchdog): wait for it, so `released`
 * only moves forward, one round at a time. */
int hf_publish(uint32_t *released, uint32_t *waiters, uint32_t round, uint64_t deadline_ns)
{
    int rc = hf_wait_geq(released, round - 1, 20, 20, deadline_ns);
    if (rc != HF_OK)
        return rc;
    if (cyc_geq(__atomic_load_n(released, __ATOMIC_ACQUIRE), round))
        return HF_STATE;   /* somebody released a round this caller holds the claim of */
    release_store(released, waiters, round);
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
    return hf_publish(ring->released, ring->waiters, round, deadline_ns);
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

/* The sizes of the structs Python mirrors with ctypes; the loader compares them. */
uint64_t hf_sizeof(int which)
{
    return which == 0 ? sizeof(struct hf_ring) : which == 1 ? sizeof(struct hf_proxy)
         : which == 2 ? sizeof(struct hf_link) : which == 3 ? sizeof(struct hf_windows)
         : which == 4 ? sizeof(struct hf_batch) : which == 5 ? sizeof(struct hf_meta)
         : which == 6 ? sizeof(struct hf_cuda) : which == 7 ? sizeof(struct hf_launch)
         : which == 8 ? sizeof(struct hf_markov) : which == 9 ? sizeof(struct hf_serve)
         : which == 10 ? sizeof(struct hf_host_round) : 0;
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
 * ROWS_SPIN_NS (an engine thread preempted mid-copy may need this core); a count that has
 * not fallen by the deadline is returned as it is. */
uint32_t hf_rows_wait(const uint8_t *desc, uint32_t below, uint64_t deadline_ns)
{
    enum { ROWS_SPIN_NS = 50000 };
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
        release_store(ring->released, ring->waiters, round);
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
        if (flags & 1)   /* DRAFTS_MARGINS */
            memcpy(slot + p->d_margins, image + p->d_margins, grid);
        if (flags & 2) {   /* DRAFTS_SAMPLED: the distributions, 32 ids and weights a position */
            memcpy(slot + p->d_q_ids, image + p->d_q_ids, 32u * grid);
            memcpy(slot + p->d_q_weights, image + p->d_q_weights, 16u * grid);
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
