"""The records rank 0 of a ``tp_group`` broadcasts at ``start()`` and ``round()``
(:mod:`.ranks` says who sends them and when; ``launch()``'s are :mod:`.launch`'s).

A record is two broadcasts from group rank 0, a header and the body it sizes (STARTED
has none):

    header  int64 [9]: kind, n, num_spec, outcome, source, resync_all, n_resync, flags,
            n_announcing (ERROR: n is the body's length in bytes; STARTED: n is the
            mode's index; DRAFTS: flags bit 0 margins, bit 1 sampled q)
    DRAFTS  int32 [n * k tokens | n counts | n_resync slots | n_announcing slots (the
            slots still being announced: ``Drafts.announcing``) | n * k margins as float32 bits
            | n * k * 32 q_ids | n * k * 16 words of q_weights, uint16 pairs in memory order]
    ERROR   uint8: JSON {"type": "module:qualname", "args": [...], "attrs": {...}, "message": str}

Why tensors and not ``broadcast_object_list``: the same calls work on gloo (CPU tensors)
and NCCL (tensors on the rank's current CUDA device) with nothing else to set up; the
drafts are int32 tensors already (one concatenation, one broadcast, no loop over
entries; q_weights travel as int32 words, which NCCL and gloo both carry, where uint16 is
not in every gloo operation); and nothing received is unpickled: an error is JSON,
rebuilt only as an exception class the receiving rank has already loaded. The header goes
first so that a rank whose batch has another size than rank 0's still reads the whole
record (it stays in step) and raises ``ValueError`` naming both sizes. Every rank's
drafts carry q exactly when rank 0's do, which is when its engine is sampled (every
answer of a sampled engine carries q, an empty one zeros; the ranks' configurations are
the same). On NCCL a receiver copies the header to the host once per record
(``round()`` blocks anyway).
"""

from __future__ import annotations

import json
import sys

import torch

from ... import wire
from ...outcome import Outcome
from ..values.drafts import Drafts

SOURCES = ("remote", "local", "none")
STARTED, DRAFTS, ERROR = 1, 2, 3
KIND_NAMES = {STARTED: "STARTED", DRAFTS: "DRAFTS", ERROR: "ERROR"}
HEADER_WORDS = 9
FLAG_MARGINS, FLAG_SAMPLED = 1, 2  # a DRAFTS header's flags
Q_WORDS = wire.SAMPLED_TOP + wire.SAMPLED_TOP // 2  # a drafted position's q_ids and q_weights, in int32 words
_SIMPLE = (str, int, float, bool, type(None))  # what an ERROR record carries as it is


def drafts_body_words(n: int, k: int, n_resync: int, flags: int, n_announcing: int = 0) -> int:
    """The int32 words of a DRAFTS record's body of ``n`` entries of ``num_spec`` ``k``."""
    per_position = 1 + (flags & FLAG_MARGINS) + (Q_WORDS if flags & FLAG_SAMPLED else 0)
    return n * k * per_position + n + n_resync + n_announcing


def drafts_record(d: Drafts) -> tuple[list[int], torch.Tensor]:
    """``d`` as a DRAFTS record: the header's 9 values and the int32 body (on the CPU),
    one concatenation; q_weights' uint16 pairs are viewed as int32 words, not widened."""
    n, k = d.tokens.shape
    parts = [d.tokens.reshape(-1), d.counts.reshape(-1), torch.tensor((*d.resync, *d.announcing), dtype=torch.int32)]
    flags = 0
    if d.margins is not None:
        flags |= FLAG_MARGINS
        parts.append(d.margins.to(torch.float32).reshape(-1).view(torch.int32))
    if d.q_ids is not None:
        flags |= FLAG_SAMPLED
        parts.append(d.q_ids.reshape(-1))
        parts.append(d.q_weights.to("cpu", torch.uint16).contiguous().reshape(-1).view(torch.int32))
    body = torch.cat([p.to("cpu", torch.int32) for p in parts])
    header = [DRAFTS, n, k, int(d.outcome), SOURCES.index(d.source), int(d.resync_all), len(d.resync), flags]
    return header + [len(d.announcing)], body


def drafts_from_record(header: list[int], body: torch.Tensor | None) -> Drafts:
    """The ``Drafts`` a DRAFTS record carries (views of the body, brought to the CPU once).

    Raises:
        ValueError: a body of another length than the header sizes.
    """
    _, n, k, outcome, source, resync_all, n_resync, flags, n_announcing = header
    words = drafts_body_words(n, k, n_resync, flags, n_announcing)
    body = torch.zeros(0, dtype=torch.int32) if body is None else body.cpu()
    if body.numel() != words:
        raise ValueError(f"a DRAFTS record of {body.numel()} words, its header sizes {words}")
    nk, top = n * k, wire.SAMPLED_TOP
    tokens, counts = body[:nk].view(n, k), body[nk : nk + n]
    at = nk + n + n_resync + n_announcing
    resync = tuple(body[nk + n : nk + n + n_resync].tolist())
    announcing = tuple(body[nk + n + n_resync : at].tolist())
    margins = q_ids = q_weights = None
    if flags & FLAG_MARGINS:
        margins, at = body[at : at + nk].view(torch.float32).view(n, k), at + nk
    if flags & FLAG_SAMPLED:
        q_ids = body[at : at + nk * top].view(n, k, top)
        q_weights = body[at + nk * top :].view(torch.uint16).view(n, k, top)
    return Drafts(
        tokens,
        counts,
        margins,
        SOURCES[source],
        Outcome(outcome),
        resync,
        bool(resync_all),
        q_ids,
        q_weights,
        announcing=announcing,
    )


def error_record(e: BaseException) -> bytes:
    """``e`` as an ERROR record's body: its class's path, its arguments (as they are when
    they are simple values, else its message), its simple public attributes."""
    cls = type(e)
    args = list(e.args) if all(isinstance(a, _SIMPLE) for a in e.args) else [str(e)]
    attrs = {k: v for k, v in vars(e).items() if not k.startswith("_") and isinstance(v, _SIMPLE)}
    return json.dumps(
        {"type": f"{cls.__module__}:{cls.__qualname__}", "args": args, "attrs": attrs, "message": str(e)}
    ).encode()


def error_from_record(raw: bytes, rank: int) -> BaseException:
    """The exception an ERROR record describes, of the same class when this process has
    loaded it (nothing is imported for it), else a RuntimeError naming the class."""
    doc = json.loads(raw)
    module, _, qualname = doc["type"].partition(":")
    cls = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    args = tuple(doc["args"])
    exc: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            exc = cls(*args)
        except Exception:  # a constructor that takes other arguments (Refused(code, reason))
            try:
                exc = cls.__new__(cls)
                exc.args = args
            except Exception:
                exc = None
        for key, value in doc["attrs"].items() if exc is not None else ():
            try:
                setattr(exc, key, value)
            except (AttributeError, TypeError):
                pass
    if exc is None:
        exc = RuntimeError(f"{module}.{qualname}: {doc['message']}")
    exc.add_note(f"raised on rank 0 of the tp_group; broadcast to rank {rank}")
    return exc
