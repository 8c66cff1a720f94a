"""What the model drafter tests share: batches of contexts, a scripted engine session
through the worker's own windows, the drafts' comparison up to near-ties, a HELLO for a
drafter and a client of a loopback worker."""

import numpy as np
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.drafter.contract import DraftBatch
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient
from remote_dspark.worker.windows import Windows

TIE = 1e-4  # below this top1 - top2 margin, padding's rounding may flip the greedy choice


def batch_of(contexts, n_out, width, want_margin=True, **stream):
    offsets = np.zeros(len(contexts) + 1, np.int64)
    offsets[1:] = np.cumsum([len(c) for c in contexts])
    tokens = np.concatenate([np.asarray(c, np.int32) for c in contexts]) if contexts else np.zeros(0, np.int32)
    return DraftBatch(
        tokens,
        offsets,
        np.asarray(n_out, np.int32),
        np.zeros((len(contexts), 0), np.uint8),
        want_margin,
        width,
        **stream,
    )


def agreeing_prefix(ref_tokens, ref_margins, tokens) -> tuple[list, list]:
    """Both drafts up to the first near-tie of the reference (where a flip is allowed)."""
    k = next((i for i, m in enumerate(ref_margins) if m <= TIE), len(ref_margins))
    return list(ref_tokens[:k]), list(tokens[:k])


def assert_same_drafts(got, want):
    """Two results agree: counts equal, drafts equal up to each entry's first near-tie."""
    assert list(got.counts) == list(want.counts)
    for i, count in enumerate(want.counts.tolist()):
        a, b = agreeing_prefix(
            want.tokens[i, :count].tolist(), want.margins[i, :count].tolist(), got.tokens[i, :count].tolist()
        )
        assert a == b, f"entry {i}"


def hello(drafter, **kw):
    fields = dict(engine_id=7, max_slots=8, row_bytes=0, num_spec=3, want_margin=True)
    fields.update(kw)
    return wire.Hello(drafter.drafter_identity, drafter.markov_identity, **fields)


def connect(port: int, h: wire.Hello, session: int = 1) -> DraftClient:
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), h, session, 5.0)


class WholeStreams:
    """A worker's reader of whole streams (``DraftBatch.history``) for scripted sessions:
    each (session, slot)'s tokens since its NEW_GEN, all kept; ``reads`` counts its reads."""

    def __init__(self):
        self.tokens, self.reads = {}, 0

    def record(self, session, slot, tokens, new_gen):
        if new_gen:
            self.tokens[session, slot] = []
        self.tokens.setdefault((session, slot), []).extend(int(t) for t in tokens)

    def read(self, sessions, slots, first, stop):
        self.reads += 1
        parts = [self.tokens[int(s), int(t)][int(f) : int(e)] for s, t, f, e in zip(sessions, slots, first, stop)]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        return np.array([t for p in parts for t in p], np.int32), offsets


class Engine:
    """A scripted engine side of one session: the ROUND arrays the worker would decode,
    through a real ``Windows``, made into the worker's DraftBatch; with ``whole`` (a
    :class:`WholeStreams`) the batch names each stream's whole sequence too, as a worker
    serving a drafter that keeps streams does."""

    def __init__(self, window: int, max_slots: int = 6, whole: WholeStreams | None = None):
        self.windows = Windows(max_slots, window)
        self.next = {}  # slot -> next position
        self.whole = whole

    def batch(self, entries, width):
        """entries: (slot, tokens, new_gen, gap[, position of a NEW_GEN, 0 by default])
        records; returns the batch and ok mask."""
        slots = np.array([e[0] for e in entries], np.int64)
        positions = np.array(
            [(e[4] if len(e) > 4 else 0) if e[2] else self.next.get(e[0], 0) + (5 if e[3] else 0) for e in entries],
            np.int64,
        )
        new_gen = np.array([e[2] for e in entries], bool)
        lens = [len(e[1]) for e in entries]
        offsets = np.zeros(len(entries) + 1, np.int64)
        offsets[1:] = np.cumsum(lens)
        tokens = np.concatenate([np.asarray(e[1], np.int32) for e in entries])
        adv = self.windows.advance(slots, positions, new_gen, offsets, tokens)
        for (slot, toks, new, *_), pos, ok in zip(entries, positions.tolist(), adv.ok):
            self.next[slot] = pos + len(toks)
            if self.whole is not None and ok:
                self.whole.record(self.windows.serial, slot, toks, new)
        m = len(adv.slots)
        return DraftBatch(
            adv.tokens,
            adv.offsets,
            np.full(m, width, np.int32),
            np.zeros((m, 0), np.uint8),
            True,
            width,
            session=self.windows.serial,
            slots=adv.slots,
            gens=adv.gens,
            lengths=adv.lengths,
            positions=adv.starts,
            kept_from=None if self.whole is None else np.zeros(m, np.int64),
            history=self.whole,
        ), adv.ok


STREAM_OP = st.tuples(
    st.integers(0, 3),  # slot
    st.sampled_from(["append", "append", "append", "new_gen", "gap"]),
    st.integers(0, 300),  # a NEW_GEN's position
    st.lists(st.integers(0, 127), max_size=14),  # tokens (a NEW_GEN's: up to twice a small window)
)
STREAM_ROUNDS = st.lists(st.lists(STREAM_OP, min_size=1, max_size=4, unique_by=lambda op: op[0]), max_size=12)


class Streams:
    """Slots scripted by :data:`STREAM_OP` records through an :class:`Engine`: a NEW_GEN
    (at any position; a slot's first op is one), an append of up to 3 tokens, or a gap
    (RESYNC: the slot is forgotten). Keeps each slot's whole sequence, so a test can
    encode any span of it afresh."""

    def __init__(self, window: int, max_slots: int = 4, whole: bool = False):
        self.engine = Engine(window, max_slots, WholeStreams() if whole else None)
        self.seq = {}  # slot -> (position of its first token, its tokens)

    def round(self, ops, width):
        entries = []
        for slot, kind, at, tokens in ops:
            if kind == "new_gen" or slot not in self.seq:
                entries.append((slot, tokens or [1], True, False, at))
                self.seq[slot] = (at, list(tokens or [1]))
            elif kind == "gap":
                entries.append((slot, [2], False, True))
                del self.seq[slot]
            else:
                entries.append((slot, tokens[:3], False, False))
                self.seq[slot][1].extend(tokens[:3])
        batch, _ = self.engine.batch(entries, width)
        ends = [self.span(slot)[0] + len(self.span(slot)[1]) for slot in batch.slots.tolist()]
        assert (batch.positions + np.diff(batch.offsets)).tolist() == ends  # true positions
        return batch

    def span(self, slot: int, first: int | None = None) -> tuple[int, list[int]]:
        """The slot's tokens from position ``first`` (None: its first) and that position."""
        start, tokens = self.seq[slot]
        first = start if first is None else first
        return first, tokens[first - start :]
