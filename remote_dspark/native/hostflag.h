/* hostflag.h: what the files of the hostflag library share (hostflag.c: the ring's words,
 * the hand-off and the sleeps; proxy_end.c: the proxy's take and answer; watchdog.c: the
 * engine's watchdog thread; tcp_round.c, desc_check.c and reply_check.c: the proxy's round
 * on a TCP socket, its descriptor check and its DRAFTS reader, with tcp_round.h between
 * them; worker_round.c: the worker's round in; engine_meta.c: the engine's round
 * metadata; engine_round.c: the engine's host side of a round; cuda_launch.c: the engine
 * stream's half of a round; worker_serve.c: a worker connection with a Markov drafter
 * served in C; abi.c: what the loader checks). The library's ABI (HF_ABI) covers them
 * all; remote_dspark/native/build.py builds them together, native/structs.py mirrors the
 * structs below with ctypes and native/binding.py checks their sizes at load.
 *
 * Status codes: HF_OK, HF_TIMEOUT (deadline passed), HF_LATE (the round was already
 * claimed), HF_ORDER (the previous round is not claimed yet: a caller bug), HF_STATE
 * (a word holds a value its protocol forbids), HF_NOMEM, HF_SYS (errno is set).
 *
 * The codes Python mirrors (the status codes, the drafts statuses a proxy writes, and
 * hf_round's HF_EV_* events) are reported by hf_codes (abi.c), and the loader refuses a
 * library whose values are not Python's.
 */
#ifndef HOSTFLAG_H
#define HOSTFLAG_H

#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define HF_ABI 27   /* native.binding.ABI_VERSION: the loader refuses any other */

/* Not exported: shared between the library's files only. */
#define HF_INTERNAL __attribute__((visibility("hidden")))

enum { HF_OK = 0, HF_TIMEOUT = 1, HF_LATE = 2, HF_ORDER = 3, HF_STATE = 4, HF_NOMEM = 5, HF_SYS = 6 };

/* Where the words and the drafts slots of one region are, in this process. */
struct hf_ring {
    uint32_t *gathered;      /* engine stream: last round gathered into staging */
    uint32_t *released;      /* claimer: last round whose drafts are published */
    uint32_t *claim;         /* CAS: last round claimed by the proxy, watchdog or engine */
    uint32_t *waiters;       /* engine threads asleep on `released`: every release wakes them */
    uint64_t *gathered_ns;   /* [depth] CLOCK_MONOTONIC ns of each slot's gather; 0 = unknown */
    uint8_t *drafts;         /* drafts slot 0 */
    uint64_t drafts_stride;  /* bytes between drafts slots */
    uint32_t depth;          /* ring depth, a power of two */
    uint32_t d_round;        /* offset of the slot's round word */
    uint32_t d_status;       /* offset of the slot's status word */
    uint32_t d_zero;         /* first byte zeroed for an empty answer (n_entries, flags, counts,
                                statuses, tokens, and a sampled layout's q blocks) */
    uint32_t zero_bytes;     /* how many bytes from d_zero */
    uint32_t pad;
};

/* The wire contract's fixed parts (remote_dspark/wire/, protocol 6), for tcp_round.c and
 * worker_round.c: the header, the fixed parts of ROUND and DRAFTS, a ROUND's caps
 * (entries, drafts wanted, row bytes, tokens), where a descriptor keeps its rows-pending
 * word and the ROUND payload (region.layout.DESC_PENDING, DESC_FIXED); a sampled
 * session's terms: its ROUND's bytes per entry (temperature f32, seed u64), DRAFTS'
 * distributions flag, a position's ids and their weights' exact sum, and a sampled
 * DRAFTS' caps. W_MAX_PAYLOAD is wire.MAX_PAYLOAD, the cap a ROUND must keep. Each wire
 * constant is reported by hf_wire_constants, and the loader refuses a library whose
 * values are not remote_dspark.wire's. */
enum { W_HEADER = 24, W_VERSION = 8, W_ROUND = 3, W_DRAFTS = 4, W_BYE = 5, W_PING = 7,
       W_ROUND_FIXED = 16, W_DRAFTS_FIXED = 8, W_NEW_GEN = 1, W_MARGINS = 1, W_RESYNC = 1,
       DESC_PENDING = 4, DESC_FIXED = 8, W_SAMPLED_BYTES = 12, W_SAMPLED = 2, W_TOP = 32, W_TOTAL = 65535,
       W_MAX_SAMPLED_ENTRIES = 1024, W_MAX_SAMPLED_N_OUT = 16, W_MAX_ENTRIES = 4096, W_MAX_N_OUT = 64,
       W_MAX_ROW_BYTES = 1 << 20, W_MAX_TOKENS = 1 << 22 };
#define W_MAGIC "DSPW"
#define W_MAX_PAYLOAD (64ull << 20)

/* The entries of the round in descriptor slot `desc` whose rows are not in staging yet
 * (its DESC_PENDING word, region.layout's): a CPU engine publishes a round before its
 * rows and counts them down as it copies them (engine_round.c), releasing each count
 * after the rows it covers; every other writer leaves the word 0. The acquire makes the
 * rows it no longer counts visible. */
static inline uint32_t hf_rows_pending(const uint8_t *desc)
{
    return __atomic_load_n((const uint32_t *)(desc + DESC_PENDING), __ATOMIC_ACQUIRE);
}

static inline int cyc_geq(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The drafts statuses a proxy writes (outcome.Outcome OK .. BREAKER_SKIP); the engine's
 * own (WATCHDOG, NO_PROXY, ORPHAN) reach the library as arguments from Python. */
enum { ST_OK = 0, ST_TIMEOUT = 1, ST_ERROR = 2, ST_BREAKER_SKIP = 3,
       HF_PROXY_OUTCOMES = ST_BREAKER_SKIP + 1 };

/* What hf_round did with the round it took (outcome.RoundEvent mirrors these). */
enum { HF_EV_OK, HF_EV_AT_ONCE, HF_EV_TIMEOUT, HF_EV_LOST, HF_EV_PROTOCOL, HF_EV_BAD_REPLY,
       HF_EV_BAD_DESC };

/* One proxy's view of one region, in the proxy's process: the ring, its counters block,
 * and the rounds it has taken. Filled by remote_dspark.proxy.ring_end.ProxyEnd; one
 * thread uses it.
 * The proxy's whole critical path is two calls: hf_take, then (after the network)
 * hf_answer, which claims, writes, publishes and counts, so after a release only the
 * return to the proxy's loop stands between it and the wait for the next round. */
struct hf_proxy {
    struct hf_ring ring;
    uint64_t *heartbeat;          /* header word: CLOCK_MONOTONIC ns of the last take */
    uint64_t *counters;           /* the proxy counters block (word indexes below) */
    const uint64_t *bounds;       /* histogram bucket upper bounds (ns), ascending */
    uint64_t *seen_ns;            /* [depth], private: when each taken round was seen */
    uint32_t *stamps;             /* [max_slots], private: the check that last saw each slot */
    uint64_t publish_timeout_ns;  /* how long to wait for the previous claimer's release */
    uint32_t n_bounds;            /* a histogram is n_bounds + 1 buckets, then the sum */
    uint32_t next;                /* the next round to take */
    uint32_t spin_us, nap_us;     /* wait_round: spin, then (nap_us) nap between looks at a round handed over */
    uint32_t c_outcome[HF_PROXY_OUTCOMES];   /* rounds_ok .. rounds_breaker_skip */
    uint32_t c_late, c_drafts, c_draft_tokens;
    uint32_t h_round, h_handoff;  /* round_latency, handoff_latency histograms */
    uint32_t d_counts, d_entry_status, d_tokens, d_margins;   /* drafts slot offsets */
    uint32_t num_spec, max_slots;
    uint32_t c_bad_desc;          /* rounds_bad_desc */
    uint32_t stamp_gen;           /* the last descriptor check's stamp (0: none yet) */
    uint32_t vocab_size;          /* the engine's vocabulary (HELLO's): token ids 0..vocab_size-1; 0 unknown */
    uint32_t want_margin;         /* 1: HELLO asked for margins, so every DRAFTS carries them */
    uint32_t want_sampled;        /* 1: HELLO asked for sampled drafts: descriptors carry temperature
                                     and seed, every DRAFTS the distributions (the layout is sampled) */
    uint32_t d_q_ids, d_q_weights;  /* drafts slot offsets of a sampled layout's q blocks */
    uint32_t *wake;               /* the wake words [published, sleeping], or NULL: never sleep */
    const uint8_t *desc;          /* descriptor 0, for its rows-pending word (hf_take) */
    uint64_t desc_stride;
    uint32_t idle;                /* private: the last wait ended asleep, with nothing handed over */
};

/* One proxy's connection to the worker, for hf_round: the proxy's whole round in C.
 * Python connects and says HELLO, then hands the socket over and reads nothing more
 * from it; it sets fd, send and at_once(_max) before each call and reads the results after.
 * The receive state lives here across calls, so a reply that comes after its round's
 * deadline stays in step (and is dropped as late) instead of breaking the stream. */
struct hf_link {
    const uint8_t *desc;          /* descriptor 0 (the ROUND payload but its rows is sent from it) */
    const uint8_t *staging;       /* staging slot 0 (the rows are sent from it) */
    uint8_t *image;               /* the proxy's private drafts image, hf_answer's */
    uint8_t *rx;                  /* the DRAFTS payload buffer, rx_cap bytes */
    uint64_t desc_stride, staging_stride;
    uint64_t session;             /* the proxy's session, in every ROUND header */
    uint64_t conn;                /* the connection the next round takes: epoch << 32 | the
                                     descriptor as u32 (-1: none), stored (release) by the
                                     link whenever its active changes, loaded (acquire) by
                                     each round after its wait */
    uint64_t cur;                 /* the connection the receive state (got, hdr) belongs to */
    uint64_t used;                /* results: the connection the last round took */
    uint32_t row_bytes, max_tokens;
    uint32_t rx_cap;              /* the largest DRAFTS payload the wire allows */
    uint32_t max_entries, max_n_out;   /* wire caps of a DRAFTS frame */
    uint32_t default_deadline_ms; /* a descriptor's deadline 0 means this */
    int32_t fd;                   /* the round's connection (conn's descriptor), or -1 */
    uint32_t send;                /* 1: the breaker lets this round use the network */
    uint32_t at_once;             /* the status of a round answered without the network */
    uint32_t at_once_max;         /* how many such rounds one call may answer */
    uint32_t got;                 /* bytes of the current reply frame read (header, payload) */
    uint8_t hdr[W_HEADER];        /* the current reply frame's header */
    uint32_t served;              /* results: the rounds answered, */
    uint32_t round;               /* the last one, */
    uint32_t late;                /* replies to earlier rounds dropped, */
    uint32_t sent;                /* 1 when the round went on the network, */
    int32_t answer;               /* hf_answer's status (HF_LATE: another claimer was first), */
    int32_t err;                  /* errno of a failed send or receive, */
    uint64_t net_ns;              /* the time from the send to the reply or giving up, */
    char why[200];                /* and what broke (any event but OK and AT_ONCE). */
};

/* One worker session's windows, for hf_worker_round (worker_round.c): the arrays of its
 * remote_dspark.worker.windows.Windows (their pointers; Python owns them) and the
 * session's terms. Filled once per session by remote_dspark.worker.native_round, the
 * worker's terms (max_positions, max_round_tokens) at every call. */
struct hf_windows {
    int32_t *ring;                /* [max_slots, keep + window]: token j at column j % keep, and at
                                     keep + j % keep when j % keep < window */
    int64_t *written, *gen, *next_pos;   /* [max_slots] each */
    uint8_t *known;               /* [max_slots] bool */
    uint8_t *seen;                /* [max_slots] zeros: the duplicate check's marks, cleared after use */
    uint64_t max_positions;       /* the drafter's position table; UINT64_MAX: none */
    uint32_t max_slots, window, keep, num_spec;   /* keep >= window: tokens a slot keeps */
    uint32_t sampled;             /* 1: the session's HELLO asked for sampled drafts */
    uint32_t row_bytes;           /* the HELLO's row size; HF_ANY_ROW_BYTES: not checked */
    uint32_t max_round_tokens;    /* this worker's --max-round-tokens */
    uint32_t *guard;              /* a word of the view's: held (1) while a round changes the windows
                                     in worker_serve.c, and by hf_windows_forget */
};
#define HF_ANY_ROW_BYTES UINT32_MAX

/* One round's drafting batch, hf_worker_round's output: arrays Python allocates with room
 * for n_room entries (and n_room x window context tokens), filled in entry order with the
 * entries drafted (the drafter's DraftBatch), then the counts. */
struct hf_batch {
    uint8_t *ok, *drafted;        /* [n] the entry has a window (else RESYNC); it is drafted */
    int32_t *tokens;              /* the contexts, flat */
    int32_t *n_out;               /* [m] drafts wanted, at most width */
    int64_t *offsets;             /* [m + 1] */
    int64_t *slots, *gens, *lengths, *starts;   /* [m] each */
    float *temperature;           /* [m], a sampled session's */
    uint64_t *seed;               /* [m], a sampled session's */
    uint64_t n_tokens;            /* out: the contexts' tokens */
    uint32_t n_room;              /* in */
    uint32_t n, m, n_ok, width, deadline_ms, row_bytes;   /* out */
    uint32_t pad;
};

/* A greedy Markov table, for worker_serve.c's drafting (remote_dspark.drafter.markov's
 * arrays; Python owns them): the contexts sorted as signed ints, oldest token first, and
 * per row (plus the sentinel row `rows`: token 0, margin 0, successor itself) the most
 * frequent next token, its top1-top2 margin and the row drafting moves to after it. */
struct hf_markov {
    const int32_t *ctx;           /* [rows, order] */
    const int32_t *first;         /* [rows + 1] */
    const float *margin;          /* [rows + 1] */
    const int64_t *succ;          /* [rows + 1], each in 0..rows */
    const int64_t *dense;         /* [radix^order]: the row of each context whose tokens are all in
                                     lo..lo+radix-1, keyed in that mixed radix; NULL: search ctx */
    int64_t lo;
    uint64_t rows, radix;
    uint32_t order, context_read; /* context_read: the scheduler's cost of a context (its last tokens read) */
};

/* One worker connection served in C by hf_worker_serve (worker_serve.c): the socket, the
 * buffers and the session's windows Python owns, and what each call reports. */
struct hf_serve {
    int32_t fd;                   /* the connection (HELLO done) */
    uint32_t want_margin;         /* the session's HELLO asked for margins */
    struct hf_windows *w;         /* the session's windows, and the worker's terms */
    struct hf_batch *b;           /* room for a round of max_slots entries */
    const struct hf_markov *m;
    uint8_t *rx;                  /* the payload buffer */
    uint8_t *tx;                  /* the DRAFTS frame buffer, tx_size bytes */
    uint64_t rx_size, tx_size;
    uint64_t max_payload;         /* the connection's cap (a larger header goes to Python) */
    uint64_t frame_ns;            /* a frame begun must be whole within this (UINT64_MAX: no limit) */
    uint64_t send_ns;             /* a reply's send waits for room at most this (UINT64_MAX: no limit) */
    /* The frame being read, kept across calls (a payload larger than rx goes back to
     * Python for a larger buffer, then on) */
    uint8_t hdr[W_HEADER];
    uint64_t got;                 /* bytes of the frame read or dropped: header, then payload */
    uint64_t frame_deadline_ns;
    uint32_t phase;               /* what its next bytes are for (worker_serve.c's PH_*; 0 between frames) */
    /* Out: errno for SV_LOST, and a served round's facts */
    uint32_t err;
    uint32_t entries, resyncs, beyond_positions, draft_tokens, drafted, expired;
    uint64_t call_tokens;         /* the drafting call's cost (the scheduler's call_cost) */
    uint64_t round_ns;            /* the worker's time on it, its waits for its rows not counted */
    uint64_t drafting_ns;
};

/* Why hf_worker_serve returned, or why the hub hands a connection to Python
 * (remote_dspark.worker.lane.Why mirrors these). */
enum { SV_ROUND, SV_FRAME, SV_HEADER, SV_GROW, SV_CLOSED, SV_STALLED, SV_LOST, SV_UNSENT };

/* A worker connection served by the hub (worker_hub.c): its socket, buffers and windows
 * (Python owns them, each sized at HELLO for the session's largest frame and reply), the
 * frame being read, the reply being sent, and where the connection is (HUB_* states). */
struct hf_conn {
    int32_t fd;
    uint32_t id;                  /* its index in the hub's conns */
    struct hf_windows *w;
    struct hf_batch *b;           /* room for a round of max_slots entries */
    uint8_t *rx;                  /* the payload buffer: max_payload bytes */
    uint8_t *tx;                  /* the DRAFTS frame buffer, tx_size bytes */
    uint64_t tx_size, max_payload;
    uint32_t want_margin, state;  /* state: HUB_* (atomic: the I/O thread and the drafter's hand it over) */
    uint8_t hdr[W_HEADER];        /* the frame in hand's header */
    uint64_t got;                 /* its bytes read: header, then payload */
    uint64_t frame_deadline_ns;   /* a frame begun is whole by then */
    uint64_t tx_len, tx_sent, send_deadline_ns;   /* the reply being sent */
    uint64_t received_ns;         /* the round in hand was whole (CLOCK_MONOTONIC) */
    uint64_t serial;              /* its session's serial (the drafter's batch names it per entry) */
    uint32_t why, err;            /* out: why the connection is Python's (SV_*), errno */
    uint32_t pad;
    uint64_t session;             /* its session (the HELLO's): a PING answered here names it */
};

/* The hub (worker_hub.c): one epoll set over the served connections, a wake-up eventfd,
 * and the rounds ready to draft: a ring of connection ids one I/O thread pushes and the
 * drafter's thread takes (each connection has one round in flight at most, so `room`
 * entries never overflow). */
struct hf_hub {
    int32_t epfd, wakefd;
    uint32_t room;                /* conns' and ready's length */
    uint32_t stop;                /* set: hf_hub_io returns HUB_STOPPED */
    struct hf_conn **conns;       /* [room]: NULL where free */
    uint32_t *ready;              /* [room] ring of connection ids */
    uint32_t head, tail;          /* ready's: taken up to head, pushed up to tail */
    uint32_t wake;                /* futex word: bumped at every push and poke */
    uint32_t sleepers;            /* hf_hub_take's asleep on wake */
    uint64_t frame_ns, send_ns;   /* a frame's whole-by and a reply's wait for room; UINT64_MAX: none */
    uint64_t pings;               /* PINGs answered (the I/O thread its only writer) */
};

/* One drafting call's batch, several connections' rounds gathered by hf_hub_gather in
 * their order (Python owns the arrays, sized for the call's caps): the drafter's
 * DraftBatch, each entry's session, the rounds' facts. */
struct hf_call {
    int32_t *tokens;              /* [room_tokens] */
    int64_t *offsets;             /* [room_entries + 1] */
    int32_t *n_out;
    int64_t *slots, *gens, *lengths, *starts, *kept_from, *sessions;   /* [room_entries] each */
    float *temperature;           /* [room_entries], sampled rounds' */
    uint64_t *seed;
    uint8_t *rows;                /* [room_rows] bytes */
    uint64_t *received_ns;        /* [room_rounds]: each round's receipt */
    uint64_t *deadline_ns;        /* [room_rounds]: each round's deadline (UINT64_MAX: none) */
    uint64_t room_entries, room_tokens, room_rows;
    uint32_t keep_streams;        /* in: kept_from is written (the drafter keeps whole streams) */
    uint32_t sampled, row_bytes, width, margins;   /* out: the rounds' (all alike), widest, any */
    uint32_t room_rounds;         /* rounds a call gathers at most (a round may have no entry) */
    uint64_t m, n_tokens, n_rows; /* out: entries, context tokens, row bytes (needed, when over room) */
};

/* A round's drafts for hf_hub_reply, or a call's for hf_hub_answer, as the drafter's
 * result holds them: the drafted entries' counts and rows (each row `stride` elements
 * apart, of which a round reads its own width; q_* `qstride` apart, W_TOP per position),
 * NULL arrays for none (an expired round). */
struct hf_result {
    const int32_t *counts, *tokens;
    const float *margins;
    const int32_t *q_ids;
    const uint16_t *q_weights;
    uint64_t stride, qstride;
};

/* One batch's metadata as the engine holds it, for hf_host_meta (engine_meta.c): the
 * arrays' pointers (Python owns them), each of int32 or int64 (its *_size: 4 or 8;
 * new_gen is bool bytes; n_out NULL: n_out_default for every entry), the engine's terms,
 * and the duplicate check's marks. Per engine: the terms and marks are set once, the
 * arrays at every call. With `acked` (the region's context_tokens word: what the proxy's
 * worker acknowledged, 0 before its HELLO_ACK) each call sets context_tokens itself, as
 * engine.spec.Spec.context_cut does: the smaller of the word and context_cap, or
 * context_first (the cut before any acknowledgement, Python's) while the word is 0. */
struct hf_meta {
    const void *slots, *positions, *n_out, *offsets, *tokens;
    const uint8_t *new_gen;
    uint32_t *stamps;             /* [max_slots]: a slot is taken in a check when it holds stamp_gen */
    const uint32_t *acked;        /* NULL: context_tokens as the caller set it */
    uint64_t n, n_tokens;         /* entries; tokens before the cut */
    uint32_t slots_size, positions_size, n_out_size, offsets_size, tokens_size;
    uint32_t max_slots, num_spec, max_tokens, n_out_default, vocab_size, context_tokens;
    uint32_t deadline_ms, row_bytes;
    uint32_t stamp_gen;           /* in and out: the last check's number */
    uint32_t n_kept;              /* out: tokens after the cut */
    uint32_t context_cap, context_first;
    uint32_t pad[2];
    uint64_t written;             /* out: the payload bytes written (rows excepted) */
};

/* The driver's entry points and the loaded gather kernel, for hf_cuda_launch
 * (cuda_launch.c), and this engine's words: set once per engine by
 * remote_dspark.engine.writers.native_launch. Addresses only: this library links no CUDA. */
struct hf_cuda {
    void *launch_kernel, *write_value32, *wait_value32, *memcpy_async;  /* cuLaunchKernel, ... */
    void *gather;                 /* the CUfunction of gather.ptx's hf_gather */
    uint64_t gathered, released;  /* the words' device addresses */
    uint32_t *wake;               /* the announce word (host) */
};

/* One round's stream work for hf_cuda_launch: the gather of n rows (n 0: none) of
 * row_units units (unit_bytes: 1 or 4) from src (src_rows rows, src_stride units apart)
 * by index (index_bytes: 4 or 8) into dst, packed; then `gathered = round`, the wait for
 * `released >= round`, and n_copies copies (each dst <- src, bytes). Device addresses. */
#define HF_LAUNCH_COPIES 5
#define HF_LAUNCH_TOO_BIG (-1)        /* a gather past the grid's limits (no CUresult is negative) */
enum { HF_STEP_GATHER = 0, HF_STEP_SIGNAL = 1, HF_STEP_WAIT = 2, HF_STEP_COPY = 3, HF_STEP_DONE = 100 };
struct hf_launch {
    void *stream;
    uint64_t src, index, dst;
    uint64_t src_stride, row_units, src_rows, n;
    uint32_t index_bytes, unit_bytes, round, n_copies;
    struct { uint64_t dst, src, bytes; } copy[HF_LAUNCH_COPIES];
    int32_t step;                 /* out: the step a failure stopped at (HF_STEP_*), HF_STEP_DONE */
    uint32_t pad;
};

/* The engine's host side of its rounds (engine_round.c): a CPU engine's hand-over and
 * answer, every engine's count of a launched round. Set once per engine by
 * remote_dspark.engine.writers.host_round but for the round's fields: the region's words and
 * slots, the batch's metadata (meta; NULL for a sampled engine) and rows, the outs. */
enum { HF_HR_OK = 0, HF_HR_META = 1, HF_HR_ROW = 2, HF_HR_ARGS = 3, HF_HR_OTHER = 4, HF_HR_GOT = 5 };
struct hf_host_round {
    const struct hf_ring *ring;   /* gathered, released, gathered_ns, drafts slots, depth */
    struct hf_meta *meta;         /* the round's metadata (hf_host_meta's terms) */
    uint32_t *wake;               /* the announce word */
    uint32_t *lost;               /* [max_slots]: the answer's lost slots */
    uint8_t *desc, *staging;      /* slot 0's descriptor and staging rows */
    uint64_t desc_stride, desc_room, staging_stride;
    uint64_t d_counts, d_statuses, d_tokens;  /* offsets in a drafts slot */
    const uint8_t *rows;          /* the round's rows: src_rows of them, src_stride bytes apart */
    const void *index;            /* [meta->n] row indexes of index_bytes (4 or 8) */
    uint64_t src_stride, src_rows;
    uint64_t hold_ns;             /* spin this long for the release (0: return once handed over) */
    uint64_t spin_cpu_ns;         /* out: the thread's CPU time in that spin */
    uint64_t drafted, draft_tokens;  /* out (answer): entries with drafts, their tokens */
    uint32_t row_bytes, index_bytes, num_spec, max_slots, round;
    uint32_t meta_rule, bad_entry, released_now;   /* out (round) */
    uint32_t head_round, status, got, flags, n_lost;  /* out (answer) */
    uint32_t pad;
};

static inline void count(const struct hf_proxy *p, uint32_t word, uint64_t n)
{
    __atomic_fetch_add(&p->counters[word], n, __ATOMIC_RELAXED);
}

/* hostflag.c's and proxy_end.c's, for the other files. */
uint64_t hf_now_ns(void);
uint32_t hf_rows_wait(const uint8_t *desc, uint32_t below, uint64_t deadline_ns);
int hf_wait_geq(const uint32_t *word, uint32_t value, uint32_t spin_us, uint32_t nap_us, uint64_t deadline_ns);
int hf_claim(uint32_t *claim, uint32_t round);
int hf_publish(uint32_t *released, uint32_t *waiters, uint32_t round, uint64_t deadline_ns);
void hf_announce(uint32_t *wake, uint32_t round);
void hf_signal(uint32_t *gathered, uint64_t *gathered_ns, uint32_t round, uint32_t *wake);
int hf_host_meta(struct hf_meta *m, uint8_t *dst, uint64_t room);
void hf_drafts_summary(const int32_t *counts, const int32_t *statuses, const uint32_t *slots, uint32_t got,
                       uint64_t *out, uint32_t *lost);
void hf_zero_drafts(const struct hf_ring *ring, uint32_t round, uint32_t status);
int hf_release_empty(const struct hf_ring *ring, uint32_t round, uint32_t status, uint64_t deadline_ns);
int hf_worker_round(struct hf_windows *w, const uint8_t *payload, uint64_t len, struct hf_batch *b);
/* Where a DRAFTS frame's sections are (wire.drafts_sections, header included), and its
 * size: hf_drafts_head lays them out and writes the header and fixed part (worker_serve.c). */
struct hf_drafts_at {
    uint64_t slots, counts, statuses, tokens, margins, q_ids, q_weights, size;
};
HF_INTERNAL void hf_drafts_head(uint8_t *f, const uint8_t *round_hdr, const uint8_t *slots, uint32_t n,
                                uint32_t width, int margins, int sampled, struct hf_drafts_at *at);
HF_INTERNAL void hf_guard_take(uint32_t *g);   /* worker_serve.c's: a windows' guard word */
HF_INTERNAL void hf_guard_drop(uint32_t *g);
void hf_hub_poke(struct hf_hub *h);
void hf_hub_drop(struct hf_hub *h, struct hf_conn *c);
HF_INTERNAL void hf_release_store(uint32_t *released, uint32_t *waiters, uint32_t round);
HF_INTERNAL void hf_sleep_until_published(uint32_t *wake, uint32_t seen, uint64_t deadline_ns);
HF_INTERNAL void hf_nap_ns(uint64_t ns);
HF_INTERNAL int64_t hf_take_seen(struct hf_proxy *p, uint64_t timeout_ns, uint64_t *seen);
HF_INTERNAL int hf_answer_seen(struct hf_proxy *p, uint32_t round, uint32_t status, const uint8_t *image,
                               uint64_t seen);

#endif
