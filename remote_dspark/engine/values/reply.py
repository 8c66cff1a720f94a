"""The engine's check of a worker's DRAFTS against what was asked, before anything of
it is delivered (sync mode: ``RemoteLink.round``'s ``check``).

**This rule has a C twin.** The proxy's rounds (process and thread mode, TCP and ofl)
are checked by ``hf_unpack_drafts``, ``check_entries`` and ``check_distributions`` in
``native/reply_check.c``: the same checks, in the same order, with the same words, so
that a reply gets the same verdict whichever path it takes.
``tests/engine/values/test_reply_check.py`` runs the same replies (crafted and fuzzed)
through both and holds the verdicts equal; change one, change both.

The frame's own rules (caps, length, counts <= width, known statuses) are
``wire.decode_drafts``'s and the header's (session, round) ``client.recv_drafts``'s.
Then, in order:

1. the entries are the round's: as many, the same slots in the same order; otherwise
   ``wire.BadReply`` (the round is an ERROR, the connection is kept);
2. the width is at most ``num_spec`` (from here on ``wire.ProtocolError``: the round is
   an ERROR and the connection is dropped, so it is re-established);
3. margins are present exactly when the session asked for them (HELLO's want_margin),
   and distributions exactly when it asked for sampled drafts (HELLO's sampled option);
4. per entry, in entry order: its count is at most the round's ``n_out`` for it; a
   RESYNC entry has no drafts; every counted token is in ``0..vocab_size-1``
   (``0..2**31-1`` when the vocabulary is unknown); every counted margin is in [0, 1]
   (so finite: NaN fails both comparisons);
5. in a sampled session, once every entry passed 4: each counted position's
   distribution, by the shared rule (:func:`remote_dspark.sampled.violation`: ids in the
   vocabulary and distinct, weights summing to exactly 65,535, the drafted token among
   the ids of weight > 0, weights non-increasing along the ids, and the drafted token
   the rule's pick at the entry's seed, the draft's absolute position and its index),
   the first position that breaks it named by entry and draft. Draft j of entry i is at
   the ROUND's ``positions[i]`` + its token count + j (:func:`draft_positions`: the
   entry's last token's position + 1 + j, NEW_GEN or not, with or without new tokens).
   Its C twin is ``check_distributions`` in ``native/reply_check.c``, with the same words.

Only counted positions are checked: what lies past a count never reaches the engine
(``drafts.to_drafts`` and ``hf_unpack`` zero it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import wire
from ...sampled import violation

I32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Asked:
    """What one round asked of the worker: what its reply is held to."""

    slots: np.ndarray  # [n] the round's slots, entry order
    n_out: np.ndarray | int  # [n] drafts asked per entry, or one value for all
    num_spec: int  # the session's (HELLO) widest row
    vocab_size: int  # the engine's vocabulary (HELLO); 0: unknown
    want_margin: bool  # the session asked for margins (HELLO)
    want_sampled: bool = False  # the session asked for sampled drafts' distributions (HELLO)
    seed: np.ndarray | None = None  # [n] uint64: each entry's seed (the ROUND's; a sampled session)
    draft_at: np.ndarray | None = None  # [n] int64: each entry's draft 0's position (draft_positions)

    def __post_init__(self):
        if self.want_sampled and (self.seed is None or self.draft_at is None):
            raise ValueError(
                "Asked: a sampled session's round needs seed and draft_at (each draft is held to its pick)"
            )


def draft_positions(positions, offsets) -> np.ndarray:
    """[n] int64: the absolute position of each entry's draft 0, from the ROUND's
    ``positions`` [n] (each entry's first token's) and ``offsets`` [n + 1]: the entry's
    last token's position + 1, which is ``positions[i]`` when it has no new token."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return np.asarray(positions, dtype=np.int64) + (offsets[1:] - offsets[:-1])


def check_reply(d: wire.DraftsFrame, asked: Asked) -> None:
    """Hold the decoded DRAFTS ``d`` to ``asked`` (the rules in the module docstring),
    with whole-array operations: no loop over entries.

    Raises:
        wire.BadReply: other entries or slots than the round's.
        wire.ProtocolError: any other rule broken, naming the entry and the value.
    """
    n = len(asked.slots)
    slots = np.asarray(d.slots, dtype=np.uint32)
    if len(slots) != n:
        raise wire.BadReply(f"drafts for {len(slots)} entries, the round has {n}")
    if not np.array_equal(slots, asked.slots):
        e = int(np.argmax(slots != asked.slots))
        raise wire.BadReply(f"entry {e}: drafts for slot {slots[e]}, the round has slot {asked.slots[e]}")
    width = d.width
    if width > asked.num_spec:
        raise wire.ProtocolError(f"drafts width {width} over num_spec={asked.num_spec}")
    if (d.margins is not None) != asked.want_margin:
        raise wire.ProtocolError(
            "DRAFTS without margins, the session asked for them"
            if asked.want_margin
            else "DRAFTS with margins, the session did not ask for them"
        )
    if d.sampled != asked.want_sampled:
        raise wire.ProtocolError(
            "DRAFTS with distributions, the session did not ask for them"
            if d.sampled
            else "DRAFTS without distributions, the session asked for them"
        )
    if not n:
        return
    counts = np.asarray(d.counts, dtype=np.int64)
    n_out = np.broadcast_to(np.asarray(asked.n_out, dtype=np.int64), (n,))
    top = asked.vocab_size - 1 if asked.vocab_size else I32_MAX
    live = np.arange(width) < counts[:, None]
    tokens = np.asarray(d.tokens, dtype=np.int32).reshape(n, width)
    bad_token = live & ((tokens < 0) | (tokens > top))
    over = counts > n_out
    resync = (counts > 0) & (np.asarray(d.statuses) == wire.STATUS_RESYNC)
    bad = over | resync | bad_token.any(axis=1)
    if d.margins is not None:
        margins = np.asarray(d.margins, dtype=np.float32).reshape(n, width)
        bad_margin = live & ~((margins >= 0) & (margins <= 1))
        bad |= bad_margin.any(axis=1)
    if not bad.any():
        if d.sampled:
            _check_distributions(d, asked, width, live, tokens)
        return
    e = int(np.argmax(bad))  # the first entry that breaks a rule; then its first rule, as in C
    if over[e]:
        raise wire.ProtocolError(f"entry {e}: {counts[e]} drafts, the round asked for {n_out[e]}")
    if resync[e]:
        raise wire.ProtocolError(f"entry {e}: RESYNC with {counts[e]} drafts")
    if bad_token[e].any():
        j = int(np.argmax(bad_token[e]))
        raise wire.ProtocolError(f"entry {e}: draft token {tokens[e, j]} outside 0..{top}")
    j = int(np.argmax(bad_margin[e]))
    raise wire.ProtocolError(f"entry {e}: margin {float(margins[e, j]):g} not in [0, 1]")


def _check_distributions(d: wire.DraftsFrame, asked: Asked, width: int, live: np.ndarray, tokens: np.ndarray) -> None:
    """Rule 5 (module docstring) over the counted positions ``live`` [n, width].

    Raises: wire.ProtocolError naming the entry, the draft and what is wrong."""
    n = len(asked.slots)
    shape = (n, width, wire.SAMPLED_TOP)
    ids = np.asarray(d.q_ids, dtype=np.int32).reshape(shape)
    weights = np.asarray(d.q_weights, dtype=np.uint16).reshape(shape)
    e, j = np.nonzero(live)  # row-major: the order of ids[live]
    at = (np.asarray(asked.seed, np.uint64)[e], np.asarray(asked.draft_at, np.int64)[e] + j, j)
    found = violation(ids[live], weights[live], tokens[live], asked.vocab_size or I32_MAX + 1, at)
    if found is not None:
        raise wire.ProtocolError(f"entry {e[found[0]]}: draft {j[found[0]]}: {found[1]}")
