/* tcp_round.h: what the files of the proxy's round on a TCP socket share (tcp_round.c:
 * the round, its send and receive; desc_check.c: a round's descriptor check; reply_check.c:
 * a DRAFTS reply's check and its unpacking into the drafts image). Not exported. */
#ifndef TCP_ROUND_H
#define TCP_ROUND_H

#include "hostflag.h"

static inline uint32_t get32(const uint8_t *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static inline uint16_t get16(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

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
    const uint8_t *temperature;   /* a sampled session's [n] f32, else NULL */
    const uint8_t *seed;          /* a sampled session's [n] u64 (any value; 4-aligned only), else NULL */
};

/* Record what broke (l->why, l->err) and return `event` (tcp_round.c). */
HF_INTERNAL int hf_fail(struct hf_link *l, int event, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Check round `round`'s descriptor, filling *v (desc_check.c): HF_EV_OK, or HF_EV_BAD_DESC
 * with l->why. */
HF_INTERNAL int hf_check_round(struct hf_proxy *p, struct hf_link *l, uint32_t round, struct round_view *v);

/* Check the DRAFTS payload in l->rx against round view v and write it into l->image
 * (reply_check.c): HF_EV_OK, or HF_EV_PROTOCOL or HF_EV_BAD_REPLY with l->why. */
HF_INTERNAL int hf_unpack_drafts(struct hf_link *l, const struct hf_proxy *p, const struct round_view *v,
                                 uint32_t len);

#endif
