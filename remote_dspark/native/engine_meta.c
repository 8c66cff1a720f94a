/* engine_meta.c: the engine's round metadata in one call (hf_host_meta). A batch's
 * arrays are held to the rules of remote_dspark.engine.values.meta.host_meta, its NEW_GEN
 * contexts cut to their last context_tokens, and the ROUND payload's fixed part, entry
 * arrays and tokens written into the round's descriptor slot: engine.values.meta.write_meta's
 * bytes.
 *
 * host_meta and write_meta stay the reference this file is tested against, verdict for
 * verdict and byte for byte (tests/engine/writers/test_native_meta.py). A refused batch writes
 * nothing and returns the rule it broke (HM_*); the engine then checks it again in
 * Python, whose ValueError names the culprit, so the messages are written once. Every
 * rule is checked before the first byte is written. */
#include "hostflag.h"

/* The rule a refused batch broke, in the reference's order (0: accepted). */
enum { HM_OK, HM_ARGS, HM_ENTRIES, HM_SLOT_RANGE, HM_SLOT_TWICE, HM_POSITIONS, HM_TOKENS, HM_OFFSETS,
       HM_BACKWARDS, HM_N_OUT, HM_MAX_TOKENS, HM_ROOM };  /* HM_ARGS, HM_ROOM: the caller's bug */

/* Element i of an int32 (size 4) or int64 (size 8) array. */
static inline int64_t at(const void *a, uint32_t size, uint64_t i)
{
    return size == 8 ? ((const int64_t *)a)[i] : (int64_t)((const int32_t *)a)[i];
}

static inline void put32(uint8_t *b, uint32_t v) { memcpy(b, &v, 4); }

static int sized(uint32_t size) { return size == 4 || size == 8; }

/* Whether the batch breaks a rule of host_meta (HM_*). Sets *kept, the tokens after the
 * cut, when it does not. */
static int check_meta(struct hf_meta *m, uint64_t *kept)
{
    uint64_t n = m->n;
    if (!sized(m->slots_size) || !sized(m->positions_size) || !sized(m->offsets_size) ||
        !sized(m->tokens_size) || (m->n_out && !sized(m->n_out_size)))
        return HM_ARGS;
    if (n > m->max_slots)
        return HM_ENTRIES;
    uint32_t gen = ++m->stamp_gen;   /* marks of earlier checks need no clearing */
    if (gen == 0) {
        memset(m->stamps, 0, 4u * (uint64_t)m->max_slots);
        gen = m->stamp_gen = 1;
    }
    for (uint64_t e = 0; e < n; e++) {
        uint64_t slot = (uint64_t)at(m->slots, m->slots_size, e);   /* a negative one is huge */
        if (slot >= m->max_slots)
            return HM_SLOT_RANGE;
        if (m->stamps[slot] == gen)
            return HM_SLOT_TWICE;
        m->stamps[slot] = gen;
    }
    for (uint64_t e = 0; e < n; e++)
        if ((uint64_t)at(m->positions, m->positions_size, e) > UINT32_MAX)
            return HM_POSITIONS;
    if (m->tokens_size == 8 || m->vocab_size)
        for (uint64_t i = 0; i < m->n_tokens; i++) {
            int64_t v = at(m->tokens, m->tokens_size, i);
            if (v < INT32_MIN || v > INT32_MAX || (m->vocab_size && (v < 0 || v >= m->vocab_size)))
                return HM_TOKENS;
        }
    if (at(m->offsets, m->offsets_size, 0) != 0 || at(m->offsets, m->offsets_size, n) != (int64_t)m->n_tokens)
        return HM_OFFSETS;
    /* From 0 without going back (compared, never subtracted first: a difference of
     * offsets near 2^63 would wrap), every offset is in 0..n_tokens: no sum below wraps. */
    for (uint64_t e = 0; e < n; e++)
        if (at(m->offsets, m->offsets_size, e + 1) < at(m->offsets, m->offsets_size, e))
            return HM_BACKWARDS;
    uint64_t total = 0;
    for (uint64_t e = 0; e < n; e++) {
        uint64_t len = (uint64_t)(at(m->offsets, m->offsets_size, e + 1) - at(m->offsets, m->offsets_size, e));
        uint64_t cut = m->new_gen[e] && len > m->context_tokens ? len - m->context_tokens : 0;
        if ((uint64_t)at(m->positions, m->positions_size, e) + cut > UINT32_MAX)
            return HM_POSITIONS;   /* the first token sent is past the wire's u32 */
        total += len - cut;
    }
    if (m->n_out)
        for (uint64_t e = 0; e < n; e++)
            if (at(m->n_out, m->n_out_size, e) < 0)
                return HM_N_OUT;
    if (total > m->max_tokens)
        return HM_MAX_TOKENS;
    *kept = total;
    return HM_OK;
}

/* Check the batch (HM_*: refused, nothing written) and write its ROUND payload, rows
 * excepted, into dst (room bytes), its NEW_GEN contexts cut to context_tokens (first set
 * from the acked word, when the struct has one): the fixed part (deadline_ms, n,
 * row_bytes, tokens), slots, positions (moved past a cut), n_out (at most num_spec), flags (FLAG_NEW_GEN),
 * offsets and tokens, each as the wire's u32 or i32. Sets m->n_kept and m->written. */
int hf_host_meta(struct hf_meta *m, uint8_t *dst, uint64_t room)
{
    if (m->acked) {
        uint32_t acked = __atomic_load_n(m->acked, __ATOMIC_ACQUIRE);
        m->context_tokens = !acked ? m->context_first : acked < m->context_cap ? acked : m->context_cap;
    }
    uint64_t kept = 0, n = m->n;
    int rule = check_meta(m, &kept);
    if (rule)
        return rule;
    uint64_t n4 = 4 * n, size = W_ROUND_FIXED + 5 * n4 + 4 + 4 * kept;
    if (size > room)
        return HM_ROOM;
    put32(dst, m->deadline_ms);
    put32(dst + 4, (uint32_t)n);
    put32(dst + 8, m->row_bytes);
    put32(dst + 12, (uint32_t)kept);
    uint8_t *slots = dst + W_ROUND_FIXED, *positions = slots + n4, *n_out = positions + n4;
    uint8_t *flags = n_out + n4, *offsets = flags + n4, *tokens = offsets + n4 + 4;
    uint32_t fixed_n_out = m->n_out_default < m->num_spec ? m->n_out_default : m->num_spec;
    uint64_t to = 0;
    for (uint64_t e = 0; e < n; e++) {
        int64_t from = at(m->offsets, m->offsets_size, e), len = at(m->offsets, m->offsets_size, e + 1) - from;
        uint64_t cut = m->new_gen[e] && (uint64_t)len > m->context_tokens ? (uint64_t)len - m->context_tokens : 0;
        uint64_t want = m->n_out ? (uint64_t)at(m->n_out, m->n_out_size, e) : fixed_n_out;
        put32(slots + 4 * e, (uint32_t)at(m->slots, m->slots_size, e));
        put32(positions + 4 * e, (uint32_t)((uint64_t)at(m->positions, m->positions_size, e) + cut));
        put32(n_out + 4 * e, (uint32_t)(want < m->num_spec ? want : m->num_spec));
        put32(flags + 4 * e, m->new_gen[e] ? W_NEW_GEN : 0);
        put32(offsets + 4 * e, (uint32_t)to);
        if (m->tokens_size == 4) {
            if ((uint64_t)len > cut)   /* (an empty tensor's data pointer may be NULL) */
                memcpy(tokens + 4 * to, (const int32_t *)m->tokens + from + cut, 4 * (len - cut));
        } else {
            for (int64_t i = (int64_t)cut; i < len; i++)
                put32(tokens + 4 * (to + i - cut), (uint32_t)(int32_t)((const int64_t *)m->tokens)[from + i]);
        }
        to += len - cut;
    }
    put32(offsets + n4, (uint32_t)to);
    m->n_kept = (uint32_t)kept;
    m->written = size;
    return HM_OK;
}
