/* reply_check.c: a DRAFTS reply checked before anything of it is delivered (the wire's
 * rules, then what the round and the session asked: check_entries, check_distributions)
 * and unpacked into the proxy's drafts image for hf_answer (hf_unpack_drafts, for
 * hf_round; hf_unpack, for a caller that received the reply itself). */
#include "tcp_round.h"
#include "sampled_pick.h"

#include <math.h>

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
 * is delivered. THE RULE HAS A PYTHON TWIN: remote_dspark/engine/values/reply.py
 * (check_reply, sync mode) makes the same checks in the same order with the same words,
 * and tests/engine/values/test_reply_check.py runs the same replies through both and holds
 * their verdicts equal. Per entry, in order: count <= the round's n_out; a RESYNC entry has no drafts;
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
            return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: %u drafts, the round asked for %u", e, c, n_out);
        if (c && get16(statuses + 2u * e) == W_RESYNC)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: RESYNC with %u drafts", e, c);
        for (uint32_t j = 0; j < c; j++) {
            int32_t t = (int32_t)get32(tokens + 4u * (row + j));
            if (t < 0 || t > top)
                return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft token %d outside 0..%lld", e, t,
                            (long long)top);
        }
        for (uint32_t j = 0; margins && j < c; j++) {
            float m;
            memcpy(&m, margins + 4u * (row + j), 4);
            if (!(m >= 0.0f && m <= 1.0f))   /* printed as Python prints it: NaN unsigned */
                return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: margin %g not in [0, 1]", e,
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
 * among the ids of weight > 0, weights rising along the ids (the first rise), the drafted
 * token not the pick (sampled_pick.h) at the entry's seed and the draft's absolute
 * position (the ROUND's position + the entry's token count + j) and index j.
 * Branch-free over a position's ids (1,280 positions: 40 us on the H200 host's CPU; the
 * hash and the pick add 12 to 30 ns a position on the 2-core machine), the words found
 * only for the position that breaks it. */
static int check_distributions(struct hf_link *l, const struct hf_proxy *p, const struct round_view *v,
                               uint32_t width, const uint8_t *counts, const uint8_t *tokens,
                               const uint8_t *q_ids, const uint8_t *q_weights)
{
    uint32_t vocab = p->vocab_size ? p->vocab_size : (uint32_t)INT32_MAX + 1, keys[128], ids[W_TOP];
    uint16_t tags[128] = { 0 }, stamp = 0, w[W_TOP];
    for (uint32_t e = 0; e < v->n; e++) {
        uint64_t seed, first = (uint64_t)get32(v->positions + 4u * e) + get32(v->offsets + 4u * (e + 1))
                                - get32(v->offsets + 4u * e);   /* offsets non-decreasing: checked */
        memcpy(&seed, v->seed + 8u * e, 8);
        for (uint32_t j = 0, c = get16(counts + 2u * e); j < c; j++) {
            uint64_t at = (uint64_t)width * e + j;
            uint32_t token = get32(tokens + 4u * at), outside = 0, present = 0, sum = 0, rising = 0;
            memcpy(ids, q_ids + 4u * W_TOP * at, sizeof ids);
            memcpy(w, q_weights + 2u * W_TOP * at, sizeof w);
            for (int m = 0; m < W_TOP; m++) {   /* as u32, a negative id is >= 2^31 >= vocab */
                outside |= ids[m] >= vocab;
                sum += w[m];
                present |= (ids[m] == token) & (w[m] > 0);
                rising |= m > 0 && w[m] > w[m - 1];
            }
            int m = 0;
            if (outside) {
                while (ids[m] < vocab)
                    m++;
                return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft %u: id %d outside 0..%u", e, j,
                            (int32_t)ids[m], vocab - 1);
            }
            if (!distinct(ids, keys, tags, ++stamp))
                return hf_fail(l, HF_EV_PROTOCOL, 0, "entry %u: draft %u: id %d repeated", e, j,
                            smallest_repeated(q_ids + 4u * W_TOP * at));
            if (sum != W_TOTAL)
                return hf_fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: weights sum to %u (each 0..%d), expected exactly %d", e, j,
                            sum, W_TOTAL, W_TOTAL);
            if (!present)
                return hf_fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: drafted token %d not among its ids of weight > 0", e, j,
                            (int32_t)token);
            if (rising) {
                for (m = 1; w[m] <= w[m - 1]; m++)
                    ;
                return hf_fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: weights rise at index %d (%u, then %u): expected non-increasing",
                            e, j, m, w[m - 1], w[m]);
            }
            uint32_t pick = ids[hf_pick_index(w, hf_uniform_u32(seed, first + j, j))];
            if (pick != token)
                return hf_fail(l, HF_EV_PROTOCOL, 0,
                            "entry %u: draft %u: drafted token %d, the pick at its seed and position %llu is %d",
                            e, j, (int32_t)token, (unsigned long long)(first + j), (int32_t)pick);
        }
    }
    return HF_EV_OK;
}

/* Check the DRAFTS payload in rx (the wire's rules, then against round view v and what
 * the session asked: check_entries, check_distributions) and write it into the drafts
 * image: counts and statuses as i32, each row (tokens, margins, a sampled reply's q ids
 * and weights) widened to num_spec, zero past its count. */
int hf_unpack_drafts(struct hf_link *l, const struct hf_proxy *p, const struct round_view *v,
                         uint32_t len)
{
    const uint8_t *b = l->rx;
    if (len > l->rx_cap)
        return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes exceeds the cap %u", len, l->rx_cap);
    if (len < W_DRAFTS_FIXED)
        return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes, under %u", len, W_DRAFTS_FIXED);
    uint32_t n = get32(b), width = get16(b + 4), flags = get16(b + 6), K = p->num_spec;
    if (n > l->max_entries || width > l->max_n_out)
        return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS of %u entries x %u over the caps", n, width);
    if (flags & ~(uint32_t)(W_MARGINS | W_SAMPLED))
        return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS unknown flags %#x", flags);
    if ((flags & W_SAMPLED) && (n > W_MAX_SAMPLED_ENTRIES || width > W_MAX_SAMPLED_N_OUT))
        return hf_fail(l, HF_EV_PROTOCOL, 0, "sampled DRAFTS of %u entries x %u over the caps %u x %u", n, width,
                    W_MAX_SAMPLED_ENTRIES, W_MAX_SAMPLED_N_OUT);
    uint64_t grid = 4u * (uint64_t)n * width, q = (flags & W_SAMPLED) ? (uint64_t)W_TOP * grid : 0;
    const uint8_t *slots = b + W_DRAFTS_FIXED, *counts = slots + 4u * (uint64_t)n;
    const uint8_t *statuses = counts + 2u * (uint64_t)n, *tokens = statuses + 2u * (uint64_t)n;
    const uint8_t *q_ids = tokens + grid * ((flags & W_MARGINS) ? 2 : 1), *q_weights = q_ids + q;
    uint64_t want = (uint64_t)(q_weights - b) + q / 2;   /* ids i32, weights u16 */
    if (len != want)
        return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS payload of %u bytes, its fields say %llu", len,
                    (unsigned long long)want);
    int full = width == K;
    for (uint32_t e = 0; e < n; e++) {
        uint32_t c = get16(counts + 2u * e), st = get16(statuses + 2u * e);
        if (c > width || st > W_RESYNC)
            return hf_fail(l, HF_EV_PROTOCOL, 0, "DRAFTS entry %u: count %u (width %u), status %u", e, c,
                        width, st);
        full &= c == width;
    }
    if (n != v->n)
        return hf_fail(l, HF_EV_BAD_REPLY, 0, "drafts for %u entries, the round has %u", n, v->n);
    if (memcmp(slots, v->slots, 4u * (uint64_t)n) != 0)
        for (uint32_t e = 0; e < n; e++)
            if (get32(slots + 4u * e) != get32(v->slots + 4u * e))
                return hf_fail(l, HF_EV_BAD_REPLY, 0, "entry %u: drafts for slot %u, the round has slot %u",
                            e, get32(slots + 4u * e), get32(v->slots + 4u * e));
    /* From here the reply breaks what the session asked (HELLO) or what the round asked:
     * a protocol error (the connection is dropped), as in engine/values/reply.py. */
    if (width > K)
        return hf_fail(l, HF_EV_PROTOCOL, 0, "drafts width %u over num_spec=%u", width, K);
    if (!(flags & W_MARGINS) != !p->want_margin)
        return hf_fail(l, HF_EV_PROTOCOL, 0, p->want_margin ? "DRAFTS without margins, the session asked for them"
                                                          : "DRAFTS with margins, the session did not ask for them");
    if (!(flags & W_SAMPLED) != !p->want_sampled)
        return hf_fail(l, HF_EV_PROTOCOL, 0, p->want_sampled ? "DRAFTS without distributions, the session asked for them"
                                                           : "DRAFTS with distributions, the session did not ask for them");
    int event = check_entries(l, p, v, n, width, counts, statuses, tokens,
                              (flags & W_MARGINS) ? tokens + grid : NULL);
    if (event == HF_EV_OK && (flags & W_SAMPLED))
        event = check_distributions(l, p, v, width, counts, tokens, q_ids, q_weights);
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

/* hf_round's reader of a DRAFTS reply, for a caller that received it itself: the `len`
 * bytes of payload in l->rx are checked against `round`'s descriptor (checked again
 * first) and written into l->image for hf_answer. HF_EV_OK, or HF_EV_BAD_DESC,
 * HF_EV_PROTOCOL or HF_EV_BAD_REPLY with l->why. Counts nothing. */
int hf_unpack(struct hf_proxy *p, struct hf_link *l, uint32_t round, uint32_t len)
{
    struct round_view v;
    l->why[0] = 0;
    int event = hf_check_round(p, l, round, &v);
    return event == HF_EV_OK ? hf_unpack_drafts(l, p, &v, len) : event;
}
