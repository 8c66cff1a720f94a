/* tcp_round.c: the proxy's round on a TCP socket (hf_round): a round taken, its
 * descriptor checked (desc_check.c), its ROUND sent straight from the region, its DRAFTS
 * received, checked and unpacked (reply_check.c) and answered, without returning to
 * Python between a round's `gathered` and its `released`. What these files share is in
 * tcp_round.h; the wire constants and codes they share with Python are reported by abi.c. */
#include "tcp_round.h"

#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>

/* Record what broke (l->why, l->err) and return `event`. */
int hf_fail(struct hf_link *l, int event, int err, const char *fmt, ...)
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
                return hf_fail(l, HF_EV_LOST, 0, "round %u: %u of its %u rows not gathered by its deadline", round,
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
                return hf_fail(l, HF_EV_LOST, 0, "send of round %u stalled past its deadline", round);
        }
        return hf_fail(l, HF_EV_LOST, k < 0 ? errno : 0, "send failed: %s", k < 0 ? strerror(errno) : "sent nothing");
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
            return -hf_fail(l, HF_EV_LOST, 0, "the worker closed the connection");
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -hf_fail(l, HF_EV_LOST, errno, "receive failed: %s", strerror(errno));
        if (hf_now_ns() < spin_until_ns) {
            cpu_relax();
            continue;
        }
        int w = ready(l->fd, POLLIN, deadline_ns);
        if (w == 0)
            return 0;
        if (w < 0)
            return -hf_fail(l, HF_EV_LOST, errno, "poll failed: %s", strerror(errno));
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
            return hf_fail(l, HF_EV_PROTOCOL, 0, "bad magic %02x%02x%02x%02x", l->hdr[0], l->hdr[1],
                        l->hdr[2], l->hdr[3]);
        if (version != W_VERSION)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "protocol version %u, this side speaks %u", version,
                        W_VERSION);
        if (type == W_BYE)
            return hf_fail(l, HF_EV_LOST, 0, "the worker said BYE");
        if (type == W_PING && plen == 0 && session == l->session) {
            l->got = 0;   /* the answer to a PING sent while this connection was the spare */
            continue;
        }
        if (type != W_DRAFTS)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "frame type %u where DRAFTS was expected", type);
        /* Mirrors client.DraftClient.recv_drafts: a reply of another session is never this
         * round's, nor a late one of this connection's. */
        if (session != l->session)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS of session %#llx on session %#llx's connection",
                        (unsigned long long)session, (unsigned long long)l->session);
        if (plen > l->rx_cap)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes exceeds the cap %u", plen,
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
            return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS for round %u, which was never sent", of);
        l->late++;
    }
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
    uint64_t seen = 0;
    int64_t taken = hf_take_seen(p, idle_ns, &seen);
    if (taken < 0)
        return taken;
    /* The connection is read after the wait: the link may have switched to its spare
     * meanwhile (its keeper saw the active's worker hang up). A new one's receive state
     * starts empty; the one left is closed only by the caller, after this call. */
    uint64_t conn = __atomic_load_n(&l->conn, __ATOMIC_ACQUIRE);
    if (conn != l->cur) {
        l->cur = conn;
        l->got = 0;
    }
    l->fd = (int32_t)(uint32_t)conn;
    int send = l->fd >= 0 && l->send;
    uint32_t status = l->fd >= 0 ? l->at_once : ST_ERROR;
    l->used = conn;
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
    event = hf_check_round(p, l, round, &v);
    if (event == HF_EV_OK) {   /* a bad descriptor is not sent: answered ERROR at once */
        uint64_t t0 = hf_now_ns();
        uint32_t ms = v.deadline_ms ? v.deadline_ms : l->default_deadline_ms;
        uint64_t deadline = t0 + (uint64_t)ms * 1000000u;
        l->sent = 1;
        event = send_round(l, round, index, &v, deadline);
        if (event == HF_EV_OK)
            event = recv_reply(l, round, deadline, t0 + (uint64_t)p->spin_us * 1000u, &len);
        if (event == HF_EV_OK)
            event = hf_unpack_drafts(l, p, &v, len);
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
