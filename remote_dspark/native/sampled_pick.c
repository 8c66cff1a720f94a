/* sampled_pick.c: the sampling rule's randomness and pick in C (rules 1 and 3 of
 * remote_dspark/drafter/sampling.py), what the proxy's reply check holds each sampled
 * draft to (check_distributions). THE RULE HAS A PYTHON TWIN, written once for numpy and
 * torch in remote_dspark/sampled.py (mix32, hash_halves, uniform_u32; threshold,
 * pick_index), with the same constants; tests/native/test_sampled_pick.py holds the two
 * equal bit for bit. Python's values are 32-bit numbers held in 64-bit integers and
 * masked; here they are uint32_t, whose products wrap modulo 2^32 alike. */
#include "tcp_round.h"

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
uint32_t hf_uniform_u32(uint64_t seed, uint64_t position, uint32_t draft)
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
 * r = (u32 * W_TOTAL) >> 32, the first index whose running sum exceeds r (at most
 * W_TOP - 1). Branch-free: the count of running sums <= r. */
uint32_t hf_pick_index(const uint16_t *weights, uint32_t u32)
{
    uint32_t r = (uint32_t)(((uint64_t)u32 * W_TOTAL) >> 32), sum = 0, below = 0;
    for (int m = 0; m < W_TOP; m++) {
        sum += weights[m];
        below += sum <= r;
    }
    return below < W_TOP - 1 ? below : W_TOP - 1;
}

/* For the twin test: rule 1's number of each of n (seed, position, draft) into u32[i],
 * and rule 3's index of weights[i * W_TOP ..] for it into index[i]. */
void hf_sampled_picks(const uint64_t *seed, const int64_t *position, const uint32_t *draft,
                      const uint16_t *weights, uint32_t n, uint32_t *u32, uint32_t *index)
{
    for (uint32_t i = 0; i < n; i++) {
        u32[i] = hf_uniform_u32(seed[i], (uint64_t)position[i], draft[i]);
        index[i] = hf_pick_index(weights + (uint64_t)W_TOP * i, u32[i]);
    }
}
