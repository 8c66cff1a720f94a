/* worker_round.c: the worker's per-round path (hf_worker_round). One call takes a
 * received ROUND payload, holds it to the wire contract's rules and the session's, applies
 * its entries to the session's windows and writes the drafter's batch in place.
 *
 * remote_dspark/worker/round.py's Python path (wire.decode_round, Windows.check_slots,
 * Windows.advance, drafting_batch) is the reference this file is tested against, verdict
 * for verdict and array for array (tests/worker/test_native_round.py). A refused round
 * changes nothing and returns the rule it broke (WR_*); the worker then names the culprit
 * in the reference's own words by checking that round again in Python, so the messages
 * are written once. Every rule is checked before the first window is touched. */
#include "hostflag.h"

#include <math.h>

/* The rule a refused round broke, in the reference's order (0: accepted). */
enum { WR_OK, WR_SHORT, WR_ENTRIES, WR_ROW_BYTES, WR_TOKENS, WR_SIZE, WR_FLAGS, WR_N_OUT,
       WR_OFFSETS, WR_BACKWARDS, WR_TEMPERATURE, WR_SESSION_ROWS, WR_ROUND_TOKENS, WR_SLOT_RANGE,
       WR_SLOT_TWICE, WR_ROOM };  /* WR_ROOM: the caller's arrays cannot hold the round (its bug) */

static uint32_t u32_at(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }

/* Where a checked ROUND's sections are, and its shape (wire.round_sections). */
struct wround {
    const uint8_t *slots, *positions, *n_out, *flags, *offsets, *temperature, *seed, *tokens, *rows;
    uint32_t n, n_tokens, row_bytes, deadline_ms, width;
};

/* Whether a ROUND of `len` bytes breaks a rule of the contract or of the session (WR_*):
 * wire.decode_round's, then drafting_batch's and Windows.check_slots'. Fills *v with the
 * round's shape when it does not. */
static int check_round(const struct hf_windows *w, const uint8_t *p, uint64_t len, struct wround *v)
{
    if (len < W_ROUND_FIXED)
        return WR_SHORT;
    uint32_t n = u32_at(p + 4), row_bytes = u32_at(p + 8), n_tokens = u32_at(p + 12);
    if (n > (w->sampled ? (uint32_t)W_MAX_SAMPLED_ENTRIES : (uint32_t)W_MAX_ENTRIES))
        return WR_ENTRIES;
    if (row_bytes > W_MAX_ROW_BYTES)
        return WR_ROW_BYTES;
    if (n_tokens > W_MAX_TOKENS)
        return WR_TOKENS;
    uint64_t meta = W_ROUND_FIXED + 4ull * (5ull * n + 1) + (w->sampled ? (uint64_t)W_SAMPLED_BYTES * n : 0);
    if (len != meta + 4ull * n_tokens + (uint64_t)n * row_bytes)
        return WR_SIZE;
    const uint8_t *a = p + W_ROUND_FIXED;
    v->slots = a, v->positions = a + 4ull * n, v->n_out = a + 8ull * n, v->flags = a + 12ull * n;
    v->offsets = a + 16ull * n, v->temperature = a + 20ull * n + 4, v->seed = v->temperature + 4ull * n;
    v->tokens = p + meta, v->rows = p + meta + 4ull * n_tokens;
    v->n = n, v->n_tokens = n_tokens, v->row_bytes = row_bytes, v->deadline_ms = u32_at(p);
    uint32_t flags = 0, n_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        flags |= u32_at(v->flags + 4ull * i);
        uint32_t k = u32_at(v->n_out + 4ull * i);
        n_out = k > n_out ? k : n_out;
    }
    if (flags & ~(uint32_t)W_NEW_GEN)
        return WR_FLAGS;
    if (n_out > W_MAX_N_OUT)
        return WR_N_OUT;
    if (u32_at(v->offsets) != 0 || u32_at(v->offsets + 4ull * n) != n_tokens)
        return WR_OFFSETS;
    for (uint32_t i = 0; i < n; i++)
        if (u32_at(v->offsets + 4ull * i) > u32_at(v->offsets + 4ull * (i + 1)))
            return WR_BACKWARDS;
    for (uint32_t i = 0; w->sampled && i < n; i++) {
        float t;
        memcpy(&t, v->temperature + 4ull * i, 4);
        if (!(isfinite(t) && t >= 0))
            return WR_TEMPERATURE;
    }
    if (w->row_bytes != HF_ANY_ROW_BYTES && row_bytes != w->row_bytes)
        return WR_SESSION_ROWS;
    if (n_tokens > w->max_round_tokens)
        return WR_ROUND_TOKENS;
    for (uint32_t i = 0; i < n; i++)
        if (u32_at(v->slots + 4ull * i) >= w->max_slots)
            return WR_SLOT_RANGE;
    int twice = 0;  /* marks in w->seen, cleared again before returning */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = u32_at(v->slots + 4ull * i);
        twice |= w->seen[s];
        w->seen[s] = 1;
    }
    for (uint32_t i = 0; i < n; i++)
        w->seen[u32_at(v->slots + 4ull * i)] = 0;
    v->width = n_out < w->num_spec ? n_out : w->num_spec;
    return twice ? WR_SLOT_TWICE : WR_OK;
}

/* One entry's tokens onto its slot's ring (Windows.advance): the entry's last `keep`
 * tokens, each at column j % keep of its row, and at j % keep + keep when under window. */
static void append(const struct hf_windows *w, uint32_t slot, uint64_t base, const uint8_t *tokens, uint32_t len)
{
    uint64_t W = w->window, K = w->keep;
    int32_t *row = w->ring + (uint64_t)slot * (K + W);
    for (uint32_t j = len > K ? len - (uint32_t)K : 0; j < len; j++) {
        int32_t t;
        memcpy(&t, tokens + 4ull * j, 4);
        uint64_t col = (base + j) % K;
        row[col] = t;
        if (col < W)
            row[col + K] = t;
    }
}

/* A checked round applied to the windows and its drafting entries written into *b. */
static void advance(const struct hf_windows *w, const struct wround *v, struct hf_batch *b,
                    uint64_t tokens_room)
{
    uint64_t W = w->window, at = 0;
    uint32_t m = 0, n_ok = 0;
    b->offsets[0] = 0;
    for (uint32_t i = 0; i < v->n; i++) {
        uint32_t s = u32_at(v->slots + 4ull * i), pos = u32_at(v->positions + 4ull * i);
        uint32_t o0 = u32_at(v->offsets + 4ull * i), len = u32_at(v->offsets + 4ull * (i + 1)) - o0;
        int new_gen = u32_at(v->flags + 4ull * i) & W_NEW_GEN;
        int ok = new_gen || (w->known[s] && (int64_t)pos == w->next_pos[s]);
        b->ok[i] = (uint8_t)ok;
        b->drafted[i] = 0;
        if (!ok) {
            w->known[s] = 0;
            continue;
        }
        n_ok++;
        if (new_gen)
            w->known[s] = 1, w->gen[s]++;
        uint64_t base = new_gen ? 0 : (uint64_t)w->written[s], written = base + len;
        append(w, s, base, v->tokens + 4ull * o0, len);
        w->written[s] = (int64_t)written;
        w->next_pos[s] = (int64_t)pos + len;
        uint64_t fill = written < W ? written : W, end = (uint64_t)pos + len;
        /* drafting_batch's beyond: a context whose drafts pass the position table gets none */
        if (fill && end + v->width > w->max_positions)
            continue;
        if (at + fill > tokens_room)  /* cannot happen: the room is n x window */
            continue;
        const int32_t *row = w->ring + (uint64_t)s * (w->keep + W);
        memcpy(b->tokens + at, row + (written - fill) % w->keep, fill * 4);
        at += fill;
        b->drafted[i] = 1;
        b->offsets[m + 1] = (int64_t)at;
        b->slots[m] = s, b->gens[m] = w->gen[s], b->lengths[m] = (int64_t)written;
        b->starts[m] = (int64_t)(end - fill);
        uint32_t k = u32_at(v->n_out + 4ull * i);
        b->n_out[m] = (int32_t)(k < v->width ? k : v->width);
        if (w->sampled) {
            memcpy(b->temperature + m, v->temperature + 4ull * i, 4);
            memcpy(b->seed + m, v->seed + 8ull * i, 8);
        }
        m++;
    }
    b->m = m, b->n_ok = n_ok, b->n_tokens = at;
}

/* The worker's round: `payload` (`len` bytes) checked and, when it breaks no rule,
 * applied to the windows of `w` and its drafting entries written into `b` (whose arrays
 * have room for the round's entries, n_room, and n_room x window context tokens). Returns
 * WR_OK, or the rule broken (nothing changed); b->n, width, deadline_ms and row_bytes are
 * the round's once its size is checked. The caller holds the windows' lock. */
int hf_worker_round(struct hf_windows *w, const uint8_t *payload, uint64_t len, struct hf_batch *b)
{
    struct wround v;
    int rule = check_round(w, payload, len, &v);
    if (rule != WR_OK)
        return rule;
    int missing = !b->ok || !b->drafted || !b->tokens || !b->n_out || !b->offsets || !b->slots || !b->gens
               || !b->lengths || !b->starts || (w->sampled && (!b->temperature || !b->seed));
    if (v.n > b->n_room || missing)
        return WR_ROOM;  /* the caller sized b for another round: refused, not overrun */
    b->n = v.n, b->width = v.width, b->deadline_ms = v.deadline_ms, b->row_bytes = v.row_bytes;
    advance(w, &v, b, (uint64_t)b->n_room * w->window);
    return WR_OK;
}
