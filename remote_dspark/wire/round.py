"""``wire.round``: the ROUND frame (part of the wire contract, :mod:`remote_dspark.wire`).

ROUND payload (unchanged since protocol 2 but for a sampled session's two sections,
protocol 6): the engine's own batch layout, each section one array laid end to end, so
encoding is copying whole arrays into place and decoding is taking views
(``round_sections`` gives every offset)::

    fixed       deadline_ms u32, n_entries u32, row_bytes u32, n_tokens u32
    slots       n x u32               the entry's slot, < the session's max_slots, unique
    positions   n x u32               the position of the entry's first token
    n_out       n x u32               drafts wanted, <= MAX_N_OUT
    flags       n x u32               bit 0: FLAG_NEW_GEN
    offsets     (n + 1) x u32         entry i owns tokens[offsets[i]:offsets[i + 1]]:
                                      offsets[0] = 0, non-decreasing, offsets[n] = n_tokens
    temperature n x f32               a sampled session only (HELLO's OPTION_SAMPLED):
                                      finite and >= 0 (-0.0 is 0); 0: that entry greedy
    seed        n x u64               a sampled session only: the entry's sampling seed
    tokens      n_tokens x i32        flat, entry order (as vLLM's query_start_loc)
    rows        n x row_bytes         opaque bytes, entry order

Every section but the rows is 4-byte aligned, so the proxy sends the first seven (nine)
as one block straight from its descriptor and the rows straight from the staging slot
(``sendmsg``, nothing copied: one call, or one per batch of rows as a CPU engine copies
them in). An unsampled ROUND is byte for byte what protocol 5
sent: a sampled session's sections come last in the meta, after ``offsets``, so every
other offset is the same. ``seed`` is at a 4-aligned offset, never 8-aligned (20 + 24 n
in the payload): it is read as ``memoryview(...).cast("Q")`` (CPython unpacks a view's
items with ``memcpy``: any alignment) and by numpy as ``np.frombuffer(..., "<u8")``
(numpy allows unaligned views; ``astype`` copies them aligned). Whether a ROUND has the
two sections is the session's (its HELLO), not the frame's: :func:`decode_round` takes
``sampled``. A sampled ROUND has at most ``MAX_SAMPLED_ENTRIES`` entries.

An entry's tokens are the ones accepted since its previous round, starting at
``positions[i]``; with ``FLAG_NEW_GEN`` they are the slot's whole context and replace
whatever the worker had for it. A sampled entry's draft j is drawn with its seed at its
absolute position: the entry's last token's position + 1 + j (the worker's window's
first position + its context's length + j; :mod:`remote_dspark.drafter.sampling`).
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .frame import (
    FLAG_NEW_GEN,
    MAX_ENTRIES,
    MAX_N_OUT,
    MAX_PAYLOAD,
    MAX_ROW_BYTES,
    MAX_SAMPLED_ENTRIES,
    MAX_TOKENS,
    ROUND,
    ROUND_FIXED,
    Header,
    ProtocolError,
    encode_header,
    require,
)

ROUND_ARRAYS = ("slots", "positions", "n_out", "flags", "offsets")  # u32 each, in order
SAMPLED_BYTES = 12  # a sampled session's bytes per entry: temperature f32 and seed u64


@dataclass(frozen=True)
class RoundSections:
    """Byte offsets of a ROUND payload's sections (``round_sections``). ``meta`` is the
    fixed part and the five entry arrays; ``tokens`` starts there; ``rows`` follow the
    tokens; ``size`` is the whole payload."""

    n: int
    n_tokens: int
    row_bytes: int
    slots: int
    positions: int
    n_out: int
    flags: int
    offsets: int
    tokens: int
    rows: int
    size: int
    temperature: int = 0  # a sampled round's; == seed == tokens when unsampled
    seed: int = 0

    @property
    def meta(self) -> int:
        return self.tokens


def round_meta_bytes(n: int, sampled: bool = False) -> int:
    """Bytes of a ROUND's fixed part and entry arrays for ``n`` entries (the tokens
    start there); ``sampled``: with a sampled session's temperature and seed sections
    (``SAMPLED_BYTES`` more per entry)."""
    return ROUND_FIXED.size + 4 * (5 * n + 1) + (SAMPLED_BYTES * n if sampled else 0)


def round_sections(n: int, n_tokens: int, row_bytes: int, sampled: bool = False) -> RoundSections:
    """Where each section of a ROUND payload of ``n`` entries and ``n_tokens`` tokens is
    (``sampled``: a sampled session's, with temperature and seed)."""
    at = ROUND_FIXED.size
    slots, positions, n_out, flags = at, at + 4 * n, at + 8 * n, at + 12 * n
    offsets = at + 16 * n
    temperature = offsets + 4 * (n + 1)
    seed = temperature + (4 * n if sampled else 0)
    tokens = round_meta_bytes(n, sampled)
    rows = tokens + 4 * n_tokens
    return RoundSections(
        n,
        n_tokens,
        row_bytes,
        slots,
        positions,
        n_out,
        flags,
        offsets,
        tokens,
        rows,
        rows + n * row_bytes,
        temperature,
        seed,
    )


@dataclass(frozen=True)
class Entry:
    """One slot of a round, as a record (the slow convenience: tests and simple clients;
    the engine and the worker move whole arrays). ``tokens`` are those accepted since the
    slot's previous round (from ``position`` on), or its whole context when ``new_gen``."""

    slot: int
    n_out: int
    position: int
    tokens: Sequence[int]
    new_gen: bool = False
    temperature: float = 0.0  # a sampled round's (0: greedy)
    seed: int = 0  # a sampled round's, u64


@dataclass(frozen=True)
class Round:
    """A decoded ROUND: every array a view of the payload (``memoryview`` cast to u32,
    tokens to i32), valid while the payload is."""

    round_id: int
    deadline_ms: int
    row_bytes: int
    slots: Sequence[int]
    positions: Sequence[int]
    n_out: Sequence[int]
    flags: Sequence[int]
    offsets: Sequence[int]
    tokens: Sequence[int]
    rows: memoryview  # n x row_bytes, entry order
    temperature: Sequence[float] | None = None  # a sampled session's: [n] f32 (memoryview "f")
    seed: Sequence[int] | None = None  # a sampled session's: [n] u64 (memoryview "Q", 4-aligned)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def sampled(self) -> bool:
        return self.temperature is not None

    def entries(self) -> list[Entry]:
        """The round as records (slow: a loop over entries; tests and tools)."""
        o = self.offsets
        temperature = [0.0] * len(self) if self.temperature is None else self.temperature.tolist()
        seed = [0] * len(self) if self.seed is None else self.seed.tolist()
        return [
            Entry(
                self.slots[i],
                self.n_out[i],
                self.positions[i],
                list(self.tokens[o[i] : o[i + 1]]),
                bool(self.flags[i] & FLAG_NEW_GEN),
                temperature[i],
                seed[i],
            )
            for i in range(len(self))
        ]


def encode_round_entries(
    round_id: int,
    session: int,
    deadline_ms: int,
    entries: Sequence[Entry],
    rows,
    row_bytes: int,
    sampled: bool = False,
) -> bytes:
    """A whole ROUND frame from records (the slow reference encoder: tests and simple
    clients; it walks the entries); ``sampled``: a sampled session's, with each entry's
    ``temperature`` and ``seed``.

    Raises:
        ValueError: an entry breaks a cap, or ``rows`` is not entries x row_bytes.
    """
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + len(e.tokens))
    return encode_round(
        round_id,
        session,
        deadline_ms,
        slots=[e.slot for e in entries],
        positions=[e.position for e in entries],
        n_out=[e.n_out for e in entries],
        flags=[FLAG_NEW_GEN if e.new_gen else 0 for e in entries],
        offsets=offsets,
        tokens=[t for e in entries for t in e.tokens],
        rows=rows,
        row_bytes=row_bytes,
        temperature=[e.temperature for e in entries] if sampled else None,
        seed=[e.seed for e in entries] if sampled else None,
    )


def encode_round(
    round_id: int,
    session: int,
    deadline_ms: int,
    *,
    slots,
    positions,
    n_out,
    flags,
    offsets,
    tokens,
    rows,
    row_bytes: int,
    temperature=None,
    seed=None,
) -> bytes:
    """A whole ROUND frame from its arrays (any int sequences; ``rows`` bytes-like);
    ``temperature`` (floats) and ``seed`` (u64 ints), both or neither: a sampled
    session's round.

    Raises:
        ValueError: the arrays disagree on their lengths or break a cap, or a temperature
            is not finite and >= 0 (naming the entry).
    """
    n = len(slots)
    sampled = temperature is not None
    require(sampled == (seed is not None), "temperature and seed: both (a sampled round) or neither")
    cap = MAX_SAMPLED_ENTRIES if sampled else MAX_ENTRIES
    require(n <= cap, f"{n} entries over the cap {cap}" + (" (sampled)" if sampled else ""))
    if sampled:
        require(len(temperature) == len(seed) == n, "ROUND temperature and seed disagree on the entry count")
        temps = array.array("f", temperature)
        bad = _bad_temperature(memoryview(temps))
        if bad is not None:
            raise ValueError(f"temperature of entry {bad}: {temps[bad]!r}, expected finite and >= 0")
    require(row_bytes <= MAX_ROW_BYTES, f"row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    require(
        len(positions) == len(n_out) == len(flags) == n and len(offsets) == n + 1,
        "ROUND arrays disagree on the entry count",
    )
    require(len(tokens) <= MAX_TOKENS, f"{len(tokens)} tokens over the cap {MAX_TOKENS}")
    require(offsets[0] == 0 and offsets[-1] == len(tokens), "offsets must run from 0 to len(tokens)")
    require(len(rows) == n * row_bytes, "rows do not match entries x row_bytes")
    require(max(n_out, default=0) <= MAX_N_OUT, f"n_out over {MAX_N_OUT}")
    sec = round_sections(n, len(tokens), row_bytes, sampled)
    require(sec.size <= MAX_PAYLOAD, f"ROUND of {sec.size} bytes over the cap {MAX_PAYLOAD}")
    meta = array.array("I", [deadline_ms, n, row_bytes, len(tokens)])
    for part in (slots, positions, n_out, flags, offsets):
        meta.extend(part)
    extra = temps.tobytes() + _u64(seed).tobytes() if sampled else b""
    return (
        encode_header(ROUND, sec.size, session, round_id)
        + meta.tobytes()
        + extra
        + array.array("i", tokens).tobytes()
        + bytes(rows)
    )


def _u64(seed) -> array.array:
    """``seed`` as an array of u64. Raises: ValueError naming a seed outside 0..2**64-1."""
    try:
        return array.array("Q", seed)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"seed: every one an int in 0..{2**64 - 1} ({e})") from e


def _bad_temperature(temps: memoryview) -> int | None:
    """The first entry whose temperature (a memoryview of f32) is not finite and >= 0,
    or None. C-speed builtins: the f64 sum of f32 values is finite iff each one is (no
    f32 overflows it), and then ``min`` is a plain comparison; only a bad round walks
    its entries to name the culprit."""
    if not temps or (math.isfinite(sum(temps)) and min(temps) >= 0):
        return None
    return next(i for i, t in enumerate(temps) if not (math.isfinite(t) and t >= 0))


def decode_round(hdr: Header, payload, sampled: bool = False) -> Round:
    """Check a ROUND payload and return views of its arrays; ``sampled``: the session's
    HELLO asked for sampled drafts, so the payload has the temperature and seed sections.

    Every rule of the contract is checked here, with C-speed builtins over the arrays
    (no loop over entries in Python): the sizes against the caps and the payload's
    length, known flags, ``n_out`` caps, offsets that run from 0 to ``n_tokens``
    without going back, and (sampled) temperatures finite and >= 0. What only the
    receiver knows (its slot range, unique slots) is the receiver's to check.

    Raises:
        ProtocolError: naming the field that broke the contract.
    """
    mv = memoryview(payload).cast("B")
    if len(mv) < ROUND_FIXED.size:
        raise ProtocolError(f"ROUND payload of {len(mv)} bytes, under {ROUND_FIXED.size}")
    deadline_ms, n, row_bytes, n_tokens = ROUND_FIXED.unpack_from(mv)
    cap = MAX_SAMPLED_ENTRIES if sampled else MAX_ENTRIES
    if n > cap:
        raise ProtocolError(f"ROUND with {n} entries over the cap {cap}" + (" (sampled)" if sampled else ""))
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"ROUND row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if n_tokens > MAX_TOKENS:
        raise ProtocolError(f"ROUND with {n_tokens} tokens over the cap {MAX_TOKENS}")
    sec = round_sections(n, n_tokens, row_bytes, sampled)
    if len(mv) != sec.size:
        raise ProtocolError(
            f"ROUND payload of {len(mv)} bytes, its fields say {sec.size}" + (" (sampled)" if sampled else "")
        )
    u32 = mv[ROUND_FIXED.size : sec.temperature].cast("I")
    slots, positions, n_out, flags = (u32[k * n : (k + 1) * n] for k in range(4))
    offsets = u32[4 * n :]
    if n and max(flags) & ~FLAG_NEW_GEN:
        raise ProtocolError(f"ROUND flags: unknown bits {max(flags) & ~FLAG_NEW_GEN:#x}")
    if n and max(n_out) > MAX_N_OUT:
        raise ProtocolError(f"ROUND n_out: {max(n_out)} over the cap {MAX_N_OUT}")
    if offsets[0] != 0 or offsets[n] != n_tokens:
        raise ProtocolError(f"ROUND offsets run from {offsets[0]} to {offsets[n]}, expected 0 to n_tokens={n_tokens}")
    if n > 1 and offsets.tolist() != sorted(offsets):
        raise ProtocolError("ROUND offsets go back: an entry with a negative token count")
    temperature = seed = None
    if sampled:
        temperature, seed = mv[sec.temperature : sec.seed].cast("f"), mv[sec.seed : sec.tokens].cast("Q")
        bad = _bad_temperature(temperature)
        if bad is not None:
            raise ProtocolError(f"ROUND temperature of entry {bad}: {temperature[bad]!r}, expected finite and >= 0")
    return Round(
        hdr.round,
        deadline_ms,
        row_bytes,
        slots,
        positions,
        n_out,
        flags,
        offsets,
        mv[sec.tokens : sec.rows].cast("i"),
        mv[sec.rows : sec.size],
        temperature,
        seed,
    )
