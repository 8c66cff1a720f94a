/* worker_serve.c: a worker connection whose drafter is the greedy Markov table, served in
 * C (hf_worker_serve). One call waits for the next frame, and when it is a ROUND the
 * session can take, applies it to the windows (hf_worker_round's rules and code), drafts
 * it from the table, writes the DRAFTS frame and sends it, all without the interpreter;
 * it returns once per round with the round's facts, which Python counts while the engine
 * reads its drafts. The table never reads a round's rows: the round is applied and
 * drafted once the bytes before its rows are in, its rows are dropped in the kernel as
 * they come (MSG_TRUNC: TCP's recv discards without a copy), and the DRAFTS go out once
 * the frame is whole, so the drafting overlaps the rows' transfer. Anything else comes
 * back to Python whole (SV_FRAME: a BYE, a PING, which Python answers on this connection's
 * thread, a ROUND the C check refuses, which Python checks again to name the culprit) or as a header Python must judge (SV_HEADER), so every
 * message and rule of the Python loop stays written once, in remote_dspark/worker/.
 *
 * remote_dspark/worker/lane.py drives it; its reference is the Python path
 * (worker.round.answer with drafter.markov's numpy draft_batch), which the tests hold it
 * to reply for reply. */
#include "hostflag.h"

#include <poll.h>
#include <sys/socket.h>

static uint32_t get32(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static uint16_t get16(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

/* ----------------------------------------------------------------- the windows' guard */

HF_INTERNAL void hf_guard_take(uint32_t *g)
{
    while (__atomic_exchange_n(g, 1u, __ATOMIC_ACQUIRE))
        cpu_relax();
}

HF_INTERNAL void hf_guard_drop(uint32_t *g) { __atomic_store_n(g, 0u, __ATOMIC_RELEASE); }

/* Windows.forget_all for a session whose rounds may be served here: every slot forgotten
 * between two rounds, never in the middle of one (another connection's thread calls it,
 * when a new session of the engine replaces this one). */
void hf_windows_forget(struct hf_windows *w)
{
    hf_guard_take(w->guard);
    memset(w->known, 0, w->max_slots);
    hf_guard_drop(w->guard);
}

/* ----------------------------------------------------------------- the Markov table */

/* The row of the context `last` (order tokens, oldest first), or m->rows when unseen:
 * by the dense index when the table has one, else by a search of the sorted contexts. */
static uint64_t find(const struct hf_markov *m, const int32_t *last)
{
    if (m->dense) {
        uint64_t key = 0;
        for (uint32_t j = 0; j < m->order; j++) {
            uint64_t d = (uint64_t)((int64_t)last[j] - m->lo);
            if (d >= m->radix)  /* a token outside the table's range (below lo wraps high) */
                return m->rows;
            key = key * m->radix + d;
        }
        return (uint64_t)m->dense[key];
    }
    uint64_t lo = 0, hi = m->rows;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const int32_t *c = m->ctx + mid * m->order;
        int cmp = 0;
        for (uint32_t j = 0; j < m->order && !cmp; j++)
            cmp = c[j] < last[j] ? -1 : c[j] > last[j];
        if (!cmp)
            return mid;
        if (cmp < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return m->rows;
}

/* Up to n_out greedy drafts after the context `ctx` (`len` tokens) into drafts (and
 * margins, when not NULL); the slots past the count are left as they are. Returns the
 * count. MarkovModel.draft's rule: an unseen or short context ends the draft. */
static uint32_t draft_one(const struct hf_markov *m, const int32_t *ctx, uint64_t len, uint32_t n_out,
                          int32_t *drafts, float *margins)
{
    uint64_t row = len < m->order ? m->rows : find(m, ctx + len - m->order);
    uint32_t s = 0;
    for (; s < n_out && row < m->rows; s++) {
        drafts[s] = m->first[row];
        if (margins)
            margins[s] = m->margin[row];
        row = (uint64_t)m->succ[row];
    }
    return s;
}

/* MarkovModel.draft_batch in C (the tests hold it to the numpy one): n entries, entry i's
 * context tokens[offsets[i]:offsets[i + 1]], n_out[i] drafts at most, into [n, width]
 * drafts and margins (NULL: none), zero past counts[i]. */
void hf_markov_draft(const struct hf_markov *m, const int32_t *tokens, const int64_t *offsets,
                     const int32_t *n_out, uint32_t n, uint32_t width, int32_t *drafts, int32_t *counts,
                     float *margins)
{
    memset(drafts, 0, (uint64_t)n * width * 4);
    if (margins)
        memset(margins, 0, (uint64_t)n * width * 4);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t want = n_out[i] < 0 ? 0 : (uint32_t)n_out[i] > width ? width : (uint32_t)n_out[i];
        counts[i] = (int32_t)draft_one(m, tokens + offsets[i], (uint64_t)(offsets[i + 1] - offsets[i]), want,
                                       drafts + (uint64_t)i * width, margins ? margins + (uint64_t)i * width : NULL);
    }
}

/* ----------------------------------------------------------------- the socket */

/* Read into dst (room bytes; with MSG_TRUNC, which TCP honours, dst is NULL and the bytes
 * are dropped) by deadline_ns (UINT64_MAX: none): >0 bytes read, 0 the peer closed, -1
 * deadline, -2 failed (errno). */
static int64_t read_some(int fd, uint8_t *dst, uint64_t room, uint64_t deadline_ns, int flags)
{
    for (;;) {
        ssize_t k = recv(fd, dst, room, MSG_DONTWAIT | flags);
        if (k >= 0)
            return k;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -2;
        struct pollfd pfd = { fd, POLLIN, 0 };
        struct timespec ts, *tp = NULL;
        if (deadline_ns != UINT64_MAX) {
            uint64_t now = hf_now_ns();
            if (now >= deadline_ns)
                return -1;
            ts.tv_sec = (time_t)((deadline_ns - now) / 1000000000u);
            ts.tv_nsec = (long)((deadline_ns - now) % 1000000000u);
            tp = &ts;
        }
        if (ppoll(&pfd, 1, tp, NULL) < 0 && errno != EINTR)
            return -2;
    }
}

/* now + ns, UINT64_MAX (no deadline) where that does not fit. */
static uint64_t after(uint64_t ns)
{
    uint64_t now = hf_now_ns();
    return ns > UINT64_MAX - now ? UINT64_MAX : now + ns;
}

/* Send len bytes of buf whole, each wait for room at most wait_ns (the Python send's
 * rule: a peer that reads, however slowly, keeps its connection): 0 sent, -1 a wait
 * passed wait_ns, -2 failed (errno). */
static int send_all(int fd, const uint8_t *buf, uint64_t len, uint64_t wait_ns)
{
    uint64_t deadline_ns = after(wait_ns);
    while (len) {
        ssize_t k = send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            buf += k, len -= (uint64_t)k;
            deadline_ns = after(wait_ns);
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -2;
        uint64_t now = hf_now_ns();
        if (now >= deadline_ns)
            return -1;
        struct timespec ts = { (time_t)((deadline_ns - now) / 1000000000u), (long)((deadline_ns - now) % 1000000000u) };
        struct pollfd pfd = { fd, POLLOUT, 0 };
        if (ppoll(&pfd, 1, deadline_ns == UINT64_MAX ? NULL : &ts, NULL) < 0 && errno != EINTR)
            return -2;
    }
    return 0;
}

/* What the frame in hand's next bytes are for (s->phase). A ROUND is applied and drafted
 * as soon as the bytes before its rows are in, and its rows, which the table never reads,
 * are dropped as they come, so the drafting overlaps their transfer; it is answered once
 * the frame is whole. */
enum {
    PH_HEADER,  /* between frames, or in a header */
    PH_ROUND,   /* a ROUND's payload up to its rows (all of it when it has none) */
    PH_PYTHON,  /* a frame that goes back to Python whole: a BYE, a PING, or a ROUND C refuses */
    PH_ROWS,    /* the rows of a ROUND already applied, its reply written: dropped */
};

/* The payload bytes of the frame in hand that go into rx: a ROUND's up to its rows, once
 * its fixed part says where they start (a shape that does not add up reads whole, for
 * the check to refuse), or the whole payload. */
static uint64_t wanted(const struct hf_serve *s, uint64_t len)
{
    if (s->phase != PH_ROUND || len <= W_ROUND_FIXED)
        return len;
    if (s->got - W_HEADER < W_ROUND_FIXED)
        return W_ROUND_FIXED;
    uint64_t n = get32(s->rx + 4), row_bytes = get32(s->rx + 8), n_tokens = get32(s->rx + 12);
    if (n > len || row_bytes > len || n_tokens > len)  /* cannot add up; and with each below 2^32, */
        return len;                                    /* nothing below overflows */
    uint64_t before = W_ROUND_FIXED + 4 * (5 * n + 1) + (s->w->sampled ? W_SAMPLED_BYTES * n : 0) + 4 * n_tokens;
    return before < len && before + n * row_bytes == len ? before : len;
}

/* Why a read of the frame in hand got no bytes (read_some's k <= 0): SV_CLOSED,
 * SV_STALLED (its deadline) or SV_LOST (errno in s->err). */
static int read_failed(struct hf_serve *s, int64_t k)
{
    if (k == 0)
        return SV_CLOSED;
    if (k == -1)
        return SV_STALLED;
    s->err = (uint32_t)errno;
    return SV_LOST;
}

/* Read the frame begun in s up to what goes into rx (header, then payload: wanted):
 * SV_ROUND once there (the caller reads its type and phase), or why not. */
static int read_frame(struct hf_serve *s)
{
    while (s->got < W_HEADER) {  /* between frames: no deadline (an engine may idle for minutes) */
        int64_t k = read_some(s->fd, s->hdr + s->got, W_HEADER - s->got, UINT64_MAX, 0);
        if (k <= 0)
            return read_failed(s, k);  /* (no deadline between frames: never a stall) */
        s->got += (uint64_t)k;
        if (s->got == W_HEADER)
            s->frame_deadline_ns = after(s->frame_ns);
    }
    uint16_t version = get16(s->hdr + 4), type = get16(s->hdr + 6);
    uint64_t len = get32(s->hdr + 8);
    if (memcmp(s->hdr, W_MAGIC, 4) != 0 || version != W_VERSION || (type != W_ROUND && type != W_BYE && type != W_PING)
        || len > (type == W_ROUND ? s->max_payload : 0))  /* a BYE or a PING carries nothing */
        return SV_HEADER;
    if (s->phase == PH_HEADER)
        s->phase = type == W_ROUND ? PH_ROUND : PH_PYTHON;
    for (uint64_t want; s->got < W_HEADER + (want = wanted(s, len)); ) {  /* rx grows as the bytes come */
        uint64_t have = s->got - W_HEADER, fits = want < s->rx_size ? want : s->rx_size;
        if (have == fits)
            return SV_GROW;
        int64_t k = read_some(s->fd, s->rx + have, fits - have, s->frame_deadline_ns, 0);
        if (k <= 0)
            return read_failed(s, k);
        s->got += (uint64_t)k;
    }
    return SV_ROUND;
}

/* Drop the rest of the frame in hand (an applied round's rows) by the frame's deadline:
 * SV_ROUND once it is whole, or why not. The connection ends on any other answer, and
 * with it the session and the windows the round moved (a new connection says HELLO and
 * re-announces every slot), so they are never read again. */
static int drop_rows(struct hf_serve *s, uint64_t len)
{
    while (s->got < W_HEADER + len) {
        int64_t k = read_some(s->fd, NULL, W_HEADER + len - s->got, s->frame_deadline_ns, MSG_TRUNC);
        if (k <= 0)
            return read_failed(s, k);
        s->got += (uint64_t)k;
    }
    return SV_ROUND;
}

/* The frame in hand is done with: the next call reads the next one. */
static void next_frame(struct hf_serve *s)
{
    s->got = 0;
    s->phase = PH_HEADER;
}

/* ----------------------------------------------------------------- the round */

/* A DRAFTS frame's layout for n entries of `width` drafts (margins, a sampled session's
 * distributions) into *at, and its head written into f: zeroed whole, then the header
 * (the ROUND's session and round id from round_hdr), the fixed part and the n slots. */
HF_INTERNAL void hf_drafts_head(uint8_t *f, const uint8_t *round_hdr, const uint8_t *slots, uint32_t n,
                                uint32_t width, int margins, int sampled, struct hf_drafts_at *at)
{
    uint64_t cells = (uint64_t)n * width, q = cells * W_TOP;
    at->slots = W_HEADER + W_DRAFTS_FIXED, at->counts = at->slots + 4ull * n;
    at->statuses = at->counts + 2ull * n, at->tokens = at->statuses + 2ull * n;
    at->margins = at->tokens + 4 * cells, at->q_ids = at->margins + (margins ? 4 * cells : 0);
    at->q_weights = at->q_ids + (sampled ? 4 * q : 0), at->size = at->q_weights + (sampled ? 2 * q : 0);
    memset(f, 0, at->size);
    uint32_t plen = (uint32_t)(at->size - W_HEADER), version = W_VERSION | (W_DRAFTS << 16);
    uint16_t flags = (margins ? W_MARGINS : 0) | (sampled ? W_SAMPLED : 0), w16 = (uint16_t)width;
    memcpy(f, W_MAGIC, 4);
    memcpy(f + 4, &version, 4);
    memcpy(f + 8, &plen, 4);
    memcpy(f + 12, round_hdr + 12, 12);  /* the ROUND's session and round id */
    memcpy(f + W_HEADER, &n, 4);
    memcpy(f + W_HEADER + 4, &w16, 2);
    memcpy(f + W_HEADER + 6, &flags, 2);
    memcpy(f + at->slots, slots, 4ull * n);
}

/* The DRAFTS frame of the round in s->b (the ROUND's payload in rx, its header in hdr):
 * RESYNC where an entry has no window, the table's drafts for the drafted entries (none
 * when `expired`). Returns the frame's length. */
static uint64_t write_reply(struct hf_serve *s, int expired)
{
    const struct hf_batch *b = s->b;
    uint32_t n = b->n, width = b->width, margins = s->want_margin != 0;
    struct hf_drafts_at at;
    uint8_t *f = s->tx;
    hf_drafts_head(f, s->hdr, s->rx + W_ROUND_FIXED, n, width, (int)margins, 0, &at);
    uint64_t at_counts = at.counts, at_status = at.statuses, at_tokens = at.tokens, at_margins = at.margins;
    uint64_t size = at.size;
    int32_t *tokens = (int32_t *)(f + at_tokens);  /* 4-aligned: tx is, and so is every offset */
    float *margin = margins ? (float *)(f + at_margins) : NULL;
    uint64_t t0 = hf_now_ns(), cost = 0;
    uint32_t j = 0, total = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint16_t status = b->ok[i] ? 0 : W_RESYNC;
        memcpy(f + at_status + 2ull * i, &status, 2);
        if (!b->drafted[i])
            continue;
        uint64_t len = (uint64_t)(b->offsets[j + 1] - b->offsets[j]);
        /* batching.Charge's rule: what it reads, its drafts if it asks for any, 1 at least */
        uint64_t charge = (len < s->m->context_read ? len : s->m->context_read) + (b->n_out[j] > 0 ? width : 0);
        cost += charge ? charge : 1;
        uint16_t count = 0;
        if (!expired)
            count = (uint16_t)draft_one(s->m, b->tokens + b->offsets[j], len, (uint32_t)b->n_out[j],
                                        tokens + (uint64_t)i * width, margin ? margin + (uint64_t)i * width : NULL);
        memcpy(f + at_counts + 2ull * i, &count, 2);
        total += count, j++;
    }
    s->drafting_ns = expired || !b->m ? 0 : hf_now_ns() - t0;
    s->call_tokens = cost;
    s->draft_tokens = total;
    return size;
}

/* Serve the connection s until a frame needs Python or a round has been answered: one
 * call per ROUND. Returns SV_ROUND (answered and sent; its facts in s), SV_FRAME (a whole
 * frame, header in s->hdr and payload in rx, for Python: a BYE, a PING, or a ROUND the checks
 * refuse or these buffers cannot hold), SV_HEADER (a header Python must judge: another
 * type, version or magic, or a payload over the cap), SV_GROW (rx is full and what goes
 * into it goes on: call again with a larger rx holding the same bytes; the frame's state
 * is kept), SV_CLOSED, SV_STALLED (a frame not whole within frame_ns), SV_LOST (the
 * receive failed) or SV_UNSENT (the round was answered, but its reply's send failed, or
 * found no room within send_ns: ETIMEDOUT); errno in s->err. frame_ns and send_ns
 * UINT64_MAX: no limit. A round's round_ns is the worker's time on it, not its waits for
 * its rows: from the bytes before its rows in to its reply written, and from the frame
 * whole to the reply sent. */
int hf_worker_serve(struct hf_serve *s)
{
    s->err = 0, s->entries = s->resyncs = s->beyond_positions = s->draft_tokens = s->drafted = s->expired = 0;
    s->call_tokens = s->round_ns = s->drafting_ns = 0;
    int why = read_frame(s);
    if (why != SV_ROUND)
        return why;
    uint64_t received = hf_now_ns(), len = get32(s->hdr + 8);
    if (s->phase == PH_PYTHON) {
        next_frame(s);
        return SV_FRAME;
    }
    /* A reply for the most entries the payload names must fit tx before the windows move
     * (the Python path takes a round these buffers cannot). */
    uint64_t told = len >= W_ROUND_FIXED ? get32(s->rx + 4) : 0;
    uint64_t most = W_HEADER + W_DRAFTS_FIXED + told * (8 + 8ull * s->w->num_spec);
    int rule = told > s->b->n_room || most > s->tx_size;
    if (!rule) {
        hf_guard_take(s->w->guard);
        rule = hf_worker_round(s->w, s->rx, len, s->b);  /* reads nothing past the tokens */
        hf_guard_drop(s->w->guard);
    }
    if (rule) {  /* the rest of it into rx, for Python to name the culprit */
        s->phase = PH_PYTHON;
        if ((why = read_frame(s)) != SV_ROUND)
            return why;
        next_frame(s);
        return SV_FRAME;
    }
    const struct hf_batch *b = s->b;
    int expired = b->m && b->deadline_ms && hf_now_ns() - received > (uint64_t)b->deadline_ms * 1000000u;
    uint64_t size = write_reply(s, expired);
    uint64_t whole = hf_now_ns(), work_ns = whole - received;
    s->entries = b->n, s->resyncs = b->n - b->n_ok, s->beyond_positions = b->n_ok - b->m;
    s->drafted = expired ? 0 : b->m, s->expired = (uint32_t)expired;
    if (s->got < W_HEADER + len) {
        s->phase = PH_ROWS;
        if ((why = drop_rows(s, len)) != SV_ROUND)
            return why;
        whole = hf_now_ns();
    }
    next_frame(s);
    int sent = send_all(s->fd, s->tx, size, s->send_ns);
    s->round_ns = work_ns + (hf_now_ns() - whole);
    if (sent) {
        s->err = sent == -1 ? ETIMEDOUT : (uint32_t)errno;
        return SV_UNSENT;
    }
    return SV_ROUND;
}
