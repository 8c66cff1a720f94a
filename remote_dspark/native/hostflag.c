/* hostflag.c: the hand-off primitives shared by the engine and the proxy process: the
 * ring's words, the CPU hand-off, the engine's sleep on `released`, the proxy's sleep
 * when idle, the standby's promotion, the claim and the release. The proxy's take and
 * answer are in proxy_end.c, its round on a TCP socket in tcp_round.c, the engine's
 * watchdog thread in watchdog.c; what the files share (the structs Python mirrors, the
 * status codes) is in hostflag.h.
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

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

uint64_t hf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void hf_nap_ns(uint64_t ns)
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
            hf_nap_ns(nap < left ? nap : left);
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
void hf_release_store(uint32_t *released, uint32_t *waiters, uint32_t round)
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
void hf_sleep_until_published(uint32_t *wake, uint32_t seen, uint64_t deadline_ns)
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
    hf_release_store(released, waiters, round);
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
