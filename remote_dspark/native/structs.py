"""``native.structs``: the ctypes mirrors of the structs in ``hostflag.h``. The binding
(:mod:`remote_dspark.native.binding`) compares each one's size with the library's
``hf_sizeof`` at load; a field added on one side only is refused there."""

from __future__ import annotations

import ctypes

HEADER = 24  # W_HEADER: a frame header's bytes (wire.HEADER.size; the loader holds the C's W_HEADER to it)
PROXY_OUTCOMES = 4  # HF_PROXY_OUTCOMES: the drafts statuses a proxy writes (Outcome OK .. BREAKER_SKIP)


class RingGeom(ctypes.Structure):
    """``struct hf_ring``: this process's addresses of one region's words and drafts
    slots. Filled by ``remote_dspark.shm.ring`` from the region's layout."""

    _fields_ = [
        ("gathered", ctypes.c_void_p),
        ("released", ctypes.c_void_p),
        ("claim", ctypes.c_void_p),
        ("waiters", ctypes.c_void_p),
        ("gathered_ns", ctypes.c_void_p),
        ("drafts", ctypes.c_void_p),
        ("drafts_stride", ctypes.c_uint64),
        ("depth", ctypes.c_uint32),
        ("d_round", ctypes.c_uint32),
        ("d_status", ctypes.c_uint32),
        ("d_zero", ctypes.c_uint32),
        ("zero_bytes", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class ProxyState(ctypes.Structure):
    """``struct hf_proxy``: one proxy's view of a region (its ring, its counters block
    and the rounds it has taken). Filled by ``remote_dspark.proxy.ring_end.ProxyEnd``."""

    _fields_ = [
        ("ring", RingGeom),
        ("heartbeat", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("bounds", ctypes.c_void_p),
        ("seen_ns", ctypes.c_void_p),
        ("stamps", ctypes.c_void_p),
        ("publish_timeout_ns", ctypes.c_uint64),
        ("n_bounds", ctypes.c_uint32),
        ("next", ctypes.c_uint32),
        ("spin_us", ctypes.c_uint32),
        ("nap_us", ctypes.c_uint32),
        ("c_outcome", ctypes.c_uint32 * PROXY_OUTCOMES),
        ("c_late", ctypes.c_uint32),
        ("c_drafts", ctypes.c_uint32),
        ("c_draft_tokens", ctypes.c_uint32),
        ("h_round", ctypes.c_uint32),
        ("h_handoff", ctypes.c_uint32),
        ("d_counts", ctypes.c_uint32),
        ("d_entry_status", ctypes.c_uint32),
        ("d_tokens", ctypes.c_uint32),
        ("d_margins", ctypes.c_uint32),
        ("num_spec", ctypes.c_uint32),
        ("max_slots", ctypes.c_uint32),
        ("c_bad_desc", ctypes.c_uint32),
        ("stamp_gen", ctypes.c_uint32),
        ("vocab_size", ctypes.c_uint32),
        ("want_margin", ctypes.c_uint32),
        ("want_sampled", ctypes.c_uint32),
        ("d_q_ids", ctypes.c_uint32),
        ("d_q_weights", ctypes.c_uint32),
        ("wake", ctypes.c_void_p),
        ("desc", ctypes.c_void_p),
        ("desc_stride", ctypes.c_uint64),
        ("idle", ctypes.c_uint32),
    ]


class LinkState(ctypes.Structure):
    """``struct hf_link``: one proxy's worker connection for ``hf_round`` (its region
    geometry, the receive state kept across rounds, and what the last call did). Filled
    by ``remote_dspark.proxy.ring_end.ProxyEnd.new_link`` (``TcpRounds`` for ``hf_round``; the end's
    own for ``hf_check_desc`` and ``hf_unpack`` on the ofl path)."""

    _fields_ = [
        ("desc", ctypes.c_void_p),
        ("staging", ctypes.c_void_p),
        ("image", ctypes.c_void_p),
        ("rx", ctypes.c_void_p),
        ("desc_stride", ctypes.c_uint64),
        ("staging_stride", ctypes.c_uint64),
        ("session", ctypes.c_uint64),
        ("conn", ctypes.c_uint64),
        ("cur", ctypes.c_uint64),
        ("used", ctypes.c_uint64),
        ("row_bytes", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("rx_cap", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("max_n_out", ctypes.c_uint32),
        ("default_deadline_ms", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("send", ctypes.c_uint32),
        ("at_once", ctypes.c_uint32),
        ("at_once_max", ctypes.c_uint32),
        ("got", ctypes.c_uint32),
        ("hdr", ctypes.c_uint8 * HEADER),
        ("served", ctypes.c_uint32),
        ("round", ctypes.c_uint32),
        ("late", ctypes.c_uint32),
        ("sent", ctypes.c_uint32),
        ("answer", ctypes.c_int32),
        ("err", ctypes.c_int32),
        ("net_ns", ctypes.c_uint64),
        ("why", ctypes.c_char * 200),
    ]


class WindowsView(ctypes.Structure):
    """``struct hf_windows``: one worker session's windows (the pointers of its
    ``worker.windows.Windows`` arrays) and terms, for ``hf_worker_round``, and the word
    that guards them while ``hf_worker_serve`` changes them. Filled once per session by
    ``remote_dspark.worker.native_round``."""

    _fields_ = [
        ("ring", ctypes.c_void_p),
        ("written", ctypes.c_void_p),
        ("gen", ctypes.c_void_p),
        ("next_pos", ctypes.c_void_p),
        ("known", ctypes.c_void_p),
        ("seen", ctypes.c_void_p),
        ("max_positions", ctypes.c_uint64),
        ("max_slots", ctypes.c_uint32),
        ("window", ctypes.c_uint32),
        ("keep", ctypes.c_uint32),
        ("num_spec", ctypes.c_uint32),
        ("sampled", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("max_round_tokens", ctypes.c_uint32),
        ("guard", ctypes.c_void_p),
    ]


class BatchOut(ctypes.Structure):
    """``struct hf_batch``: one round's drafting batch as ``hf_worker_round`` writes it
    (the array pointers and ``n_room`` in, the counts out)."""

    _fields_ = [
        ("ok", ctypes.c_void_p),
        ("drafted", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("n_out", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("gens", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("temperature", ctypes.c_void_p),
        ("seed", ctypes.c_void_p),
        ("n_tokens", ctypes.c_uint64),
        ("n_room", ctypes.c_uint32),
        ("n", ctypes.c_uint32),
        ("m", ctypes.c_uint32),
        ("n_ok", ctypes.c_uint32),
        ("width", ctypes.c_uint32),
        ("deadline_ms", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class MarkovTable(ctypes.Structure):
    """``struct hf_markov``: a greedy Markov table (``drafter.markov``'s arrays) for
    ``hf_markov_draft`` and ``hf_worker_serve``."""

    _fields_ = [
        ("ctx", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("margin", ctypes.c_void_p),
        ("succ", ctypes.c_void_p),
        ("dense", ctypes.c_void_p),
        ("lo", ctypes.c_int64),
        ("rows", ctypes.c_uint64),
        ("radix", ctypes.c_uint64),
        ("order", ctypes.c_uint32),
        ("context_read", ctypes.c_uint32),
    ]


class ServeState(ctypes.Structure):
    """``struct hf_serve``: one worker connection served by ``hf_worker_serve`` (the
    socket, buffers and session set by ``remote_dspark.worker.lane``; the frame being
    read kept across calls; a served round's facts out)."""

    _fields_ = [
        ("fd", ctypes.c_int32),
        ("want_margin", ctypes.c_uint32),
        ("w", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("rx", ctypes.c_void_p),
        ("tx", ctypes.c_void_p),
        ("rx_size", ctypes.c_uint64),
        ("tx_size", ctypes.c_uint64),
        ("max_payload", ctypes.c_uint64),
        ("frame_ns", ctypes.c_uint64),
        ("send_ns", ctypes.c_uint64),
        ("hdr", ctypes.c_uint8 * HEADER),
        ("got", ctypes.c_uint64),
        ("frame_deadline_ns", ctypes.c_uint64),
        ("phase", ctypes.c_uint32),
        ("err", ctypes.c_uint32),
        ("entries", ctypes.c_uint32),
        ("resyncs", ctypes.c_uint32),
        ("beyond_positions", ctypes.c_uint32),
        ("draft_tokens", ctypes.c_uint32),
        ("drafted", ctypes.c_uint32),
        ("expired", ctypes.c_uint32),
        ("call_tokens", ctypes.c_uint64),
        ("round_ns", ctypes.c_uint64),
        ("drafting_ns", ctypes.c_uint64),
    ]


class MetaIn(ctypes.Structure):
    """``struct hf_meta``: one batch's metadata for ``hf_host_meta`` (the arrays'
    pointers and element sizes, the engine's terms, the duplicate check's marks in; the
    tokens kept and the bytes written out)."""

    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("n_out", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("new_gen", ctypes.c_void_p),
        ("stamps", ctypes.c_void_p),
        ("acked", ctypes.c_void_p),
        ("n", ctypes.c_uint64),
        ("n_tokens", ctypes.c_uint64),
        ("slots_size", ctypes.c_uint32),
        ("positions_size", ctypes.c_uint32),
        ("n_out_size", ctypes.c_uint32),
        ("offsets_size", ctypes.c_uint32),
        ("tokens_size", ctypes.c_uint32),
        ("max_slots", ctypes.c_uint32),
        ("num_spec", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("n_out_default", ctypes.c_uint32),
        ("vocab_size", ctypes.c_uint32),
        ("context_tokens", ctypes.c_uint32),
        ("deadline_ms", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("stamp_gen", ctypes.c_uint32),
        ("n_kept", ctypes.c_uint32),
        ("context_cap", ctypes.c_uint32),
        ("context_first", ctypes.c_uint32),
        ("pad", ctypes.c_uint32 * 2),
        ("written", ctypes.c_uint64),
    ]


class CudaIn(ctypes.Structure):
    """``struct hf_cuda``: the CUDA driver's entry points and the loaded gather kernel
    (their addresses, resolved by ``remote_dspark.shm.cuda_driver``), and one engine's
    words, for ``hf_cuda_launch``. Set once per engine."""

    _fields_ = [
        ("launch_kernel", ctypes.c_void_p),
        ("write_value32", ctypes.c_void_p),
        ("wait_value32", ctypes.c_void_p),
        ("memcpy_async", ctypes.c_void_p),
        ("gather", ctypes.c_void_p),
        ("gathered", ctypes.c_uint64),
        ("released", ctypes.c_uint64),
        ("wake", ctypes.c_void_p),
    ]


class LaunchCopy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


LAUNCH_COPIES = 5  # HF_LAUNCH_COPIES: tokens, counts, q_ids, q_weights, the outcome


class LaunchIn(ctypes.Structure):
    """``struct hf_launch``: one round's stream work for ``hf_cuda_launch`` (the gather,
    the round id, the copies out; the failed step out)."""

    _fields_ = [
        ("stream", ctypes.c_void_p),
        ("src", ctypes.c_uint64),
        ("index", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("src_stride", ctypes.c_uint64),
        ("row_units", ctypes.c_uint64),
        ("src_rows", ctypes.c_uint64),
        ("n", ctypes.c_uint64),
        ("index_bytes", ctypes.c_uint32),
        ("unit_bytes", ctypes.c_uint32),
        ("round", ctypes.c_uint32),
        ("n_copies", ctypes.c_uint32),
        ("copy", LaunchCopy * LAUNCH_COPIES),
        ("step", ctypes.c_int32),
        ("pad", ctypes.c_uint32),
    ]


class HostRoundIn(ctypes.Structure):
    """``struct hf_host_round``: the engine's host side of its rounds for ``hf_host_round``,
    ``hf_host_answer`` and ``hf_host_summary`` (the region's words and slots and the
    answer's lost slots, set once by ``remote_dspark.engine.writers.host_round``; the round's rows
    and round id in; the verdicts, the hold's CPU time and the answer's head and sums out)."""

    _fields_ = [
        ("ring", ctypes.c_void_p),
        ("meta", ctypes.c_void_p),
        ("wake", ctypes.c_void_p),
        ("lost", ctypes.c_void_p),
        ("desc", ctypes.c_void_p),
        ("staging", ctypes.c_void_p),
        ("desc_stride", ctypes.c_uint64),
        ("desc_room", ctypes.c_uint64),
        ("staging_stride", ctypes.c_uint64),
        ("d_counts", ctypes.c_uint64),
        ("d_statuses", ctypes.c_uint64),
        ("d_tokens", ctypes.c_uint64),
        ("rows", ctypes.c_void_p),
        ("index", ctypes.c_void_p),
        ("src_stride", ctypes.c_uint64),
        ("src_rows", ctypes.c_uint64),
        ("hold_ns", ctypes.c_uint64),
        ("spin_cpu_ns", ctypes.c_uint64),
        ("drafted", ctypes.c_uint64),
        ("draft_tokens", ctypes.c_uint64),
        ("row_bytes", ctypes.c_uint32),
        ("index_bytes", ctypes.c_uint32),
        ("num_spec", ctypes.c_uint32),
        ("max_slots", ctypes.c_uint32),
        ("round", ctypes.c_uint32),
        ("meta_rule", ctypes.c_uint32),
        ("bad_entry", ctypes.c_uint32),
        ("released_now", ctypes.c_uint32),
        ("head_round", ctypes.c_uint32),
        ("status", ctypes.c_uint32),
        ("got", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("n_lost", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class HubConn(ctypes.Structure):
    """``struct hf_conn``: one connection served by the hub (``worker_hub.c``; its socket,
    buffers and session set by ``remote_dspark.worker.hub``; the frame and the reply in
    hand kept there; where it is, and why Python has it, out)."""

    _fields_ = [
        ("fd", ctypes.c_int32),
        ("id", ctypes.c_uint32),
        ("w", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("rx", ctypes.c_void_p),
        ("tx", ctypes.c_void_p),
        ("tx_size", ctypes.c_uint64),
        ("max_payload", ctypes.c_uint64),
        ("want_margin", ctypes.c_uint32),
        ("state", ctypes.c_uint32),
        ("hdr", ctypes.c_uint8 * HEADER),
        ("got", ctypes.c_uint64),
        ("frame_deadline_ns", ctypes.c_uint64),
        ("tx_len", ctypes.c_uint64),
        ("tx_sent", ctypes.c_uint64),
        ("send_deadline_ns", ctypes.c_uint64),
        ("received_ns", ctypes.c_uint64),
        ("serial", ctypes.c_uint64),
        ("why", ctypes.c_uint32),
        ("err", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("session", ctypes.c_uint64),
    ]


class HubState(ctypes.Structure):
    """``struct hf_hub``: the hub's epoll set, its connections and its ready ring."""

    _fields_ = [
        ("epfd", ctypes.c_int32),
        ("wakefd", ctypes.c_int32),
        ("room", ctypes.c_uint32),
        ("stop", ctypes.c_uint32),
        ("conns", ctypes.c_void_p),
        ("ready", ctypes.c_void_p),
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("wake", ctypes.c_uint32),
        ("sleepers", ctypes.c_uint32),
        ("frame_ns", ctypes.c_uint64),
        ("send_ns", ctypes.c_uint64),
        ("pings", ctypes.c_uint64),
    ]


class HubCall(ctypes.Structure):
    """``struct hf_call``: one drafting call's batch, rounds gathered by ``hf_hub_gather``."""

    _fields_ = [
        ("tokens", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("n_out", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("gens", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("kept_from", ctypes.c_void_p),
        ("sessions", ctypes.c_void_p),
        ("temperature", ctypes.c_void_p),
        ("seed", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("received_ns", ctypes.c_void_p),
        ("deadline_ns", ctypes.c_void_p),
        ("room_entries", ctypes.c_uint64),
        ("room_tokens", ctypes.c_uint64),
        ("room_rows", ctypes.c_uint64),
        ("keep_streams", ctypes.c_uint32),
        ("sampled", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("width", ctypes.c_uint32),
        ("margins", ctypes.c_uint32),
        ("room_rounds", ctypes.c_uint32),
        ("m", ctypes.c_uint64),
        ("n_tokens", ctypes.c_uint64),
        ("n_rows", ctypes.c_uint64),
    ]


class HubResult(ctypes.Structure):
    """``struct hf_result``: a round's drafts for ``hf_hub_reply`` (NULL arrays: none)."""

    _fields_ = [
        ("counts", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("margins", ctypes.c_void_p),
        ("q_ids", ctypes.c_void_p),
        ("q_weights", ctypes.c_void_p),
        ("stride", ctypes.c_uint64),
        ("qstride", ctypes.c_uint64),
    ]
