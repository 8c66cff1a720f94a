/* abi.c: what the loader (native.binding) checks before it binds the library: the ABI
 * (hf_abi_version), lock-free atomics (hf_lock_free), the sizes of the structs Python
 * mirrors (hf_sizeof), the wire constants the C uses (hf_wire_constants, held equal to
 * remote_dspark/wire/) and the codes Python mirrors (hf_codes, held equal to
 * native.binding's and outcome.py's enums). */
#include "hostflag.h"

/* The ABI this file implements; the loader refuses a library built from another one. */
int hf_abi_version(void) { return HF_ABI; }

/* Bit 0: 32-bit words are always lock-free; bit 1: 64-bit words are. The loader needs 3:
 * a word that falls back to a lock is not shared safely between processes. */
int hf_lock_free(void)
{
    return (__atomic_always_lock_free(sizeof(uint32_t), 0) ? 1 : 0)
         | (__atomic_always_lock_free(sizeof(uint64_t), 0) ? 2 : 0);
}

/* The sizes of the structs Python mirrors with ctypes; the loader compares them. */
uint64_t hf_sizeof(int which)
{
    return which == 0 ? sizeof(struct hf_ring) : which == 1 ? sizeof(struct hf_proxy)
         : which == 2 ? sizeof(struct hf_link) : which == 3 ? sizeof(struct hf_windows)
         : which == 4 ? sizeof(struct hf_batch) : which == 5 ? sizeof(struct hf_meta)
         : which == 6 ? sizeof(struct hf_cuda) : which == 7 ? sizeof(struct hf_launch)
         : which == 8 ? sizeof(struct hf_markov) : which == 9 ? sizeof(struct hf_serve)
         : which == 10 ? sizeof(struct hf_host_round) : which == 11 ? sizeof(struct hf_conn)
         : which == 12 ? sizeof(struct hf_hub) : which == 13 ? sizeof(struct hf_result)
         : which == 14 ? sizeof(struct hf_call) : 0;
}

/* The first n of `count` values into out (a loader's probe may ask for fewer or more
 * than there are); returns count. */
static uint32_t report(const uint64_t *all, uint32_t count, uint64_t *out, uint32_t n)
{
    for (uint32_t i = 0; i < n && i < count; i++)
        out[i] = all[i];
    return count;
}

/* The wire constants this file uses, in the order of native.WIRE_CONSTANTS (HEADER's
 * size, MAGIC as a little-endian u32, PROTOCOL_VERSION, ROUND, DRAFTS, BYE, ROUND_FIXED,
 * DRAFTS_FIXED, FLAG_NEW_GEN, DRAFTS_MARGINS, STATUS_RESYNC, MAX_PAYLOAD, SAMPLED_BYTES,
 * DRAFTS_SAMPLED, SAMPLED_TOP, SAMPLED_TOTAL, MAX_SAMPLED_ENTRIES, MAX_SAMPLED_N_OUT,
 * MAX_ENTRIES, MAX_N_OUT, MAX_ROW_BYTES, MAX_TOKENS, PING): the first n into out; returns how
 * many there are. */
uint32_t hf_wire_constants(uint64_t *out, uint32_t n)
{
    uint32_t magic;
    memcpy(&magic, W_MAGIC, 4);
    const uint64_t all[] = { W_HEADER, magic, W_VERSION, W_ROUND, W_DRAFTS, W_BYE, W_ROUND_FIXED,
                             W_DRAFTS_FIXED, W_NEW_GEN, W_MARGINS, W_RESYNC, W_MAX_PAYLOAD, W_SAMPLED_BYTES,
                             W_SAMPLED, W_TOP, W_TOTAL, W_MAX_SAMPLED_ENTRIES, W_MAX_SAMPLED_N_OUT,
                             W_MAX_ENTRIES, W_MAX_N_OUT, W_MAX_ROW_BYTES, W_MAX_TOKENS, W_PING };
    return report(all, sizeof all / sizeof all[0], out, n);
}

/* The codes Python mirrors, by table, in the order of native.binding.CODE_TABLES:
 * 0 the status codes (native.Status), 1 the drafts statuses a proxy writes
 * (outcome.Outcome OK .. BREAKER_SKIP), 2 hf_round's events (outcome.RoundEvent), 3 the
 * host round's codes (native.HostRoundCode). The
 * first n of table `which` into out; returns how many it has (0: no such table). */
uint32_t hf_codes(uint32_t which, uint64_t *out, uint32_t n)
{
    static const uint64_t status[] = { HF_OK, HF_TIMEOUT, HF_LATE, HF_ORDER, HF_STATE, HF_NOMEM, HF_SYS };
    static const uint64_t outcome[] = { ST_OK, ST_TIMEOUT, ST_ERROR, ST_BREAKER_SKIP };
    static const uint64_t event[] = { HF_EV_OK, HF_EV_AT_ONCE, HF_EV_TIMEOUT, HF_EV_LOST, HF_EV_PROTOCOL,
                                      HF_EV_BAD_REPLY, HF_EV_BAD_DESC };
    static const uint64_t host_round[] = { HF_HR_OK, HF_HR_META, HF_HR_ROW, HF_HR_ARGS, HF_HR_OTHER, HF_HR_GOT };
    switch (which) {
    case 0: return report(status, sizeof status / sizeof status[0], out, n);
    case 1: return report(outcome, sizeof outcome / sizeof outcome[0], out, n);
    case 2: return report(event, sizeof event / sizeof event[0], out, n);
    case 3: return report(host_round, sizeof host_round / sizeof host_round[0], out, n);
    default: return 0;
    }
}
