"""One vocabulary for what happened to a round, from the C library to the dashboard.

:class:`Outcome` is how a round was answered. Its values are the status word of a
drafts slot (the C library writes them), ``Drafts.outcome`` carries it to the engine,
the statistics count by it and its :attr:`~Outcome.label` is the metric label and the
JSON key. :class:`RoundEvent` is what one network attempt did (the C round's
``HF_EV_*``; the Python round reports the same events): each event has exactly one
outcome (:data:`OUTCOME_OF`) and one breaker verdict (``breaker.Breaker.observe``), so
the sync path, the ofl path and the native TCP round cannot count or judge a round
differently.

Torch-free: the proxy imports it.
"""

from __future__ import annotations

import enum


class Outcome(enum.IntEnum):
    """How a round was answered (the status word of its drafts slot)."""

    OK = 0  # the worker's drafts (possibly none)
    TIMEOUT = 1  # no reply within the round's deadline
    ERROR = 2  # no connection, a broken one, or a reply that broke the contract
    BREAKER_SKIP = 3  # the breaker is open: no network this round
    WATCHDOG = 4  # the engine's native watchdog answered first
    NO_PROXY = 5  # the engine, with no proxy serving (or closing)
    ORPHAN = 6  # the engine, for a round a dead proxy had claimed

    @property
    def label(self) -> str:
        """The metric label and JSON key: ``ok``, ``breaker_skip``, ..."""
        return self.name.lower()


class RoundEvent(enum.IntEnum):
    """What one round did on the network (the C ``HF_EV_*`` codes)."""

    OK = 0  # sent, answered with its drafts
    AT_ONCE = 1  # not sent (no connection, the breaker open): answered with a given outcome
    TIMEOUT = 2  # sent, no reply by the deadline: the connection is kept
    LOST = 3  # the connection broke (send, receive, closed, BYE)
    PROTOCOL = 4  # the reply broke the wire contract: the connection is dropped
    BAD_REPLY = 5  # well-formed drafts for other entries or slots than the round's: the connection is kept
    BAD_DESC = 6  # the engine's descriptor breaks a rule: nothing sent (rounds_bad_desc)


# The one table from event to outcome (AT_ONCE carries its own: ERROR or BREAKER_SKIP).
OUTCOME_OF = {
    RoundEvent.OK: Outcome.OK,
    RoundEvent.TIMEOUT: Outcome.TIMEOUT,
    RoundEvent.LOST: Outcome.ERROR,
    RoundEvent.PROTOCOL: Outcome.ERROR,
    RoundEvent.BAD_REPLY: Outcome.ERROR,
    RoundEvent.BAD_DESC: Outcome.ERROR,
}

# Events after which the connection is dropped (the next round waits for a reconnect).
DROPS_CONNECTION = frozenset({RoundEvent.LOST, RoundEvent.PROTOCOL})
