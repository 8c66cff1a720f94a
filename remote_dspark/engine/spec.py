"""What every part of the engine side agrees on: the configuration, the round's shape
and the engine's identity (one frozen value, built once by ``RemoteDSpark``, its fields
by keyword), and the checks its arguments pass first (:func:`check_arguments`: the
policy's needs and the wire contract's caps).

The sizes follow one rule, stated here once:

- a round carries at most ``round_tokens`` tokens (``Spec.max_tokens``): the region's
  token section, the sync path's send buffer and every writer's bound; and at most what
  the worker's HELLO_ACK says it takes in a round (``Spec.round_budget``). Its default,
  :func:`default_round_tokens`, holds a round of ``max_slots`` entries of
  ``ROUND_CONTEXT`` (64) context tokens each with their drafts: a round of continuing
  entries (``num_spec + 1`` tokens each) many times over, and at least one whole context
  of the cap, never more than a batch carries. The region is sized by it, never by
  ``max_slots x context_tokens``;
- a NEW_GEN context is cut to ``context_tokens`` (the cap, default ``CONTEXT_TOKENS``,
  8,192: whole contexts of the common models), or less: what the worker's HELLO_ACK says
  it keeps per slot (``Spec.context_cut``). A batch carries at most ``max_slots x
  (context_tokens + num_spec + 1)`` tokens once cut (``Spec.batch_tokens``, a bound, no
  memory); what does not fit its round goes over the next ones (:mod:`.values.announce`,
  on the device :mod:`.values.device_announce`), which hold at most ``context_tokens``
  tokens a slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import wire
from ..config.api import RemoteConfig
from ..config.mode import Mode
from .values.batch import CONTEXT_TOKENS, Batch, HostMeta
from .values.meta import host_meta


@dataclass(frozen=True, kw_only=True)
class Spec:
    cfg: RemoteConfig
    num_spec: int
    max_slots: int
    row_bytes: int
    max_tokens: int  # a round's tokens, round_tokens: the region's token section (the module docstring)
    depth: int  # rounds the engine may enqueue ahead of the proxy
    device: str  # "cpu" or "cuda"
    mode: Mode  # the mode running (the configured one, or sync after a failed self-test)
    engine_id: int
    environ: Mapping[str, str]
    n_out_table: Sequence[int] | None = None
    vocab_size: int = 0  # the engine's vocabulary (token ids 0..vocab_size-1); 0: unknown
    context_tokens: int = CONTEXT_TOKENS  # the engine's cap on a NEW_GEN context (sizes batch_tokens)

    @property
    def sampled(self) -> bool:
        """The engine asks for sampled drafts (``VLLM_DSPARK_SAMPLED_TOP32``): its batches
        carry temperatures and seeds, its drafts their distributions."""
        return self.cfg.sampled_top32

    @property
    def batch_tokens(self) -> int:
        """The most tokens a batch carries once its NEW_GEN contexts are cut (the module
        docstring): its rounds carry them ``max_tokens`` at a time."""
        return self.max_slots * (self.context_tokens + self.num_spec + 1)

    def context_cut(self, acked: int) -> int:
        """The tokens a NEW_GEN context is cut to, given ``acked``: what the worker's
        HELLO_ACK said it keeps per slot, 0 while no HELLO_ACK has come.

        With one, the smaller of it and the engine's cap. Before one, the smaller of the
        cap and ``wire.DEFAULT_CONTEXT``: the worker is not known yet, and one with the
        default window takes a round of at most that many context tokens per slot (its
        token limit follows its window); a round over a worker's limit is a protocol
        error that drops the connection, so the engine never sends more than any default
        worker takes until a worker has said it takes more."""
        return min(self.context_tokens, acked if acked > 0 else wire.DEFAULT_CONTEXT)

    def round_budget(self, acked: int) -> int:
        """The most tokens the next round carries, given ``acked``: the most the worker's
        HELLO_ACK said it takes in a round, 0 while no HELLO_ACK has come.

        With one, the smaller of it and ``round_tokens`` (``max_tokens``): a worker that
        takes fewer gets the same contexts in more chunks. Before one, the smaller of
        ``round_tokens`` and what a worker of the default window and limits takes from
        ``max_slots`` slots (``wire.DEFAULT_CONTEXT + wire.MAX_N_OUT`` tokens a slot: the
        worker's ``--max-round-tokens`` default), as :meth:`context_cut` does."""
        return min(self.max_tokens, acked if acked > 0 else self.max_slots * (wire.DEFAULT_CONTEXT + wire.MAX_N_OUT))

    def n_out_for(self, n: int) -> int:
        """The default n_out of a round of ``n`` entries (the table's, else num_spec)."""
        t = self.n_out_table
        return self.num_spec if t is None else t[min(n, len(t) - 1)]

    def meta(self, batch: Batch, acked: int = 0, max_tokens: int | None = None) -> HostMeta:
        """``batch``'s metadata checked and cut on the host (see ``meta.host_meta``), its
        NEW_GEN contexts to :meth:`context_cut` of ``acked``, at most ``max_tokens`` tokens
        (a round's, ``self.max_tokens``, unless told).

        Raises:
            ValueError: naming the field that is wrong.
        """
        return host_meta(
            batch,
            max_slots=self.max_slots,
            num_spec=self.num_spec,
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            n_out_default=self.n_out_for(len(batch)),
            vocab_size=self.vocab_size,
            context_tokens=self.context_cut(acked),
            sampled=self.sampled,
        )

    def hello(self) -> wire.Hello:
        return self.cfg.hello(
            self.engine_id,
            max_slots=self.max_slots,
            row_bytes=self.row_bytes,
            num_spec=self.num_spec,
            vocab_size=self.vocab_size,
        )


def check_arguments(
    cfg: RemoteConfig,
    local_drafter: object | None,
    device: str,
    num_spec: int,
    max_slots: int,
    row_bytes: int,
    vocab_size: int | None,
    context_tokens: int = CONTEXT_TOKENS,
    round_tokens: int | None = None,
) -> None:
    """``RemoteDSpark``'s arguments against the policy and the wire contract's caps.

    Raises:
        ValueError: an argument out of range, naming it.
    """
    if cfg.keeps_local_drafter and local_drafter is None:
        raise ValueError(f"VLLM_DSPARK_REMOTE_POLICY={cfg.policy} needs a local drafter")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    for name, value, lo, hi in (
        ("num_spec", num_spec, 1, wire.MAX_N_OUT),
        ("max_slots", max_slots, 1, wire.MAX_ENTRIES),
        ("row_bytes", row_bytes, 0, wire.MAX_ROW_BYTES),  # 0: no rows (batches carry none)
    ):
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value}: must be in {lo}..{hi} (the wire contract's cap)")
    sampled_caps = (("num_spec", num_spec, wire.MAX_SAMPLED_N_OUT), ("max_slots", max_slots, wire.MAX_SAMPLED_ENTRIES))
    for name, value, hi in sampled_caps:
        if cfg.sampled_top32 and value > hi:
            raise ValueError(
                f"{name}={value}: over {hi}, a sampled session's cap (VLLM_DSPARK_SAMPLED_TOP32=1: its "
                "distributions stay a few MiB a round)"
            )
    # A context is announced over rounds of round_tokens (Spec.batch_tokens is a bound, not
    # memory); one whole context of the cap with its drafts fits the wire's round.
    most = wire.MAX_TOKENS - num_spec - 1
    if not _int_in(context_tokens, 1, most):
        raise ValueError(
            f"context_tokens={context_tokens!r}: must be an int in 1..{most} (a whole context of the cap "
            f"with its {num_spec} + 1 tokens of drafts within the wire contract's {wire.MAX_TOKENS} a round)"
        )
    if round_tokens is not None and not _int_in(round_tokens, 1, wire.MAX_TOKENS):
        raise ValueError(
            f"round_tokens={round_tokens!r}: must be None (the default) or an int in 1..{wire.MAX_TOKENS} "
            "(the tokens one round carries, within the wire contract's cap)"
        )
    if vocab_size is not None and (
        not hasattr(vocab_size, "__index__") or isinstance(vocab_size, bool) or not 1 <= vocab_size <= wire.MAX_VOCAB
    ):
        raise ValueError(f"vocab_size={vocab_size!r}: must be None (unknown) or an int in 1..{wire.MAX_VOCAB}")
    if cfg.sampled_top32 and vocab_size is not None and vocab_size < wire.SAMPLED_TOP:
        raise ValueError(
            f"vocab_size={vocab_size}: a sampled engine's drafts list {wire.SAMPLED_TOP} distinct ids a position "
            "(VLLM_DSPARK_SAMPLED_TOP32=1), so its vocabulary must have at least that many"
        )


def _int_in(value, lo: int, hi: int) -> bool:
    """``value`` is an int (not a bool) in ``lo..hi``."""
    return not isinstance(value, bool) and hasattr(value, "__index__") and lo <= value <= hi


ROUND_CONTEXT = wire.DEFAULT_CONTEXT  # context tokens an entry of the default round has room for


def default_round_tokens(max_slots: int, num_spec: int, context_tokens: int) -> int:
    """``round_tokens`` when none is given: a round of ``max_slots`` entries of
    ``ROUND_CONTEXT`` (64) context tokens with their drafts, so a burst of new requests
    of a default worker's window is never chunked, and a round of continuing entries
    (``num_spec + 1`` tokens each) fits many times over. At least one whole context of
    the cap with its drafts (a chunk is never the only thing a round can hold), at most
    what a batch carries (``Spec.batch_tokens``). Longer contexts go in chunks."""
    per_entry = num_spec + 1
    most = max_slots * (context_tokens + per_entry)
    return min(most, max(max_slots * (ROUND_CONTEXT + per_entry), context_tokens + per_entry))
