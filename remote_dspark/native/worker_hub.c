/* worker_hub.c: the worker's connections served without the interpreter between frames
 * (every drafter's but the Markov lane's, worker_serve.c). One epoll set holds the served
 * connections; one I/O thread (hf_hub_io, called with the GIL released) reads each frame
 * as its bytes come, checks a ROUND and applies it to the session's windows
 * (hf_worker_round, under the windows' guard) into the connection's batch arrays, and
 * pushes the connection's id onto the ready ring (a PING of the connection's session, an
 * empty frame, is answered there and then: a spare's liveness is this thread's, never
 * the drafter's); the drafter's thread takes the ids
 * (hf_hub_take), drafts a call's worth of rounds from their arrays, and writes each
 * round's DRAFTS from the result's arrays and sends it (hf_hub_reply). A reply the socket
 * cannot take at once goes back to the I/O thread, which sends the rest as room comes.
 * Anything else (a BYE, a ROUND the C check refuses, a header another loop must judge, a
 * closed or stalled peer, a reply that could not be sent) hands the connection to Python
 * whole (HUB_PYTHON, why in the connection), so every message and rule of the Python
 * loop stays written once, in remote_dspark/worker/.
 *
 * Each connection has one round in flight: once a ROUND is whole it is not armed for
 * input again until its reply is sent, and a read never takes bytes past the frame in
 * hand. Who owns a connection follows its state: the I/O thread in HUB_RECV, HUB_SEND and
 * HUB_DROPPED, the drafter's thread in HUB_QUEUED, Python in HUB_PYTHON; each hand-over is a release
 * store of the state, read with acquire, and epoll's one-shot arming. The ready ring has
 * one producer (the I/O thread) and one consumer (the drafter's thread), room entries (a
 * connection is on it once at most).
 *
 * remote_dspark/worker/hub.py drives it; its reference is the worker's Python path, which
 * the tests hold it to reply for reply. */
#include "hostflag.h"

#include <linux/futex.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Where a connection is (hf_conn.state; remote_dspark.worker.hub mirrors these). HUB_DROPPED:
 * ended by the drafter's thread (hf_hub_drop), for the I/O thread to hand to Python. */
enum { HUB_RECV, HUB_QUEUED, HUB_SEND, HUB_PYTHON, HUB_DROPPED };
/* What hf_hub_io returns: a connection handed to Python, the hub stopped, epoll failed. */
enum { HUB_EVENT, HUB_STOPPED, HUB_FAILED };
#define WAKE_ID UINT32_MAX  /* the eventfd's epoll data */
#define MORE (-1)           /* conn_read: the frame goes on, the socket has no more now */
#define PINGED (-2)         /* conn_read: a PING of the connection's session, whole */

static uint32_t get32(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static uint64_t get64(const uint8_t *b) { uint64_t v; memcpy(&v, b, 8); return v; }
static uint16_t get16(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

static uint64_t after(uint64_t ns)
{
    uint64_t now = hf_now_ns();
    return ns > UINT64_MAX - now ? UINT64_MAX : now + ns;
}

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *ts)
{
    return syscall(SYS_futex, word, op, value, ts, NULL, 0);
}

static uint32_t state_of(struct hf_conn *c) { return __atomic_load_n(&c->state, __ATOMIC_ACQUIRE); }
static void set_state(struct hf_conn *c, uint32_t s) { __atomic_store_n(&c->state, s, __ATOMIC_RELEASE); }

/* Arm c's socket for one event of `events` (op: EPOLL_CTL_ADD or _MOD). */
static int arm(struct hf_hub *h, struct hf_conn *c, uint32_t events, int op)
{
    struct epoll_event ev = { .events = events | EPOLLONESHOT, .data.u32 = c->id };
    return epoll_ctl(h->epfd, op, c->fd, &ev);
}

/* ----------------------------------------------------------------- the hub's lifetime */

/* The hub's epoll set and wake-up eventfd: HF_OK, or HF_SYS (errno set). */
int hf_hub_open(struct hf_hub *h)
{
    h->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (h->epfd < 0)
        return HF_SYS;
    h->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = { .events = EPOLLIN, .data.u32 = WAKE_ID };
    if (h->wakefd < 0 || epoll_ctl(h->epfd, EPOLL_CTL_ADD, h->wakefd, &ev)) {
        int e = errno;
        close(h->epfd);
        if (h->wakefd >= 0)
            close(h->wakefd);
        errno = e;
        return HF_SYS;
    }
    return HF_OK;
}

void hf_hub_close(struct hf_hub *h)
{
    close(h->epfd);
    close(h->wakefd);
}

/* hf_hub_io returns HUB_STOPPED from its next wait on; a sleeping hf_hub_take returns. */
void hf_hub_stop(struct hf_hub *h)
{
    uint64_t one = 1;
    __atomic_store_n(&h->stop, 1u, __ATOMIC_RELEASE);
    if (write(h->wakefd, &one, 8) < 0) { /* a full counter still wakes */ }
    hf_hub_poke(h);
}

/* A sleeping hf_hub_take returns (0 ids) at once. */
void hf_hub_poke(struct hf_hub *h)
{
    __atomic_fetch_add(&h->wake, 1u, __ATOMIC_RELEASE);
    if (__atomic_load_n(&h->sleepers, __ATOMIC_ACQUIRE))
        futex(&h->wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL);
}

/* Serve c (its HELLO answered, its buffers and windows set, c->id free): HF_OK, HF_SYS. */
int hf_hub_add(struct hf_hub *h, struct hf_conn *c)
{
    c->got = 0;
    c->state = HUB_RECV;
    __atomic_store_n(&h->conns[c->id], c, __ATOMIC_RELEASE);
    if (arm(h, c, EPOLLIN, EPOLL_CTL_ADD)) {
        __atomic_store_n(&h->conns[c->id], NULL, __ATOMIC_RELEASE);
        return HF_SYS;
    }
    return HF_OK;
}

/* Stop serving c (Python's, or the hub stopped); the caller closes its socket after. */
void hf_hub_remove(struct hf_hub *h, struct hf_conn *c)
{
    epoll_ctl(h->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    __atomic_store_n(&h->conns[c->id], NULL, __ATOMIC_RELEASE);
}

/* ----------------------------------------------------------------- the I/O thread */

/* The header in c->hdr is one this loop takes: a ROUND within the connection's cap, an
 * empty BYE, or an empty PING of the connection's session (anything else, a PING with a
 * payload or of another session among it, is for Python to judge). */
static int header_ok(const struct hf_conn *c)
{
    uint16_t version = get16(c->hdr + 4), type = get16(c->hdr + 6);
    uint64_t len = get32(c->hdr + 8);
    return memcmp(c->hdr, W_MAGIC, 4) == 0 && version == W_VERSION
        && ((type == W_ROUND && len <= c->max_payload) || (type == W_BYE && len == 0)
            || (type == W_PING && len == 0 && get64(c->hdr + 12) == c->session));
}

/* A whole frame in hand: SV_ROUND, a ROUND checked and applied to the windows into c->b
 * (a reply for the most entries its payload names fits tx), PINGED for a PING (header_ok
 * took it), else SV_FRAME for Python. */
static int frame_whole(struct hf_conn *c)
{
    uint64_t len = get32(c->hdr + 8);
    if (get16(c->hdr + 6) == W_PING)
        return PINGED;
    if (get16(c->hdr + 6) != W_ROUND)
        return SV_FRAME;
    uint64_t told = len >= W_ROUND_FIXED ? get32(c->rx + 4) : 0;
    uint64_t most = W_HEADER + W_DRAFTS_FIXED + told * (8 + 8ull * c->w->num_spec)
                  + (c->w->sampled ? told * c->w->num_spec * (uint64_t)W_TOP * 6 : 0);
    if (told > c->b->n_room || most > c->tx_size)
        return SV_FRAME;
    hf_guard_take(c->w->guard);
    int rule = hf_worker_round(c->w, c->rx, len, c->b);
    hf_guard_drop(c->w->guard);
    if (rule)
        return SV_FRAME;
    c->received_ns = hf_now_ns();
    return SV_ROUND;
}

/* Read what the socket has of c's frame in hand, never past its end: MORE while the
 * frame goes on, SV_ROUND once a ROUND is whole and applied, PINGED once a PING is, or
 * why Python takes it. */
static int conn_read(const struct hf_hub *h, struct hf_conn *c)
{
    for (;;) {
        uint8_t *dst;
        uint64_t room;
        if (c->got < W_HEADER) {
            dst = c->hdr + c->got, room = W_HEADER - c->got;
        } else {
            uint64_t end = W_HEADER + (uint64_t)get32(c->hdr + 8);
            if (c->got == end)
                return frame_whole(c);
            dst = c->rx + (c->got - W_HEADER), room = end - c->got;
        }
        ssize_t k = recv(c->fd, dst, room, MSG_DONTWAIT);
        if (k == 0)
            return SV_CLOSED;
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return MORE;
            c->err = (uint32_t)errno;
            return SV_LOST;
        }
        c->got += (uint64_t)k;
        if (c->got == W_HEADER) {  /* between frames there is no deadline; a frame begun has one */
            if (!header_ok(c))
                return SV_HEADER;
            c->frame_deadline_ns = after(h->frame_ns);
        }
    }
}

/* Send what is left of c's reply: 0 all sent, 1 the socket has no room now, -1 failed
 * (errno). */
static int conn_send(struct hf_conn *c)
{
    while (c->tx_sent < c->tx_len) {
        ssize_t k = send(c->fd, c->tx + c->tx_sent, c->tx_len - c->tx_sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            c->tx_sent += (uint64_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 1;
        return -1;
    }
    return 0;
}

/* c's reply whole: it reads its next frame. */
static void next_frame(struct hf_hub *h, struct hf_conn *c)
{
    c->got = 0;
    set_state(c, HUB_RECV);
    arm(h, c, EPOLLIN, EPOLL_CTL_MOD);
}

/* c (the I/O thread's) read a PING of its session: answered with the same frame
 * (wire.encode_ping(session, seq): the PING echoed) from tx, which holds no reply now
 * (c had no round in flight); the rest, if the socket has no room, as a reply's is.
 * Returns conn_send's answer, c handed on as it says. */
static void sent_on(struct hf_hub *h, struct hf_conn *c, int sent);

static int pong(struct hf_hub *h, struct hf_conn *c)
{
    memcpy(c->tx, c->hdr, W_HEADER);
    c->tx_len = W_HEADER, c->tx_sent = 0;
    h->pings++;  /* (this thread its only writer; Python reads it for the metrics) */
    int sent = conn_send(c);
    sent_on(h, c, sent);
    return sent;
}

/* After conn_send's answer `sent` for c's tx: sent whole (0), c reads its next frame;
 * partly (1), the I/O thread sends the rest, by the send deadline. */
static void sent_on(struct hf_hub *h, struct hf_conn *c, int sent)
{
    if (sent == 0) {
        next_frame(h, c);
    } else if (sent == 1) {
        c->send_deadline_ns = after(h->send_ns);
        set_state(c, HUB_SEND);
        arm(h, c, EPOLLOUT, EPOLL_CTL_MOD);
    }
}

/* c (the I/O thread's) handed to Python: why, and errno where there is one. */
static int to_python(struct hf_conn *c, uint32_t why, uint32_t *id)
{
    c->why = why;
    set_state(c, HUB_PYTHON);
    *id = c->id;
    return HUB_EVENT;
}

/* One ready id pushed (the I/O thread is the ring's only producer). */
static void push(struct hf_hub *h, uint32_t id)
{
    uint32_t t = h->tail;
    h->ready[t % h->room] = id;
    __atomic_store_n(&h->tail, t + 1, __ATOMIC_RELEASE);
    hf_hub_poke(h);
}

/* The earliest deadline of a connection the I/O thread owns into *next (UINT64_MAX:
 * none); returns 1 when a connection is past its own, handed to Python (its id in *id:
 * SV_STALLED, or SV_UNSENT with ETIMEDOUT), else 0. */
static int overdue(struct hf_hub *h, uint64_t *next, uint32_t *id)
{
    uint64_t now = hf_now_ns(), soonest = UINT64_MAX;
    for (uint32_t i = 0; i < h->room; i++) {
        struct hf_conn *c = __atomic_load_n(&h->conns[i], __ATOMIC_ACQUIRE);
        if (!c)
            continue;
        uint32_t st = state_of(c);
        uint64_t d = st == HUB_SEND ? c->send_deadline_ns
                   : st == HUB_RECV && c->got >= W_HEADER ? c->frame_deadline_ns : UINT64_MAX;
        if (d <= now) {
            c->err = st == HUB_SEND ? ETIMEDOUT : 0;
            to_python(c, st == HUB_SEND ? SV_UNSENT : SV_STALLED, id);
            return 1;
        }
        soonest = d < soonest ? d : soonest;
    }
    *next = soonest;
    return 0;
}

/* The I/O thread's loop (the GIL released): serve every connection's frames and replies
 * until one needs Python. Returns HUB_EVENT (that connection's id in *id, in HUB_PYTHON,
 * why and errno in it), HUB_STOPPED (hf_hub_stop), or HUB_FAILED (epoll failed; errno). */
int hf_hub_io(struct hf_hub *h, uint32_t *id)
{
    for (;;) {
        if (__atomic_load_n(&h->stop, __ATOMIC_ACQUIRE))
            return HUB_STOPPED;
        uint64_t next;
        if (overdue(h, &next, id))
            return HUB_EVENT;
        uint64_t now = hf_now_ns(), ms = next == UINT64_MAX ? 0 : (next - now + 999999) / 1000000;
        int timeout = next == UINT64_MAX ? -1 : ms > INT_MAX ? INT_MAX : (int)ms;
        struct epoll_event ev;
        int k = epoll_wait(h->epfd, &ev, 1, timeout);
        if (k < 0 && errno != EINTR)
            return HUB_FAILED;
        if (k <= 0)
            continue;
        if (ev.data.u32 == WAKE_ID) {
            uint64_t v;
            if (read(h->wakefd, &v, 8) < 0) { /* drained already */ }
            continue;
        }
        struct hf_conn *c = ev.data.u32 < h->room ? __atomic_load_n(&h->conns[ev.data.u32], __ATOMIC_ACQUIRE) : NULL;
        if (!c)
            continue;
        uint32_t st = state_of(c);
        if (st == HUB_RECV) {
            int why = conn_read(h, c);
            if (why == MORE)
                arm(h, c, EPOLLIN, EPOLL_CTL_MOD);
            else if (why == PINGED) {
                if (pong(h, c) < 0) {
                    c->err = (uint32_t)errno;
                    return to_python(c, SV_UNSENT, id);
                }
            } else if (why == SV_ROUND) {
                set_state(c, HUB_QUEUED);
                push(h, c->id);
            } else
                return to_python(c, (uint32_t)why, id);
        } else if (st == HUB_SEND) {
            int sent = conn_send(c);
            if (sent == 1)
                arm(h, c, EPOLLOUT, EPOLL_CTL_MOD);
            else if (sent == 0)
                next_frame(h, c);
            else {
                c->err = (uint32_t)errno;
                return to_python(c, SV_UNSENT, id);
            }
        } else if (st == HUB_DROPPED) {
            return to_python(c, c->why, id);
        }  /* (a connection Python or the drafter holds is not armed: a stale event) */
    }
}

/* ----------------------------------------------------------------- the drafter's thread */

/* Up to max ready connection ids into out, waiting until deadline_ns for one (0: no
 * wait); returns how many (0: the deadline passed, or hf_hub_poke woke it). Each id's
 * connection is the caller's (HUB_QUEUED) until hf_hub_reply or hf_hub_drop. */
uint32_t hf_hub_take(struct hf_hub *h, uint32_t *out, uint32_t max, uint64_t deadline_ns)
{
    for (int slept = 0;; slept = 1) {
        uint32_t seen = __atomic_load_n(&h->wake, __ATOMIC_ACQUIRE);
        uint32_t head = h->head, tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE), n = 0;
        while (head != tail && n < max)
            out[n++] = h->ready[head++ % h->room];
        __atomic_store_n(&h->head, head, __ATOMIC_RELEASE);
        uint64_t now = hf_now_ns();
        if (n || slept || now >= deadline_ns || __atomic_load_n(&h->stop, __ATOMIC_ACQUIRE))
            return n;
        uint64_t left = deadline_ns - now;
        struct timespec ts = { (time_t)(left / 1000000000u), (long)(left % 1000000000u) };
        __atomic_fetch_add(&h->sleepers, 1u, __ATOMIC_SEQ_CST);
        futex(&h->wake, FUTEX_WAIT_PRIVATE, seen, deadline_ns == UINT64_MAX ? NULL : &ts);
        __atomic_fetch_sub(&h->sleepers, 1u, __ATOMIC_SEQ_CST);
    }
}

/* The DRAFTS frame of c's round (the ROUND's payload in rx, its header in hdr, its batch
 * in c->b) into tx: RESYNC where an entry has no window, the drafts of r's rows from
 * `at` for the drafted entries (r's arrays NULL: none); *drafted gets their count.
 * Returns its length. */
static uint64_t write_reply(struct hf_conn *c, const struct hf_result *r, uint64_t at, uint64_t *drafted)
{
    const struct hf_batch *b = c->b;
    uint32_t n = b->n, width = b->width, margins = c->want_margin != 0, sampled = c->w->sampled != 0;
    uint64_t top = (uint64_t)width * W_TOP;
    struct hf_drafts_at a;
    uint8_t *f = c->tx;
    hf_drafts_head(f, c->hdr, c->rx + W_ROUND_FIXED, n, width, (int)margins, (int)sampled, &a);
    uint64_t at_counts = a.counts, at_status = a.statuses, at_tokens = a.tokens, at_margins = a.margins;
    uint64_t at_q_ids = a.q_ids, at_q_weights = a.q_weights, size = a.size;
    *drafted = 0;
    for (uint64_t i = 0, j = at; i < n; i++) {
        uint16_t status = b->ok[i] ? 0 : W_RESYNC;
        memcpy(f + at_status + 2ull * i, &status, 2);
        if (!b->drafted[i])
            continue;
        if (r->counts) {
            uint16_t count = (uint16_t)r->counts[j];
            *drafted += count;
            memcpy(f + at_counts + 2ull * i, &count, 2);
            memcpy(f + at_tokens + 4ull * i * width, r->tokens + j * r->stride, 4ull * width);
            if (margins && r->margins)
                memcpy(f + at_margins + 4ull * i * width, r->margins + j * r->stride, 4ull * width);
            if (sampled && r->q_ids) {
                memcpy(f + at_q_ids + 4 * i * top, r->q_ids + j * r->qstride, 4 * top);
                memcpy(f + at_q_weights + 2 * i * top, r->q_weights + j * r->qstride, 2 * top);
            }
        }
        j++;
    }
    return size;
}

/* c (the drafter's thread's) ended: its reading shut, handed to the I/O thread as
 * HUB_DROPPED (why and err for Python), armed for an event that comes at once (a socket
 * shut for reading polls readable). */
static void drop(struct hf_hub *h, struct hf_conn *c, uint32_t why, uint32_t err)
{
    shutdown(c->fd, SHUT_RD);
    c->why = why, c->err = err;
    set_state(c, HUB_DROPPED);
    arm(h, c, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
}

/* Send c's reply (in tx, tx_len bytes): 0 sent whole (c reads its next frame), 1 partly
 * (the I/O thread sends the rest), -1 the send failed (errno kept; c is dropped, the send's
 * failure its why). */
static int send_reply(struct hf_hub *h, struct hf_conn *c)
{
    c->tx_sent = 0;
    int sent = conn_send(c);
    sent_on(h, c, sent);
    if (sent < 0) {
        int e = errno;
        drop(h, c, SV_UNSENT, (uint32_t)e);
        errno = e;
    }
    return sent;
}

/* Answer c's round (the caller's, HUB_QUEUED) with r (its rows from 0) and send it:
 * send_reply's answer. */
int hf_hub_reply(struct hf_hub *h, struct hf_conn *c, const struct hf_result *r)
{
    uint64_t drafted;
    c->tx_len = write_reply(c, r, 0, &drafted);
    return send_reply(h, c);
}

/* ----------------------------------------------------------------- a call of whole rounds */

/* The rounds of connections ids[0..k) (the caller's, HUB_QUEUED) gathered into one
 * call's batch `o`, in that order, entries of a round consecutive: contexts and offsets
 * rebased, each entry's session, kept_from (keep_streams: the stream's indices from
 * lengths - min(lengths, keep) are in its windows), rows, sampled rounds' temperatures
 * and seeds, each round's receipt and deadline. Returns 0; 1 when they cannot make one
 * call (of the rounds with entries to draft: greedy and sampled, two widths, or rows of
 * two sizes); 2 when they are over the arrays' room (more rounds than room_rounds, or
 * o->m, n_tokens and n_rows say what they need). */
int hf_hub_gather(struct hf_hub *h, const uint32_t *ids, uint32_t k, struct hf_call *o)
{
    uint64_t m = 0, t = 0, rows = 0;
    o->sampled = o->row_bytes = o->width = 0;
    o->m = o->n_tokens = o->n_rows = 0;
    if (k > o->room_rounds)
        return 2;
    for (uint32_t r = 0; r < k; r++) {
        const struct hf_conn *c = h->conns[ids[r]];
        uint32_t sampled = c->w->sampled != 0;
        if (c->b->m && !m)
            o->sampled = sampled, o->row_bytes = c->b->row_bytes, o->width = c->b->width;
        else if (c->b->m && (sampled != o->sampled || c->b->row_bytes != o->row_bytes || c->b->width != o->width))
            return 1;
        m += c->b->m, t += c->b->n_tokens, rows += (uint64_t)c->b->m * c->b->row_bytes;
    }
    o->m = m, o->n_tokens = t, o->n_rows = rows;
    if (m > o->room_entries || t > o->room_tokens || rows > o->room_rows)
        return 2;
    m = t = rows = 0;
    o->margins = 0;
    for (uint32_t r = 0; r < k; r++) {
        const struct hf_conn *c = h->conns[ids[r]];
        const struct hf_batch *b = c->b;
        memcpy(o->tokens + t, b->tokens, 4 * b->n_tokens);
        memcpy(o->n_out + m, b->n_out, 4ull * b->m);
        memcpy(o->slots + m, b->slots, 8ull * b->m);
        memcpy(o->gens + m, b->gens, 8ull * b->m);
        memcpy(o->lengths + m, b->lengths, 8ull * b->m);
        memcpy(o->starts + m, b->starts, 8ull * b->m);
        if (o->sampled) {
            memcpy(o->temperature + m, b->temperature, 4ull * b->m);
            memcpy(o->seed + m, b->seed, 8ull * b->m);
        }
        /* rows: the drafted entries' of the ROUND's rows, which end its payload */
        const uint8_t *src = c->rx + get32(c->hdr + 8) - (uint64_t)b->n * b->row_bytes;
        for (uint32_t i = 0, j = 0; b->row_bytes && i < b->n; i++)
            if (b->drafted[i])
                memcpy(o->rows + rows + (uint64_t)(j++) * b->row_bytes, src + (uint64_t)i * b->row_bytes, b->row_bytes);
        for (uint32_t j = 0; j < b->m; j++) {
            o->offsets[m + j] = (int64_t)t + b->offsets[j];
            o->sessions[m + j] = (int64_t)c->serial;
            if (o->keep_streams) {
                int64_t len = b->lengths[j], keep = (int64_t)c->w->keep;
                o->kept_from[m + j] = len - (len < keep ? len : keep);
            }
        }
        o->received_ns[r] = c->received_ns;
        o->deadline_ns[r] = b->deadline_ms ? c->received_ns + (uint64_t)b->deadline_ms * 1000000u : UINT64_MAX;
        o->margins |= c->want_margin != 0;
        m += b->m, t += b->n_tokens, rows += (uint64_t)b->m * b->row_bytes;
    }
    o->offsets[m] = (int64_t)t;
    return 0;
}

/* The call gathered from ids[0..k) answered with r (its rows in the gathered order) and
 * each reply sent: facts[0..4) get the rounds' entries, their RESYNCs, those past the
 * drafter's positions, and the drafts; sent[r] send_reply's answer for round r. */
void hf_hub_answer(struct hf_hub *h, const uint32_t *ids, uint32_t k, const struct hf_result *r, uint64_t *facts,
                   int32_t *sent)
{
    uint64_t at = 0;
    facts[0] = facts[1] = facts[2] = facts[3] = 0;
    for (uint32_t i = 0; i < k; i++) {
        struct hf_conn *c = h->conns[ids[i]];
        const struct hf_batch *b = c->b;
        uint64_t drafted;
        c->tx_len = write_reply(c, r, at, &drafted);
        facts[0] += b->n, facts[1] += b->n - b->n_ok, facts[2] += b->n_ok - b->m, facts[3] += drafted;
        at += b->m;
        sent[i] = send_reply(h, c);
    }
}

/* End c's connection (the caller's, HUB_QUEUED: its round failed, or the worker stops):
 * its socket's reading is shut and it goes to the I/O thread as HUB_DROPPED, which hands it
 * to Python at once (why SV_CLOSED) without reading on: a socket shut for reading still
 * reads what its peer sent, a next ROUND among it. */
void hf_hub_drop(struct hf_hub *h, struct hf_conn *c)
{
    drop(h, c, SV_CLOSED, 0);
}
