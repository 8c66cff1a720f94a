/* desc_check.c: the proxy's check of a round's descriptor before a byte of it is sent
 * or trusted (hf_check_round, for hf_round; hf_check_desc, for a caller that sends the
 * round itself). */
#include "tcp_round.h"

#include <math.h>

/* Check round `round`'s descriptor before a byte of it is sent or trusted: its
 * metadata may have been written by a GPU stream the host never checked. The rules are
 * the wire's (wire.decode_round) plus the region's (its slot range and sizes) and the
 * receiver's (unique slots). HF_EV_OK with *v filled, or HF_EV_BAD_DESC naming the field
 * and entry in l->why. */
int hf_check_round(struct hf_proxy *p, struct hf_link *l, uint32_t round, struct round_view *v)
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
        return hf_fail(l, HF_EV_BAD_DESC, 0, "descriptor %u holds round %u, not round %u", index, of, round);
    if (v->n > p->max_slots)
        return hf_fail(l, HF_EV_BAD_DESC, 0, "n_entries %u over max_slots=%u", v->n, p->max_slots);
    if (v->row_bytes != l->row_bytes)
        return hf_fail(l, HF_EV_BAD_DESC, 0, "row_bytes %u, the layout's is %u", v->row_bytes, l->row_bytes);
    if (v->n_tokens > l->max_tokens)
        return hf_fail(l, HF_EV_BAD_DESC, 0, "n_tokens %u over max_tokens=%u", v->n_tokens, l->max_tokens);
    v->meta = round_meta(v->n, p->want_sampled);
    uint64_t size = v->meta + 4u * (uint64_t)v->n_tokens + (uint64_t)v->n * v->row_bytes;
    if (size > W_MAX_PAYLOAD)
        return hf_fail(l, HF_EV_BAD_DESC, 0, "ROUND of %llu bytes over the cap %llu",
                    (unsigned long long)size, (unsigned long long)W_MAX_PAYLOAD);
    uint64_t n4 = 4u * (uint64_t)v->n;
    v->slots = f + W_ROUND_FIXED;
    v->positions = v->slots + n4;
    v->n_out = v->positions + n4;
    v->flags = v->n_out + n4;
    v->offsets = v->flags + n4;
    v->temperature = p->want_sampled ? v->offsets + n4 + 4 : NULL;
    v->seed = p->want_sampled ? v->temperature + n4 : NULL;
    uint32_t first = get32(v->offsets), last = get32(v->offsets + n4);
    if (first != 0 || last != v->n_tokens)
        return hf_fail(l, HF_EV_BAD_DESC, 0, "offsets run from %u to %u, expected 0 to n_tokens=%u",
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
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: offsets go back (%u, then %u)", e, at, next);
        if (slot >= p->max_slots)
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: slot %u not below max_slots=%u", e, slot,
                        p->max_slots);
        if (p->stamps[slot] == gen)
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: slot %u twice in the round", e, slot);
        p->stamps[slot] = gen;
        if (n_out > p->num_spec)
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: n_out %u over num_spec=%u", e, n_out,
                        p->num_spec);
        if (flags & ~(uint32_t)W_NEW_GEN)
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: flags %#x, only NEW_GEN (1) is known", e, flags);
        /* meta.sampling_meta's rule, for temperatures written on the device (any seed is one) */
        float t;
        if (v->temperature && (memcpy(&t, v->temperature + 4u * e, 4), !(isfinite(t) && t >= 0.0f)))
            return hf_fail(l, HF_EV_BAD_DESC, 0, "entry %u: temperature %g not a finite float32 >= 0", e, (double)t);
    }
    /* Token ids in the engine's vocabulary, when it is known: meta.host_meta's rule, for
     * metadata written on the device that no host ever read (device_meta.write_meta_in_stream). */
    if (p->vocab_size) {
        const uint8_t *tokens = f + v->meta;
        for (uint32_t j = 0; j < v->n_tokens; j++) {
            int32_t t = (int32_t)get32(tokens + 4u * j);
            if (t < 0 || (uint32_t)t >= p->vocab_size)
                return hf_fail(l, HF_EV_BAD_DESC, 0, "tokens: %d (token %u) outside 0..%u, the vocabulary", t, j,
                            p->vocab_size - 1);
        }
    }
    return HF_EV_OK;
}

/* Check `round`'s descriptor (check_desc) for a caller that sends the round itself (the
 * ofl transports): HF_EV_OK, or HF_EV_BAD_DESC with l->why. Counts nothing. */
int hf_check_desc(struct hf_proxy *p, struct hf_link *l, uint32_t round)
{
    struct round_view v;
    l->why[0] = 0;
    return hf_check_round(p, l, round, &v);
}
