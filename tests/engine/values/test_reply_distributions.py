"""The engine's check of a sampled session's DRAFTS (``engine.values.reply`` rule 5): each
counted position's distribution by the shared rule (``remote_dspark.sampled``), the
first broken position named by entry and draft; what lies past a count is never read.
(Its C twin, the proxy's, is held equal to it by ``test_reply_check``.)"""

import re

import numpy as np
import pytest

from remote_dspark import wire
from remote_dspark.engine.values.reply import Asked, check_reply

TOP, TOTAL = wire.SAMPLED_TOP, wire.SAMPLED_TOTAL
VOCAB = 100
SLOTS = np.array([3, 1], np.uint32)


def reply(counts=(2, 1), width=3, edit=None, sampled=True) -> wire.DraftsFrame:
    """A decoded DRAFTS for slots 3 and 1: draft j of entry i is token 10 * i + j, its
    distribution ids 10 * i + j + 0..31 with the whole weight on the first (the draft);
    zeros past counts, then ``edit(ids, weights, tokens)`` in place ([n, width, 32])."""
    n = len(counts)
    tokens = np.zeros((n, width), np.int32)
    ids = np.zeros((n, width, TOP), np.int32)
    weights = np.zeros((n, width, TOP), np.uint16)
    for i, c in enumerate(counts):
        for j in range(c):
            tokens[i, j] = 10 * i + j
            ids[i, j] = 10 * i + j + np.arange(TOP)
            weights[i, j, 0] = TOTAL
    if edit is not None:
        edit(ids, weights, tokens)
    q = (ids.ravel().tolist(), weights.ravel().tolist()) if sampled else (None, None)
    d = wire.DraftsFrame(1, SLOTS.tolist(), list(counts), [0] * n, width, tokens.ravel().tolist(), None, *q)
    frame = wire.encode_drafts(d, 7)
    return wire.decode_drafts(wire.decode_header(frame[: wire.HEADER.size]), frame[wire.HEADER.size :])


def asked(sampled=True) -> Asked:
    return Asked(SLOTS, 3, 3, VOCAB, False, want_sampled=sampled)


def test_an_honest_sampled_reply_passes_and_what_lies_past_a_count_is_never_read():
    check_reply(reply(), asked())

    def junk_past_counts(ids, weights, tokens):
        ids[1, 1:] = -5  # entry 1 drafted one token: positions 1 and 2 are past its count
        weights[1, 1:] = 7

    check_reply(reply(edit=junk_past_counts), asked())


def test_distributions_are_present_exactly_when_the_session_asked_for_them():
    with pytest.raises(wire.ProtocolError, match="^DRAFTS without distributions, the session asked for them$"):
        check_reply(reply(sampled=False), asked())
    with pytest.raises(wire.ProtocolError, match="^DRAFTS with distributions, the session did not ask for them$"):
        check_reply(reply(), asked(sampled=False))


def put(i, j, what):
    """An edit of entry i's draft j: ``what(ids, weights, tokens)`` on that position."""

    def edit(ids, weights, tokens):
        what(ids[i, j], weights[i, j], tokens[i], j)

    return edit


@pytest.mark.parametrize(
    "edit,why",
    [
        (put(1, 0, lambda ids, w, t, j: ids.__setitem__(5, VOCAB)), "entry 1: draft 0: id 100 outside 0..99"),
        (put(0, 1, lambda ids, w, t, j: ids.__setitem__(3, ids[2])), "entry 0: draft 1: id 3 repeated"),
        (
            put(0, 0, lambda ids, w, t, j: w.__setitem__(0, TOTAL - 1)),
            "entry 0: draft 0: weights sum to 65534 (each 0..65535), expected exactly 65535",
        ),
        (
            put(1, 0, lambda ids, w, t, j: t.__setitem__(j, 11)),  # id 11 is listed, with weight 0
            "entry 1: draft 0: drafted token 11 not among its ids of weight > 0",
        ),
    ],
)
def test_each_part_of_the_rule_is_held_naming_the_entry_and_the_draft(edit, why):
    with pytest.raises(wire.ProtocolError, match=f"^{re.escape(why)}$"):
        check_reply(reply(edit=edit), asked())


def test_the_first_position_in_entry_order_is_named_and_other_rules_come_first():
    def two(ids, weights, tokens):
        weights[1, 0, 0] = 1  # entry 1's draft 0: weights off
        ids[0, 1, 4] = -1  # entry 0's draft 1: an id outside; the first in entry order

    with pytest.raises(wire.ProtocolError, match="^entry 0: draft 1: id -1 outside 0..99$"):
        check_reply(reply(edit=two), asked())

    def also_a_bad_token(ids, weights, tokens):
        two(ids, weights, tokens)
        tokens[1, 0] = VOCAB  # rule 4 (a token outside the vocabulary) before rule 5

    with pytest.raises(wire.ProtocolError, match="^entry 1: draft token 100 outside 0..99$"):
        check_reply(reply(edit=also_a_bad_token), asked())
