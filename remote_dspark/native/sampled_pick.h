/* sampled_pick.h: the sampling rule's randomness and pick in C (rules 1 and 3 of
 * remote_dspark/drafter/sampling.py), what the proxy's reply check holds each sampled
 * draft to (check_distributions in reply_check.c, which inlines them). THE RULE HAS A
 * PYTHON TWIN, written once for numpy and torch in remote_dspark/sampled.py (mix32,
 * hash_halves, uniform_u32; threshold, pick_index), with the same constants;
 * tests/native/test_sampled_pick.py holds the two equal bit for bit through
 * hf_sampled_picks (sampled_pick.c). Python's values are 32-bit numbers held in 64-bit
 * integers and masked; here they are uint32_t, whose products wrap modulo 2^32 alike. */
#ifndef HF_SAMPLED_PICK_H
#define HF_SAMPLED_PICK_H

#include "hostflag.h"

/* The bijective 32-bit mixer (sampled.MIX_MULTIPLIERS, MIX_SHIFTS). */
static inline uint32_t mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

/* Rule 1: the uniform 32-bit number of (seed, position, draft): two lanes keyed by the
 * seed's halves (sampled.LANE_KEYS), each absorbing the position's low half, its high
 * half and the draft index; the output mixes the two. */
static inline uint32_t hf_uniform_u32(uint64_t seed, uint64_t position, uint32_t draft)
{
    const uint32_t k0 = 0x9E3779B9u, k1 = 0x7F4A7C15u;
    uint32_t a = mix32((uint32_t)seed ^ k0), b = mix32((uint32_t)(seed >> 32) ^ k1);
    const uint32_t in[3] = { (uint32_t)position, (uint32_t)(position >> 32), draft };
    for (int i = 0; i < 3; i++) {
        a = mix32(a ^ in[i]);
        b = mix32(b ^ in[i] ^ k1);
    }
    return mix32(a ^ b);
}

/* Rule 3: the index of the pick among a position's W_TOP weights for the number u32:
 * r = (u32 * W_TOTAL) >> 32, the first index whose running sum exceeds r, at most
 * W_TOP - 1 (Python's count of running sums <= r, clipped: the same, as the sums never
 * decrease). It stops there: a peaked distribution's pick is one of its first ids. */
static inline uint32_t hf_pick_index(const uint16_t *weights, uint32_t u32)
{
    uint32_t r = (uint32_t)(((uint64_t)u32 * W_TOTAL) >> 32), sum = 0, m = 0;
    for (; m < W_TOP - 1; m++) {
        sum += weights[m];
        if (sum > r)
            break;
    }
    return m;
}

#endif
