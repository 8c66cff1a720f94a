"""The reference remote drafter: a ``tcp://`` server speaking the wire contract
(:class:`~.server.Worker`; how it serves one connection, :mod:`.serving`) and its
options (:mod:`.options`), with its parts: the front door (:mod:`.admission`), its
limits and the HELLO's checks (:mod:`.limits`), the HELLO's verdict and ack
(:mod:`.hello`), the engines it holds places for (:mod:`.sessions`) and their windows
(:mod:`.windows`; every stream's kept tokens read through :mod:`.history`), the
drafter's thread and its queue (:mod:`.scheduler`; a hub's rounds and pre-drafting
in idle time, :mod:`.idle`; the fair share of a call
:mod:`.fair`, what the drafter costs :mod:`.cost`, a job's lifecycle :mod:`.jobs`, a
call's arithmetic :mod:`.batching`), a round as arrays (:mod:`.round`) or in C
(:mod:`.native_round`; a connection served whole in C, :mod:`.lane`; every other
connection's frames, windows and replies in C, :mod:`.hub`, and the arrays it hands C,
:mod:`.hub_arrays`), its numbers (:mod:`.stats`) and their exposition
(:mod:`.metrics`), the drafter its flags name (:mod:`.drafters`) and the faults it may
be told to inject (:mod:`.faults`)."""

from .server import Worker

__all__ = ["Worker"]
