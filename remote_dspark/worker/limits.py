"""The worker's own limits on what one engine may announce and send.

The wire's caps (:mod:`remote_dspark.wire.frame`) are what any peer may say: 4096 slots,
1 MiB rows, 64 MiB frames. A worker serving real engines needs far less, and a peer's
own HELLO is no bound on memory (a hostile peer announces the most). So the worker has
its own limits: a HELLO beyond them is refused (``REFUSE_LIMITS``, the reason names the
value, the limit and its option), and after HELLO every frame's cap is the smaller of
the worker's round cap and the largest round the session's HELLO allows
(:meth:`Limits.frame_cap`).

Defaults, for a real engine with headroom: 1024 slots (an engine batches 256-1024
sequences; the wire allows 4096), 8192-byte rows (a 4096-wide bf16 hidden state per
slot), ``window + 64`` tokens per slot in one round (:func:`tokens_per_slot`: an engine
sends at most the last ``window`` context tokens of a NEW_GEN, the worker's ``--window``
it learns from HELLO_ACK, and ``num_spec + 1`` accepted tokens otherwise, ``num_spec`` <=
63), 128 at the default window of 64, and a round's bytes capped at the largest round of
those three: 8.5 MiB at the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire
from ..drafter.contract import (
    as_batched,
    keeps_streams_of,
    max_context_of,
    max_positions_of,
    needs_rows_of,
    samples_of,
    vocab_size_of,
)
from .batching import Charge

DEFAULT_MAX_SLOTS = 1024
DEFAULT_MAX_ROW_BYTES = 8192
DEFAULT_WINDOW = wire.DEFAULT_CONTEXT


def tokens_per_slot(window: int) -> int:
    """The most tokens one slot may send in a round to a worker of ``window``: a NEW_GEN
    context (at most ``window``, what HELLO_ACK told the engine) plus what one round
    appends (``num_spec + 1`` <= ``wire.MAX_N_OUT``), as headroom."""
    return window + wire.MAX_N_OUT


def stream_keep(drafter, window: int) -> int:
    """The tokens a worker of ``window`` serving ``drafter`` keeps of each stream (what
    HELLO_ACK's ``context_tokens`` tells the engine): a drafter that keeps whole streams,
    its ``max_context`` (:func:`~remote_dspark.drafter.contract.max_context_of`), its
    window at least and the wire's cap at most; any other drafter, its window.

    Raises: ValueError, a bad ``max_context``."""
    most = max_context_of(drafter) if keeps_streams_of(drafter) else None
    return window if most is None else min(max(window, most), wire.MAX_CONTEXT)


def largest_round(slots: int, tokens: int, row_bytes: int, sampled: bool = False) -> int:
    """The payload of a ROUND of ``slots`` entries, ``tokens`` tokens and ``row_bytes`` rows
    (``sampled``: a sampled session's, 12 bytes more per entry: temperature and seed)."""
    return wire.round_sections(slots, tokens, row_bytes, sampled).size


@dataclass(frozen=True)
class Limits:
    """The worker's limits. ``max_round_tokens`` defaults to :func:`tokens_per_slot` of
    ``window`` per slot of ``max_slots``, ``max_round_bytes`` to the largest round of the
    other three (the larger of a greedy session's and a sampled one's, whose slots are
    at most ``wire.MAX_SAMPLED_ENTRIES``).

    Raises (at construction): ValueError naming the limit and its value, when it is out
    of the wire's range.
    """

    max_slots: int = DEFAULT_MAX_SLOTS
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    max_round_tokens: int | None = None
    max_round_bytes: int | None = None
    window: int = DEFAULT_WINDOW

    def __post_init__(self):
        if not 1 <= self.window <= wire.MAX_CONTEXT:
            raise ValueError(f"window {self.window}: not in 1..{wire.MAX_CONTEXT} (--window)")
        if self.max_round_tokens is None:
            per_slot = tokens_per_slot(self.window)
            object.__setattr__(self, "max_round_tokens", min(wire.MAX_TOKENS, per_slot * self.max_slots))
        if self.max_round_bytes is None:
            tokens, rows = self.max_round_tokens, self.max_row_bytes
            greedy = largest_round(self.max_slots, tokens, rows)
            sampled = largest_round(min(self.max_slots, wire.MAX_SAMPLED_ENTRIES), tokens, rows, sampled=True)
            object.__setattr__(self, "max_round_bytes", min(wire.MAX_PAYLOAD, max(greedy, sampled)))
        for name, low, high in (
            ("max_slots", 1, wire.MAX_ENTRIES),
            ("max_row_bytes", 0, wire.MAX_ROW_BYTES),
            ("max_round_tokens", 1, wire.MAX_TOKENS),  # (HELLO_ACK tells it: at least 1)
            ("max_round_bytes", wire.ROUND_FIXED.size + 4, wire.MAX_PAYLOAD),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} {value}: not in {low}..{high} (--{name.replace('_', '-')})")

    def refusal(self, hello: wire.Hello) -> str | None:
        """Why ``hello`` is beyond these limits (each value, limit and option), or None."""
        why = []
        if hello.max_slots > self.max_slots:
            why.append(f"max_slots {hello.max_slots} over this worker's {self.max_slots} (--max-slots)")
        if hello.row_bytes > self.max_row_bytes:
            why.append(f"row_bytes {hello.row_bytes} over this worker's {self.max_row_bytes} (--max-row-bytes)")
        rows = largest_round(hello.max_slots, 0, hello.row_bytes, hello.want_sampled)
        if rows > self.max_round_bytes:
            why.append(
                f"a round of {hello.max_slots} rows of {hello.row_bytes} bytes is {rows} bytes, over this "
                f"worker's {self.max_round_bytes} (--max-round-bytes)"
            )
        return "; ".join(why) or None

    def frame_cap(self, hello: wire.Hello) -> int:
        """The largest payload a session of ``hello`` may send: the smaller of the worker's
        round cap and a round of the session's slots and rows with the worker's tokens
        (and, in a sampled session, each entry's temperature and seed)."""
        largest = largest_round(hello.max_slots, self.max_round_tokens, hello.row_bytes, hello.want_sampled)
        return min(self.max_round_bytes, largest)

    def served_bytes(self, hello: wire.Hello) -> int:
        """What a served connection of ``hello`` holds besides its windows, allocated once
        at its HELLO (the memory table's row): its frame cap (the receive buffer), the
        largest reply (``hello.max_slots`` entries of ``num_spec`` drafts, margins and,
        sampled, the distributions), and one round's batch arrays (the slots' contexts of
        ``window`` tokens and 57 bytes an entry of positions, lengths and the like)."""
        n, k = hello.max_slots, hello.num_spec
        reply = wire.HEADER.size + wire.drafts_sections(n, k, True, hello.want_sampled).size
        batch = n * (4 * self.window + 57 + (12 if hello.want_sampled else 0)) + 8
        return self.frame_cap(hello) + reply + batch


def sampling_refusal(drafter, hello: wire.Hello) -> str | None:
    """Why a worker serving ``drafter`` cannot serve ``hello``'s sampled session (the
    drafter as the worker calls it does not say ``samples``: a per-entry drafter, served
    one entry at a time, never does), or None (also for a greedy HELLO)."""
    if not hello.want_sampled or samples_of(as_batched(drafter)):
        return None
    return (
        f"sampled drafts asked for (VLLM_DSPARK_SAMPLED_TOP32), but the drafter {type(drafter).__name__} "
        "does not sample (it says no `samples`): serve a drafter that samples, or unset the variable"
    )


def hello_refusal(
    drafter, limits: Limits, hello: wire.Hello, window: int = 0, call_tokens: int | None = None
) -> tuple[int, str, str]:
    """Whether a worker serving ``drafter`` under ``limits``, its ``window`` and a drafter
    call's budget of ``call_tokens`` takes ``hello`` (a window and ``num_spec`` drafts
    past the drafter's position table could never fit at any position: refused; one that
    fits at the start fits until an entry's position passes it, which gets no drafts,
    :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`; an entry of a whole window
    and ``num_spec`` drafts over the call's budget could never be drafted within it:
    refused. A round of many entries is drafted in pieces, so only an entry's cost can
    never fit): ``(code,
    reason, why)``, ``code`` ``wire.ACCEPT`` (and empty strings) or the refusal's code,
    its reason for the engine's log and ``why``, the metrics' label (drafter, markov,
    vocab, limits; a sampled HELLO to a drafter that does not sample: limits). Busy is decided later, among the engines
    (:class:`~remote_dspark.worker.sessions.Sessions`)."""
    if hello.drafter_identity != drafter.drafter_identity:
        return (
            wire.REFUSE_DRAFTER,
            (
                f"drafter identity mismatch: engine {hello.drafter_identity.hex()}, "
                f"worker {drafter.drafter_identity.hex()} (VLLM_DSPARK_REMOTE_IDENTITY)"
            ),
            "drafter",
        )
    if hello.markov_identity != drafter.markov_identity:
        return (
            wire.REFUSE_MARKOV,
            (
                f"Markov identity mismatch: engine {hello.markov_identity.hex()}, "
                f"worker {drafter.markov_identity.hex()} (VLLM_DSPARK_REMOTE_MARKOV_IDENTITY)"
            ),
            "markov",
        )
    vocab = vocab_size_of(drafter)
    if hello.vocab_size and vocab > hello.vocab_size:  # its drafts could name tokens the engine does not have
        return (
            wire.REFUSE_DRAFTER,
            (f"vocabulary mismatch: the drafter's vocabulary is {vocab} tokens, over the engine's {hello.vocab_size}"),
            "vocab",
        )
    over = limits.refusal(hello)
    if over is not None:
        return wire.REFUSE_LIMITS, over, "limits"
    cannot = sampling_refusal(drafter, hello)
    if cannot is not None:
        return wire.REFUSE_LIMITS, cannot, "limits"
    # A drafter's own bound, as max_width below: the engine drafts for the right model but
    # sends less than this drafter serves (an identity is no mismatch: REFUSE_LIMITS).
    if hello.row_bytes == 0 and needs_rows_of(drafter):
        return (
            wire.REFUSE_LIMITS,
            f"row_bytes 0 (no rows), but the drafter {type(drafter).__name__} reads the engine's rows (needs_rows)",
            "limits",
        )
    table = max_positions_of(drafter)
    if table is not None and window + hello.num_spec > table:
        return (
            wire.REFUSE_LIMITS,
            (
                f"a window of {window} tokens (--window) and num_spec {hello.num_spec} drafts need "
                f"{window + hello.num_spec} positions, over the drafter model's {table}"
            ),
            "limits",
        )
    over = _over_a_call(drafter, window, hello.num_spec, call_tokens)
    if over:
        return wire.REFUSE_LIMITS, over, "limits"
    widest = getattr(drafter, "max_width", None)  # a drafter's own bound on drafts per entry
    if widest is not None and hello.num_spec > widest:
        return (
            wire.REFUSE_LIMITS,
            (
                f"num_spec {hello.num_spec} is over the drafter's {widest} drafts per entry "
                "(a model drafter's row holds a window and that many: a smaller --window leaves more)"
            ),
            "limits",
        )
    return wire.ACCEPT, "", ""


def _over_a_call(drafter, window: int, num_spec: int, call_tokens: int | None) -> str:
    """Why an entry of ``drafter`` could never be drafted within a call of ``call_tokens``
    (its least share of one call: :meth:`~.batching.Charge.most`), or ""."""
    charge = Charge(drafter)
    cost = charge.most(window, num_spec)
    if call_tokens is None or cost <= call_tokens:
        return ""
    entry = f"an entry of a whole window of {window} tokens (--window) and num_spec {num_spec} drafts"
    if charge.pieces:
        entry = f"the last piece of an entry's encode (a token and num_spec {num_spec} drafts)"
    return f"{entry} costs {cost} tokens, over the worker's {call_tokens} a drafting call (--max-batch-tokens)"


DEFAULT_LISTEN = "127.0.0.1:18620"  # loopback unless told otherwise


def parse_listen(raw: str) -> tuple[str, int]:
    """``HOST:PORT`` for ``--listen``. Raises: ValueError naming the value."""
    host, sep, port_s = raw.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"--listen {raw!r}: expected HOST:PORT with PORT in 0..65535")
    return host, int(port_s)
