"""Drafters as the worker calls them: one batched call per round.

The worker hands a drafter every drafting entry of a round at once, as arrays
(:class:`DraftBatch`: the contexts as one ragged ``(tokens, offsets)`` pair, the drafts
wanted, the engine's opaque rows) and takes back arrays (:class:`DraftResult`:
``[n, width]`` tokens and margins, ``[n]`` counts). A neural drafter runs ``width``
batched forward passes over all n entries, one per draft step; the Markov drafter does
the same with array lookups (:meth:`MarkovModel.draft_batch`).

Contract of ``draft_batch`` (the worker checks shapes, and clamps and zeroes for safety):

* ``result.tokens`` is ``[n, width]`` int32, row i holds ``counts[i]`` drafts then zeros;
* ``0 <= counts[i] <= batch.n_out[i]`` (a draft may end early: fewer is always fine);
* ``result.margins`` is ``[n, width]`` float32 in [0, 1] (zeros past counts) when
  ``batch.want_margin``, else it may be None. A drafter without margins returns None
  and the worker sends zeros when they were asked for: the engine refuses a DRAFTS whose
  margins section is not exactly what its HELLO asked (``engine.values.reply``);
* draft token ids are in ``0..vocab_size-1`` of the engine (its HELLO says the size);
  context ids are whatever int32 the peer sent: a drafter never indexes with them unchecked;
* in a sampled round (``batch.sampled``: ``temperature`` and ``seed`` per entry), the
  drafts are sampled by :mod:`remote_dspark.drafter.sampling`'s rule and the result
  carries, for every drafted position, the distribution the draft was drawn from
  (``q_ids``, ``q_weights``: ``[n, width, 32]``, zeros past counts); draft j of entry i
  is ``pick(q_ids[i, j], q_weights[i, j], uniform_u32(seed[i], p, j))``, ``p`` its
  absolute position (``starts()[i]`` + the context's length + j). Only a drafter that
  says ``samples`` (an optional bool, read with :func:`samples_of`) is given sampled
  rounds: the worker refuses a HELLO asking for them otherwise.

A drafter that keeps state per slot across rounds (a KV cache) keys it by the stream
the batch names (``session``, ``slots``, ``gens``, ``lengths``) and may report it with
``cache_info()`` (:class:`CacheInfo`, shown in the worker's metrics). Such a drafter
says so (``keeps_streams``, an optional bool, :func:`keeps_streams_of`): an entry with
``n_out`` 0 is then an encode only (its tokens kept in its stream's state, no draft
steps, even in a call where others draft), and the worker may hand it a long entry's
encode in pieces over several calls (the entry's first tokens as entries of ``n_out``
0, then the entry). It may say what it would encode for each entry (``encodes(batch)``,
:func:`encodes_of`): the worker charges that in a call's budget, not the context. The worker's
scheduler drafts several engines' rounds in one call when the drafter says it takes
them (``mixed_sessions``, an optional bool, False when absent, read with
:func:`mixed_sessions_of`): such a batch names a session per entry (``session`` an
[n] int64 array); any other drafter gets one session per call. A drafter whose working memory grows with
a call's entries may preallocate it for the worker's budget (``reserve(max_entries)``,
optional, called once before the worker serves; its ValueError stops the worker).

A drafter may say its vocabulary size (``vocab_size``: its largest token id + 1; an
optional attribute, None or 0 when unknown, read with :func:`vocab_size_of`): the worker
refuses the HELLO of an engine whose vocabulary is smaller, since its drafts could name
tokens the engine does not have (a drafter may have the smaller vocabulary of the same
tokenizer). It may also say the most drafts per entry it can make (``max_width``, an
optional int): the worker refuses a HELLO whose ``num_spec`` is over it, so that no round
fails for its width. A drafter that reads the engine's rows says so (``needs_rows``, an
optional bool, False when absent, read with :func:`needs_rows_of`): the worker refuses
the HELLO of an engine that sends none (``row_bytes=0``), whose rows would all be empty.
A model drafter says its position table (``max_positions``, an optional int, read with
:func:`max_positions_of`): the worker refuses a HELLO whose window and ``num_spec`` could
never fit in it, and gives no drafts to an entry whose context (at its absolute position,
``DraftBatch.positions``) and width pass it (:meth:`DraftBatch.beyond`): the drafter
never sees such an entry. A drafter that keeps whole streams may say how many tokens of each it
keeps (``max_context``, :func:`max_context_of`): the worker keeps as many of each stream's tokens.

A drafter may pre-draft the rounds it expects next in the worker's idle time and answer
a round that matches one from that speculation cache: it says so (``speculates``, an
optional bool, read with :func:`predrafts_of`) and has ``predraft(max_entries,
max_tokens)``, called by the scheduler's thread when no round is queued, one call at a
time like ``draft_batch``, returning how many outcomes it pre-drafted (0: none left);
``spec_info()`` (:class:`SpecInfo`) reports the cache.

A per-entry drafter (an object with ``draft(context, n_out, row) -> (tokens, margins)``)
is served through :class:`PerEntryDrafter`, the slow path: one Python call per entry.
:func:`as_batched` picks the path for any drafter. The worker builds the drafter its
flags name (:mod:`remote_dspark.worker.drafters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .reports import CacheInfo as CacheInfo  # (what a drafter reports: re-exported here)
from .reports import SpecInfo as SpecInfo
from .reports import cache_info_of as cache_info_of
from .reports import predrafts_of as predrafts_of
from .reports import spec_info_of as spec_info_of

if TYPE_CHECKING:  # the arrays are numpy's; the functions that make them import it, so
    import numpy as np  # this package (and the Markov model) imports without numpy


@dataclass(frozen=True)
class DraftBatch:
    """One round's drafting entries (those the worker has a window for), entry order.

    Invariants: ``offsets[0] == 0``, non-decreasing, ``offsets[n] == len(tokens)``;
    ``0 <= n_out[i] <= width``; ``rows`` is ``[n, row_bytes]``.
    """

    tokens: np.ndarray  # [T] int32: each entry's context (its last ``window`` tokens), flat
    offsets: np.ndarray  # [n + 1] int64: entry i's context is tokens[offsets[i]:offsets[i + 1]]
    n_out: np.ndarray  # [n] int32, drafts wanted (0..width)
    rows: np.ndarray  # [n, row_bytes] uint8, the engine's opaque rows
    want_margin: bool
    width: int  # k: the result's second dimension
    # Where each context comes from, for drafters that keep state per slot across rounds
    # (a KV cache: remote_dspark.drafter.lm). A slot's stream is (session, slots[i], gens[i]): the
    # worker never reuses a session number, and bumps a slot's generation at every
    # NEW_GEN, so within one stream tokens are only ever appended. ``lengths[i]`` is how
    # many tokens the stream has had (>= the context, its last ``window`` of them). None
    # when the batch was not built by a worker (benchmarks, tests): no state to reuse.
    session: int | np.ndarray = 0  # [n] int64 in a batch of several engines' rounds (mixed_sessions)
    slots: np.ndarray | None = None  # [n] int64
    gens: np.ndarray | None = None  # [n] int64
    lengths: np.ndarray | None = None  # [n] int64
    # The absolute position of each entry's first context token in its sequence (the
    # worker's windows keep it through appends, NEW_GEN and RESYNC); a model drafter
    # encodes entry i's context at positions[i], positions[i] + 1, ... None: each context
    # starts at position 0 (a batch not built by a worker).
    positions: np.ndarray | None = None  # [n] int64
    # Sampled drafts (SAMPLED_TOP32: the rule is remote_dspark.drafter.sampling's): each
    # entry's temperature (0: greedy) and seed. None: a greedy round, no distributions.
    temperature: np.ndarray | None = None  # [n] float32, >= 0 and finite
    seed: np.ndarray | None = None  # [n] uint64
    # Whole streams (:mod:`remote_dspark.drafter.streams`): the worker still holds entry
    # i's stream tokens from stream index ``kept_from[i]`` (0: its first since its NEW_GEN)
    # up to ``lengths[i]``, the context their last ones, read through ``history`` (the
    # worker's one reader for every session). None: the contexts only.
    kept_from: np.ndarray | None = None  # [n] int64
    history: object | None = None  # a remote_dspark.drafter.streams.TokenReader

    def __len__(self) -> int:
        return len(self.n_out)

    @property
    def sampled(self) -> bool:
        """Whether the round asks for sampled drafts and their distributions."""
        return self.temperature is not None

    def context(self, i: int) -> np.ndarray:
        """Entry i's context (the slow per-entry view: adapters and tests)."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def starts(self) -> np.ndarray:
        """[n] int64: each context's first position (``positions``, zeros when None)."""
        import numpy as np

        return np.zeros(len(self), np.int64) if self.positions is None else np.asarray(self.positions, np.int64)

    def beyond(self, max_positions: int | None) -> np.ndarray:
        """[n] bool: the entries whose context and ``width`` drafts pass a position table
        of ``max_positions`` (``positions[i] + len(context) + width > max_positions``):
        they get no drafts, never wrapped or clamped positions. All False for None (no
        table) and for empty contexts (no drafts anyway)."""
        import numpy as np

        lens = np.diff(self.offsets)
        if max_positions is None:
            return np.zeros(len(self), bool)
        return (lens > 0) & (self.starts() + lens + self.width > max_positions)

    def sessions(self) -> np.ndarray:
        """[n] int64: each entry's session (``session``, repeated when one for all)."""
        import numpy as np

        return np.broadcast_to(np.asarray(self.session, np.int64), (len(self),))

    def entries(self, start: int, stop: int) -> DraftBatch:
        """The batch of entries ``start`` to ``stop`` (consecutive): views, nothing copied
        but the offsets (a scheduler's piece of a round)."""
        import numpy as np

        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        offsets = np.asarray(self.offsets[start : stop + 1], np.int64) - lo
        return self._of_entries(slice(start, stop), self.tokens[lo:hi], offsets)

    def subset(self, keep: np.ndarray) -> DraftBatch:
        """The batch of the ``keep`` entries ([n] bool), in entry order."""
        import numpy as np

        lens = np.diff(self.offsets)
        offsets = np.zeros(int(keep.sum()) + 1, np.int64)
        np.cumsum(lens[keep], out=offsets[1:])
        return self._of_entries(keep, self.tokens[np.repeat(keep, lens)], offsets)

    def _of_entries(self, which, tokens: np.ndarray, offsets: np.ndarray) -> DraftBatch:
        """This batch's entries ``which`` (a slice or a mask), given their contexts."""
        import numpy as np

        def pick(a):
            return None if a is None else np.asarray(a)[which]

        return dataclasses.replace(
            self,
            tokens=tokens,
            offsets=offsets,
            n_out=self.n_out[which],
            rows=self.rows[which],
            session=self.session if np.ndim(self.session) == 0 else pick(self.session),
            slots=pick(self.slots),
            gens=pick(self.gens),
            lengths=pick(self.lengths),
            positions=pick(self.positions),
            temperature=pick(self.temperature),
            seed=pick(self.seed),
            kept_from=pick(self.kept_from),
        )


@dataclass(frozen=True)
class DraftResult:
    tokens: np.ndarray  # [n, width] int32, zero past counts
    counts: np.ndarray  # [n] int32, <= n_out
    margins: np.ndarray | None = None  # [n, width] float32, zero past counts, when want_margin
    # A sampled round's distributions, each drafted position's (remote_dspark.drafter.sampling):
    q_ids: np.ndarray | None = None  # [n, width, 32] int32, zero past counts
    q_weights: np.ndarray | None = None  # [n, width, 32] uint16, summing to 65535; zero past counts


class BatchedDrafter(Protocol):
    """What the worker needs of a drafter: the two 32-byte identities the engine must
    match, and one call per round. Optionally ``vocab_size`` (see the module docstring;
    :func:`vocab_size_of` reads it)."""

    drafter_identity: bytes
    markov_identity: bytes

    def draft_batch(self, batch: DraftBatch) -> DraftResult: ...


class PerEntryDrafterLike(Protocol):
    """A drafter that answers one entry at a time (``draft``), served through
    :class:`PerEntryDrafter`: the slow path, one Python call per entry."""

    drafter_identity: bytes
    markov_identity: bytes

    def draft(self, context: Sequence[int], n_out: int, row: memoryview) -> tuple[list[int], list[float]]:
        """Up to ``n_out`` tokens following ``context`` and their top1-top2 margins."""


def context_read_of(drafter) -> int | None:
    """How many of an entry's last context tokens ``drafter`` reads (its optional
    ``context_read``: a Markov model of order k reads k), None when it reads whole
    contexts (a model drafter encodes them). The worker's call budget counts an entry's
    context up to it.

    Raises:
        ValueError: a ``context_read`` that is not a positive int.
    """
    read = getattr(drafter, "context_read", None)
    if read is not None and (not isinstance(read, int) or isinstance(read, bool) or read < 1):
        raise ValueError(f"drafter context_read {read!r}: expected a positive int or None")
    return read


def encodes_of(drafter):
    """``drafter``'s optional ``encodes(batch) -> [n] ints``: the tokens it would encode for
    each entry of ``batch`` were it drafted now (a model drafter: a stream's new tokens when
    its cache holds the rest, else its re-encode), asked between calls; None when it does
    not say. The worker's call budget charges them (:class:`~remote_dspark.worker.batching.Charge`).

    Raises:
        ValueError: an ``encodes`` that is not callable.
    """
    encodes = getattr(drafter, "encodes", None)
    if encodes is not None and not callable(encodes):
        raise ValueError(f"drafter encodes {encodes!r}: expected a method encodes(batch) or None")
    return encodes


def keeps_streams_of(drafter) -> bool:
    """Whether ``drafter`` keeps what it encoded of each stream across calls
    (``keeps_streams``, an optional bool, False when absent): an entry with ``n_out`` 0 is
    then encoded into its stream's state, and the worker may take a long encode in pieces."""
    return bool(getattr(drafter, "keeps_streams", False))


def mixed_sessions_of(drafter) -> bool:
    """Whether ``drafter`` takes batches of several sessions (``mixed_sessions``)."""
    return bool(getattr(drafter, "mixed_sessions", False))


def sampling_inputs(batch: DraftBatch):
    """A sampled round's temperatures ([n] float32, finite and >= 0, -0.0 made +0.0) and
    seeds ([n] uint64; int64 seeds are the same bits): what every sampling drafter reads.

    Raises:
        ValueError: naming ``temperature`` (missing, not [n], negative or not finite) or
            ``seed`` (missing, not [n] integers).
    """
    import numpy as np

    n = len(batch)
    if batch.temperature is None or batch.seed is None:
        raise ValueError(f"temperature / seed: {batch.temperature!r} / {batch.seed!r}: a sampled round needs both")
    t = np.asarray(batch.temperature, np.float32)
    if t.shape != (n,):
        raise ValueError(f"temperature: shape {t.shape}, expected {(n,)}")
    bad = ~(np.isfinite(t) & (t >= 0))
    if bad.any():
        raise ValueError(f"temperature {float(t[bad][0])} (entry {int(np.argmax(bad))}): expected a finite value >= 0")
    seed = np.asarray(batch.seed)
    if seed.shape != (n,) or seed.dtype.kind not in "iu":
        raise ValueError(f"seed: shape {seed.shape} dtype {seed.dtype}, expected {(n,)} integers (uint64)")
    wide = np.int64 if seed.dtype.kind == "i" else np.uint64
    return t + np.float32(0), seed.astype(wide, copy=False).view(np.uint64)  # (-0.0 + 0 is +0.0)


def samples_of(drafter) -> bool:
    """Whether ``drafter`` drafts sampled rounds (``samples``)."""
    return bool(getattr(drafter, "samples", False))


def max_positions_of(drafter) -> int | None:
    """``drafter``'s position table (its optional ``max_positions``: the most positions
    its model encodes), None when it has none (position-free, or rotary with no bound).

    Raises:
        ValueError: a ``max_positions`` that is not a positive int.
    """
    size = getattr(drafter, "max_positions", None)
    if size is not None and (not isinstance(size, int) or size < 1):
        raise ValueError(f"drafter max_positions {size!r}: expected a positive int or None")
    return size


def max_context_of(drafter) -> int | None:
    """The most tokens ``drafter`` keeps per stream (its optional ``max_context``: a model
    drafter's positions, or less), None when it does not say. A worker serving a drafter
    that keeps whole streams keeps that many of each stream's tokens (at least its
    window) and tells the engine so (HELLO_ACK's ``context_tokens``).

    Raises:
        ValueError: a ``max_context`` that is not a positive int.
    """
    size = getattr(drafter, "max_context", None)
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"drafter max_context {size!r}: expected a positive int or None")
    return size


def vocab_size_of(drafter) -> int:
    """``drafter``'s vocabulary size (its optional ``vocab_size``), 0 when it does not say.

    Raises:
        ValueError: a ``vocab_size`` that is not a non-negative int.
    """
    size = getattr(drafter, "vocab_size", None)
    if size is None:
        return 0
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"drafter vocab_size {size!r}: expected a non-negative int or None")
    return size


def needs_rows_of(drafter) -> bool:
    """``drafter``'s optional ``needs_rows``: True when it reads the engine's rows.

    Raises:
        ValueError: a ``needs_rows`` that is not a bool.
    """
    needs = getattr(drafter, "needs_rows", False)
    if not isinstance(needs, bool):
        raise ValueError(f"drafter needs_rows {needs!r}: expected a bool")
    return needs


def empty_result(n: int, width: int, want_margin: bool) -> DraftResult:
    """No drafts for n entries (zeros of the right shapes)."""
    import numpy as np

    return DraftResult(
        np.zeros((n, width), np.int32), np.zeros(n, np.int32), np.zeros((n, width), np.float32) if want_margin else None
    )


class PerEntryDrafter:
    """A per-entry drafter behind the batched protocol: the slow path, one Python call of
    ``drafter.draft(context, n_out, row)`` per entry (``context`` a list of ints, ``row``
    a memoryview of the entry's row bytes). Returned drafts are cut to ``n_out``; missing
    margins are zeros. Entries are independent, so a batch may mix sessions."""

    mixed_sessions = True

    def __init__(self, drafter: PerEntryDrafterLike):
        self.inner = drafter
        self.drafter_identity = drafter.drafter_identity
        self.markov_identity = drafter.markov_identity
        self.vocab_size = getattr(drafter, "vocab_size", None)
        self.needs_rows = getattr(drafter, "needs_rows", False)

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        out = empty_result(len(batch), batch.width, batch.want_margin)
        n_out = batch.n_out.tolist()
        for i in range(len(batch)):  # the slow path: a loop over entries, by design
            tokens, margins = self.inner.draft(batch.context(i).tolist(), n_out[i], batch.rows[i].data)
            tokens = list(tokens)[: n_out[i]]
            out.tokens[i, : len(tokens)] = tokens
            out.counts[i] = len(tokens)
            if out.margins is not None:
                margins = list(margins)[: len(tokens)]
                out.margins[i, : len(margins)] = margins
        return out


def as_batched(drafter) -> BatchedDrafter:
    """``drafter`` itself when it has ``draft_batch``, else :class:`PerEntryDrafter`
    around its ``draft``.

    A class whose ``draft`` is defined below (in a subclass of) the class defining its
    ``draft_batch`` goes through ``draft``: a subclass that overrides only the per-entry
    method (a test drafter that gates or alters drafts) is never silently bypassed.

    Raises:
        TypeError: the object has neither method.
    """
    if isinstance(drafter, PerEntryDrafter):
        return drafter
    has_draft = callable(getattr(drafter, "draft", None))
    if callable(getattr(drafter, "draft_batch", None)):
        if not (has_draft and _defined_below(type(drafter), "draft", "draft_batch")):
            return drafter
    if has_draft:
        return PerEntryDrafter(drafter)
    raise TypeError(f"{type(drafter).__name__} has neither draft_batch(batch) nor draft(context, n_out, row)")


def _defined_below(cls: type, name: str, other: str) -> bool:
    """True when the class defining ``name`` is a strict subclass of the one defining
    ``other`` (both looked up along the MRO)."""
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    other_owner = next((c for c in cls.__mro__ if other in vars(c)), None)
    return owner is not None and other_owner is not None and owner is not other_owner and issubclass(owner, other_owner)
