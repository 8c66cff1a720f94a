"""The engine's check of a sampled session's DRAFTS (``engine.values.reply`` rule 5): each
counted position's distribution by the shared rule (``remote_dspark.sampled``), each
draft the pick at its entry's seed, its absolute position and its index, the first
broken position named by entry and draft; what lies past a count is never read.
(Its C twin, the proxy's, is held equal to it by ``test_reply_check``.)"""

import re

import numpy as np
import pytest

from remote_dspark import wire
from remote_dspark.engine.values.reply import Asked, check_reply, draft_positions
from remote_dspark.sampled import pick, uniform_u32

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


SEEDS = np.array([5, 2**64 - 1], np.uint64)
DRAFT_AT = np.array([40, 2**32 + 3], np.int64)  # each entry's draft 0's absolute position


def asked(sampled=True) -> Asked:
    if not sampled:
        return Asked(SLOTS, 3, 3, VOCAB, False)
    return Asked(SLOTS, 3, 3, VOCAB, False, True, SEEDS, DRAFT_AT)


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


def test_weights_must_not_rise_along_the_ids_but_equal_weights_may_come_in_any_id_order():
    def rising(ids, weights, tokens):
        weights[0, 1, 0], weights[0, 1, 2] = TOTAL - 9, 9  # index 1 holds 0: a rise at index 2

    with pytest.raises(wire.ProtocolError, match=r"^entry 0: draft 1: weights rise at index 2 \(0, then 9\)"):
        check_reply(reply(edit=rising), asked())

    def ties_reversed(ids, weights, tokens):
        # entry 1's draft 0: three ids of equal weight, listed by descending id; the drafted
        # token is the one the pick lands on at its seed and position
        ids[1, 0, :3] = [90, 80, 70]
        weights[1, 0, :3] = [21845] * 3
        u = uniform_u32(SEEDS[1], DRAFT_AT[1], 0)
        tokens[1, 0] = pick(ids[1, 0], weights[1, 0], u)

    check_reply(reply(edit=ties_reversed), asked())


def test_a_draft_that_is_not_the_pick_is_refused_naming_the_pick_and_the_position():
    """The issue's attacker: the token listed last with weight 1 (weights otherwise
    valid and non-increasing) passes every other part; the pick at its seed and position
    is another id."""

    def sliver(ids, weights, tokens):
        ids[1, 0] = [i for i in range(TOP + 1) if i != 10][: TOP - 1] + [10]
        weights[1, 0] = [65534 // 31 + (m < 65534 % 31) for m in range(TOP - 1)] + [1]

    d = reply(edit=sliver)
    ids = np.asarray(d.q_ids, np.int32).reshape(2, 3, TOP)[1, 0]
    weights = np.asarray(d.q_weights, np.uint16).reshape(2, 3, TOP)[1, 0]
    want = pick(ids, weights, uniform_u32(SEEDS[1], DRAFT_AT[1], 0))
    assert want != 10
    why = f"entry 1: draft 0: drafted token 10, the pick at its seed and position {2**32 + 3} is {want}"
    with pytest.raises(wire.ProtocolError, match=f"^{re.escape(why)}$"):
        check_reply(d, asked())


def test_each_draft_is_drawn_at_its_own_position_and_index():
    """Entry 0's draft 1 at DRAFT_AT[0] + 1 with index 1: a q whose pick moves with the
    draw, its token the pick there, passes; the pick of draft 0's draw does not."""
    ids = np.arange(40, 40 + TOP, dtype=np.int32)
    w = np.zeros(TOP, np.uint16)
    w[:16] = [TOTAL // 16 + (m < TOTAL % 16) for m in range(16)]
    here = pick(ids, w, uniform_u32(SEEDS[0], DRAFT_AT[0] + 1, 1))
    there = [pick(ids, w, uniform_u32(SEEDS[0], DRAFT_AT[0] + dp, dj)) for dp, dj in ((0, 1), (1, 0), (0, 0))]
    assert any(t != here for t in there)  # the draw depends on both (for this fixed q and seed)

    def drafted(token):
        def edit(ids_, weights, tokens):
            ids_[0, 1], weights[0, 1], tokens[0, 1] = ids, w, token

        return edit

    check_reply(reply(edit=drafted(here)), asked())
    for t in {int(t) for t in there if t != here}:
        with pytest.raises(wire.ProtocolError, match=f"the pick at its seed and position {DRAFT_AT[0] + 1} is {here}"):
            check_reply(reply(edit=drafted(t)), asked())


def test_draft_positions_follow_the_last_token_of_each_entry():
    """Draft 0 is at the entry's last token's position + 1: its first token's position
    plus its token count; with no new token, the ROUND's position itself."""
    positions = np.array([0, 17, 2**32 - 1, 9])
    offsets = np.array([0, 5, 5, 7, 7])  # 5 tokens (a NEW_GEN context), none, 2, none
    assert draft_positions(positions, offsets).tolist() == [5, 17, 2**32 + 1, 9]


def test_a_sampled_round_is_asked_with_its_seeds_and_positions():
    with pytest.raises(ValueError, match="seed and draft_at"):
        Asked(SLOTS, 3, 3, VOCAB, False, True)
