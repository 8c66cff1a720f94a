/* tcp_round.c: the proxy's round on a TCP socket (hf_round), its descriptor check and
 * DRAFTS reader (hf_check_desc, hf_unpack), and what they share with Python: the wire
 * constants they use (hf_wire_constants, which the loader holds equal to
 * remote_dspark/wire/) and the library's codes (hf_codes, held equal to
 * native.binding's and outcome.py's enums). */
#include "hostflag.h"

#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>

/* What hf_round did with the round it took (outcome.RoundEvent mirrors these). */
enum { HF_EV_OK, HF_EV_AT_ONCE, HF_EV_TIMEOUT, HF_EV_LOST, HF_EV_PROTOCOL, HF_EV_BAD_REPLY,
       HF_EV_BAD_DESC };

/* The first n of `count` values into out (a loader's probe may ask for fewer or more
 * than there are); returns count. */
static uint32_t report(const uint64_t *all, uint32_t count, uint64_t *out, uint32_t n)
{
    for (uint32_t i = 0; i < n && i < count; i++)
        out[i] = all[i];
    return count;
}

/* The wire constants this file uses, in the order of native.WIRE_CONSTANTS (HEADER's
 * size, MAGIC as a little-endian u32, PROTOCOL_VERSION, ROUND, DRAFTS, BYE, ROUND_FIXED,
 * DRAFTS_FIXED, FLAG_NEW_GEN, DRAFTS_MARGINS, STATUS_RESYNC, MAX_PAYLOAD, SAMPLED_BYTES,
 * DRAFTS_SAMPLED, SAMPLED_TOP, SAMPLED_TOTAL, MAX_SAMPLED_ENTRIES, MAX_SAMPLED_N_OUT,
 * MAX_ENTRIES, MAX_N_OUT, MAX_ROW_BYTES, MAX_TOKENS): the first n into out; returns how
 * many there are. */
uint32_t hf_wire_constants(uint64_t *out, uint32_t n)
{
    uint32_t magic;
    memcpy(&magic, W_MAGIC, 4);
    const uint64_t all[] = { W_HEADER, magic, W_VERSION, W_ROUND, W_DRAFTS, W_BYE, W_ROUND_FIXED,
                             W_DRAFTS_FIXED, W_NEW_GEN, W_MARGINS, W_RESYNC, W_MAX_PAYLOAD, W_SAMPLED_BYTES,
                             W_SAMPLED, W_TOP, W_TOTAL, W_MAX_SAMPLED_ENTRIES, W_MAX_SAMPLED_N_OUT,
                             W_MAX_ENTRIES, W_MAX_N_OUT, W_MAX_ROW_BYTES, W_MAX_TOKENS };
    return report(all, sizeof all / sizeof all[0], out, n);
}

/* The codes Python mirrors, by table, in the order of native.binding.CODE_TABLES:
 * 0 the status codes (native.Status), 1 the drafts statuses a proxy writes
 * (outcome.Outcome OK .. BREAKER_SKIP), 2 hf_round's events (outcome.RoundEvent), 3 the
 * host round's codes (native.HostRoundCode). The
 * first n of table `which` into out; returns how many it has (0: no such table). */
uint32_t hf_codes(uint32_t which, uint64_t *out, uint32_t n)
{
    static const uint64_t status[] = { HF_OK, HF_TIMEOUT, HF_LATE, HF_ORDER, HF_STATE, HF_NOMEM, HF_SYS };
    static const uint64_t outcome[] = { ST_OK, ST_TIMEOUT, ST_ERROR, ST_BREAKER_SKIP };
    static const uint64_t event[] = { HF_EV_OK, HF_EV_AT_ONCE, HF_EV_TIMEOUT, HF_EV_LOST, HF_EV_PROTOCOL,
                                      HF_EV_BAD_REPLY, HF_EV_BAD_DESC };
    static const uint64_t host_round[] = { HF_HR_OK, HF_HR_META, HF_HR_ROW, HF_HR_ARGS, HF_HR_OTHER, HF_HR_GOT };
    switch (which) {
    case 0: return report(status, sizeof status / sizeof status[0], out, n);
    case 1: return report(outcome, sizeof outcome / sizeof outcome[0], out, n);
    case 2: return report(event, sizeof event / sizeof event[0], out, n);
    case 3: return report(host_round, sizeof host_round / sizeof host_round[0], out, n);
    default: return 0;
    }
}

static uint32_t get32(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static uint16_t get16(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

/* Bytes of a ROUND's fixed part and entry arrays, with a sampled session's temperature
 * and seed sections (wire.round_meta_bytes). */
static inline uint64_t round_meta(uint32_t n, uint32_t sampled)
{ return W_ROUND_FIXED + 4u * (5u * (uint64_t)n + 1) + (sampled ? W_SAMPLED_BYTES * (uint64_t)n : 0); }

/* A checked descriptor: the ROUND's fixed fields and where its arrays are. */
struct round_view {
    const uint8_t *payload;       /* the ROUND payload (descriptor + DESC_FIXED) */
    uint32_t deadline_ms, n, row_bytes, n_tokens;
    uint64_t meta;                /* round_meta: where the tokens start */
    const uint8_t *slots, *positions, *n_out, *flags, *offsets;
    const uint8_t *temperature;   /* a sampled session's [n] f32, else NULL (seeds follow: any u64) */
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
 * tokens) and the staging rows, straight from the region, each row once the engine has
 * copied it there (the descriptor's rows-pending count, hf_rows_pending). A frame cannot
 * be taken back once in part on the wire, so a send that cannot finish by the round's
 * deadline loses the connection. */
static int send_round(struct hf_link *l, uint32_t round, uint32_t index, const struct round_view *v,
                      uint64_t deadline_ns)
{
    const uint8_t *d = l->desc + (uint64_t)index * l->desc_stride;
    uint64_t block = v->meta + 4u * (uint64_t)v->n_tokens, rows = (uint64_t)v->n * l->row_bytes;
    uint32_t len = (uint32_t)(block + rows), version = W_VERSION | (W_ROUND << 16);
    uint8_t hdr[W_HEADER];
    memcpy(hdr, W_MAGIC, 4);
    memcpy(hdr + 4, &version, 4);
    memcpy(hdr + 8, &len, 4);
    memcpy(hdr + 12, &l->session, 8);
    memcpy(hdr + 20, &round, 4);
    const uint8_t *part[3] = { hdr, v->payload, l->staging + (uint64_t)index * l->staging_stride };
    const uint64_t size[3] = { W_HEADER, block, rows };
    uint64_t total = W_HEADER + block + rows, sent = 0;
    uint32_t pending = v->n ? hf_rows_pending(d) : 0;
    while (sent < total) {
        uint32_t unsent = pending < v->n ? pending : v->n;   /* a word past n is the engine's bug: waited on */
        uint64_t avail = total - (uint64_t)unsent * l->row_bytes;
        if (sent == avail) {
            uint32_t was = pending;
            if ((pending = hf_rows_wait(d, pending, deadline_ns)) >= was)
                return fail(l, HF_EV_LOST, 0, "round %u: %u of its %u rows not gathered by its deadline", round,
                            pending, v->n);
            continue;
        }
        struct iovec iov[3];
        int parts = 0;
        uint64_t at = 0;
        for (int p = 0; p < 3; at += size[p++]) {   /* bytes [sent, avail) of the frame */
            uint64_t lo = sent > at ? sent - at : 0;
            uint64_t hi = avail <= at ? 0 : avail - at < size[p] ? avail - at : size[p];
            if (lo < hi)
                iov[parts++] = (struct iovec){ (void *)(part[p] + lo), hi - lo };
        }
        struct msghdr msg = { .msg_iov = iov, .msg_iovlen = (size_t)parts };
        ssize_t k = sendmsg(l->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            sent += (uint64_t)k;
            if (pending)
                pending = hf_rows_pending(d);
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = ready(l->fd, POLLOUT, deadline_ns);
            if (w > 0)
                continue;
            if (w == 0)
                return fail(l, HF_EV_LOST, 0, "send of round %u stalled past its deadline", round);
        }
        return fail(l, HF_EV_LOST, k < 0 ? errno : 0, "send failed: %s", k < 0 ? strerror(errno) : "sent nothing");
    }
    return HF_EV_OK;
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
        if (memcmp(l->hdr, W_MAGIC, 4) != 0)
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
    v->meta = round_meta(v->n, p->want_sampled);
    uint64_t size = v->meta + 4u * (uint64_t)v->n_tokens + (uint64_t)v->n * v->row_bytes;
    if (size > W_MAX_PAYLOAD)
        return fail(l, HF_EV_BAD_DESC, 0, "ROUND of %llu bytes over the cap %llu",
                    (unsigned long long)size, (unsigned long long)W_MAX_PAYLOAD);
    uint64_t n4 = 4u * (uint64_t)v->n;
    v->slots = f + W_ROUND_FIXED;
    v->positions = v->slots + n4;
    v->n_out = v->positions + n4;
    v->flags = v->n_out + n4;
    v->offsets = v->flags + n4;
    v->temperature = p->want_sampled ? v->offsets + n4 + 4 : NULL;
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
        /* batch.sampling_meta's rule, for temperatures written on the device (any seed is one) */
        float t;
        if (v->temperature && (memcpy(&t, v->temperature + 4u * e, 4), !(isfinite(t) && t >= 0.0f)))
            return fail(l, HF_EV_BAD_DESC, 0, "entry %u: temperature %g not a finite float32 >= 0", e, (double)t);
    }
    /* Token ids in the engine's vocabulary, when it is known: batch.host_meta's rule, for
     * metadata written on the device that no host ever read (device_meta.write_meta_in_stream). */
    if (p->vocab_size) {
        const uint8_t *tokens = f + v->meta;
        for (uint32_t j = 0; j < v->n_tokens; j++) {
            int32_t t = (int32_t)get32(tokens + 4u * j);
            if (t < 0 || (uint32_t)t >= p->vocab_size)
                return fail(l, HF_EV_BAD_DESC, 0, "tokens: %d (token %u) outside 0..%u, the vocabulary", t, j,
                            p->vocab_size - 1);
        }
    }
    return HF_EV_OK;
}

/* Copy entry rows of `width` positions of `cell` bytes each (a token or margin: 4; a
 * position's q ids: 128, its weights: 64) into rows of K, `count` positions each and the
 * rest zero, so the engine may copy the whole block. One memcpy when the rows are full. */
static void widen(uint8_t *dst, const uint8_t *src, const uint8_t *counts, uint32_t n,
                  uint32_t width, uint32_t K, int full, uint32_t cell)
{
    if (full) {
        memcpy(dst, src, (uint64_t)cell * n * K);
        return;
    }
    for (uint32_t e = 0; e < n; e++) {
        uint64_t k = get16(counts + 2u * e);
        uint8_t *row = dst + (uint64_t)cell * K * e;
        memcpy(row, src + (uint64_t)cell * width * e, cell * k);
        memset(row + cell * k, 0, cell * (K - k));
    }
}

/* What a reply's entries must be beyond the frame's own rules, checked before anything
 * is delivered. THE RULE HAS A PYTHON TWIN: remote_dspark/engine/values/reply.py (check_reply,
 * sync mode) makes the same checks in the same order with the same words, and
 * tests/engine/values/test_reply_check.py runs the same replies through both and holds their verdicts
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

/* The smallest id repeated among a position's W_TOP ids, as sampled.violation names it
 * (the slow path, once a repeat is known: every pair). */
static int32_t smallest_repeated(const uint8_t *ids)
{
    int32_t v[W_TOP], least = INT32_MAX;
    memcpy(v, ids, sizeof v);
    for (int i = 0; i < W_TOP; i++)
        for (int j = i + 1; j < W_TOP; j++)
            if (v[i] == v[j] && v[i] < least)
                least = v[i];
    return least;
}

/* 1 when a position's W_TOP ids are distinct: an open-addressing set of 128 cells, a
 * cell taken when its tag is this position's `stamp` (the caller's: never 0, one per
 * position, fewer than 2^16 a call: MAX_SAMPLED_ENTRIES x MAX_SAMPLED_N_OUT). */
static int distinct(const uint32_t *ids, uint32_t *keys, uint16_t *tags, uint16_t stamp)
{
    for (int m = 0; m < W_TOP; m++)
        for (uint32_t h = (ids[m] * 0x9E3779B1u) >> 25;; h = (h + 1) & 127) {
            if (tags[h] != stamp) {
                tags[h] = stamp;
                keys[h] = ids[m];
                break;
            }
            if (keys[h] == ids[m])
                return 0;
        }
    return 1;
}

/* Rule 5 of the reply check, once every entry passed check_entries: each counted
 * position's distribution, in entry order. THE RULE HAS A PYTHON TWIN, with the same
 * words: remote_dspark/sampled.violation, as engine/values/reply.py names it ("entry e: draft
 * j: ..."): the first position that breaks it, and its first broken part: an id outside
 * 0..vocab-1 (the first listed; vocab 2^31 when unknown), an id repeated (the smallest),
 * weights not summing to exactly W_TOTAL (u16: none over it), the drafted token not
 * among the ids of weight > 0. Branch-free over a position's ids (1,280 positions: 40
 * us on the H200 host's CPU), the words found only for the position that breaks it. */
static int check_distributions(struct hf_link *l, const struct hf_proxy *p, uint32_t n, uint32_t width,
                               const uint8_t *counts, const uint8_t *tokens, const uint8_t *q_ids,
                               const uint8_t *q_weights)
{
    uint32_t vocab = p->vocab_size ? p->vocab_size : (uint32_t)INT32_MAX + 1, keys[128], ids[W_TOP];
    uint16_t tags[128] = { 0 }, stamp = 0, w[W_TOP];
    for (uint32_t e = 0; e < n; e++) {
        for (uint32_t j = 0, c = get16(counts + 2u * e); j < c; j++) {
            uint64_t at = (uint64_t)width * e + j;
            uint32_t token = get32(tokens + 4u * at), outside = 0, present = 0, sum = 0;
            memcpy(ids, q_ids + 4u * W_TOP * at, sizeof ids);
            memcpy(w, q_weights + 2u * W_TOP * at, sizeof w);
            for (int m = 0; m < W_TOP; m++) {   /* as u32, a negative id is >= 2^31 >= vocab */
                outside |= ids[m] >= vocab;
                sum += w[m];
                present |= (ids[m] == token) & (w[m] > 0);
            }
            int m = 0;
            if (outside) {
                while (ids[m] < vocab)
                    m++;
                return fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft %u: id %d outside 0..%u", e, j,
                            (int32_t)ids[m], vocab - 1);
            }
            if (!distinct(ids, keys, tags, ++stamp))
                return fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft %u: id %d repeated", e, j,
                            smallest_repeated(q_ids + 4u * W_TOP * at));
            if (sum != W_TOTAL)
                return fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: weights sum to %u (each 0..%d), expected exactly %d", e, j,
                            sum, W_TOTAL, W_TOTAL);
            if (!present)
                return fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: drafted token %d not among its ids of weight > 0", e, j,
                            (int32_t)token);
        }
    }
    return HF_EV_OK;
}

/* Check the DRAFTS payload in rx (the wire's rules, then against round view v and what
 * the session asked: check_entries, check_distributions) and write it into the drafts
 * image: counts and statuses as i32, each row (tokens, margins, a sampled reply's q ids
 * and weights) widened to num_spec, zero past its count. */
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
    if (flags & ~(uint32_t)(W_MARGINS | W_SAMPLED))
        return fail(l, HF_EV_PROTOCOL, 0, "DRAFTS unknown flags %#x", flags);
    if ((flags & W_SAMPLED) && (n > W_MAX_SAMPLED_ENTRIES || width > W_MAX_SAMPLED_N_OUT))
        return fail(l, HF_EV_PROTOCOL, 0, "sampled DRAFTS of %u entries x %u over the caps %u x %u", n, width,
                    W_MAX_SAMPLED_ENTRIES, W_MAX_SAMPLED_N_OUT);
    uint64_t grid = 4u * (uint64_t)n * width, q = (flags & W_SAMPLED) ? (uint64_t)W_TOP * grid : 0;
    const uint8_t *slots = b + W_DRAFTS_FIXED, *counts = slots + 4u * (uint64_t)n;
    const uint8_t *statuses = counts + 2u * (uint64_t)n, *tokens = statuses + 2u * (uint64_t)n;
    const uint8_t *q_ids = tokens + grid * ((flags & W_MARGINS) ? 2 : 1), *q_weights = q_ids + q;
    uint64_t want = (uint64_t)(q_weights - b) + q / 2;   /* ids i32, weights u16 */
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
     * a protocol error (the connection is dropped), as in engine/values/reply.py. */
    if (width > K)
        return fail(l, HF_EV_PROTOCOL, 0, "drafts width %u over num_spec=%u", width, K);
    if (!(flags & W_MARGINS) != !p->want_margin)
        return fail(l, HF_EV_PROTOCOL, 0, p->want_margin ? "DRAFTS without margins, the session asked for them"
                                                          : "DRAFTS with margins, the session did not ask for them");
    if (!(flags & W_SAMPLED) != !p->want_sampled)
        return fail(l, HF_EV_PROTOCOL, 0, p->want_sampled ? "DRAFTS without distributions, the session asked for them"
                                                           : "DRAFTS with distributions, the session did not ask for them");
    int event = check_entries(l, p, v, n, width, counts, statuses, tokens,
                              (flags & W_MARGINS) ? tokens + grid : NULL);
    if (event == HF_EV_OK && (flags & W_SAMPLED))
        event = check_distributions(l, p, n, width, counts, tokens, q_ids, q_weights);
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
    widen(img + p->d_tokens, tokens, counts, n, width, K, full, 4);
    if (flags & W_MARGINS)
        widen(img + p->d_margins, tokens + grid, counts, n, width, K, full, 4);
    if (flags & W_SAMPLED) {
        widen(img + p->d_q_ids, q_ids, counts, n, width, K, full, 4u * W_TOP);
        widen(img + p->d_q_weights, q_weights, counts, n, width, K, full, 2u * W_TOP);
    }
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
    int64_t taken = hf_take_seen(p, idle_ns, &seen);
    if (taken < 0)
        return taken;
    uint32_t round = (uint32_t)taken, index = round & (p->ring.depth - 1);
    int event = HF_EV_AT_ONCE;
    if (!send) {   /* nothing but the ring's words and the drafts slot before the release */
        int rc = hf_answer_seen(p, round, status, NULL, seen);
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
    l->answer = hf_answer_seen(p, round, status, event == HF_EV_OK ? l->image : NULL, seen);
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
