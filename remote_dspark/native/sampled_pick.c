/* sampled_pick.c: rules 1 and 3 of the sampled drafts' rule (sampled_pick.h) for the
 * twin test, tests/native/test_sampled_pick.py, which holds them bit for bit to numpy's. */
#include "sampled_pick.h"

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
