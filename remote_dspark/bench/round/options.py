"""``bench round``'s options: its rows, slot counts, token counts, timeouts and goals
(:mod:`.run` has the command and what each row measures), and :func:`options`, which
checks the parsed arguments before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("floor", "sync", "thread", "process", "draft")
CUDA_MODES = MODES + ("launch",)
OPT_IN_MODES = ("mac",)  # only when --modes names them
ORDER = CUDA_MODES + OPT_IN_MODES  # the table's
ENGINE_MODES = ("sync", "thread", "process")
DESCRIBE = {
    "floor": "TCP ping-pong (floor)",
    "sync": "round(), ASYNC=0",
    "thread": "round(), proxy thread",
    "process": "round(), proxy process",
    "draft": "draft_batch() alone",
    "launch": "launch(), CUDA, process",
    "mac": "HMAC of DRAFTS, both ends",
}
SWEEP = (64, 256, 1024, 4096)
DEFAULT_SLOTS = 256  # with --no-sweep
PROMPT_TOKENS = 16  # a NEW_GEN entry's context
STEP_TOKENS = 3  # a steady entry: 2 accepted drafts + the target's token
CONTEXT_TOKENS = 64  # the draft row's context per entry
TEXT_TOKENS = 1 << 14  # synthetic-language text the feeder reads from (wraps)
MIN_ROUNDS = 50  # the fewest measured rounds of a row above 256 slots
DRAFT_BATCHES = 8  # the draft row rotates through this many different batches
ROUND_TIMEOUT_S = 30.0  # the floor: no round takes this long unless a side is gone
START_TIMEOUT_S = 10.0  # the floor peer connects within this
TIMEOUT_MS = 1000
MAX_TP = 8  # --tp: ranks of one host

# The goals, checked at GOAL_SLOTS (and LINEAR_AT against GOAL_SLOTS).
GOAL_SLOTS = 256
LINEAR_AT = 4096
GOAL_X_FLOOR = 3.0
GOAL_X_SYNC = 1.2
GOAL_ENGINE_CPU_MS = 0.3
GOAL_DRAFT_MS = 0.1
GOAL_LINEAR = 2.0
GOAL_LM_PROCESS_MS = 2.0  # with --drafter lm: a whole process round at GOAL_SLOTS
GOAL_MAC_SHARE = 0.05  # --modes ...,mac: a MAC on DRAFTS, both ends, over the process round at GOAL_SLOTS
GOAL_SAMPLED_X = 1.5  # with --sampled: a sampled process round's p50 over the greedy one's at GOAL_SLOTS
SAMPLED_TEMPERATURE = 1.0  # the sampled rows' temperature (every entry)


@dataclass(frozen=True)
class RoundOptions:
    slots: tuple[int, ...]
    num_spec: int
    row_bytes: int
    rounds: int
    warmup: int
    modes: tuple[str, ...]
    timeout_ms: int
    device: str
    device_metadata: bool
    drafter: str = "markov"  # the worker's: markov, or lm (the built-in model)
    worker_late_ms: int = 0  # the worker answers every round this late (0: at once)
    sampled: bool = False  # every row also sampled (SAMPLED_TOP32), at the slot counts within the sampled cap
    tp: int = 1  # the launch rows on this many tensor-parallel ranks (bench.round.tp)
    tp_backend: str = "nccl"

    def kinds(self, slots: int) -> tuple[bool, ...]:
        """The rows' kinds at ``slots``: greedy, and sampled with ``--sampled`` within the
        wire's sampled cap on entries."""
        from ... import wire

        return (False, True) if self.sampled and slots <= wire.MAX_SAMPLED_ENTRIES else (False,)

    def rounds_for(self, slots: int) -> int:
        """Measured rounds of a row at ``slots``: all of them up to GOAL_SLOTS, fewer above."""
        if slots <= GOAL_SLOTS:
            return self.rounds
        return min(self.rounds, max(MIN_ROUNDS, self.rounds * GOAL_SLOTS // slots))


def _ints(raw: str, name: str) -> list[int]:
    try:
        return [int(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"{name} {raw!r}: expected an integer or comma-separated integers") from None


def check_sampled_caps(num_spec: int, slots: list[int]) -> None:
    """``--sampled`` within a sampled session's caps (the sweep's larger rows simply have
    no sampled twin: :meth:`RoundOptions.kinds`).

    Raises: ValueError naming the argument."""
    from ... import wire

    if num_spec > wire.MAX_SAMPLED_N_OUT:
        raise ValueError(
            f"--num-spec {num_spec} with --sampled: a sampled session drafts at most {wire.MAX_SAMPLED_N_OUT}"
        )
    if slots and max(slots) > wire.MAX_SAMPLED_ENTRIES:
        raise ValueError(
            f"--slots {max(slots)} with --sampled: a sampled session has at most {wire.MAX_SAMPLED_ENTRIES} entries"
        )


def check_tp(args, modes: list[str]) -> tuple[int, str]:
    """``--tp`` and ``--tp-backend``. Raises: ValueError naming the argument."""
    tp, tp_backend = getattr(args, "tp", 1), getattr(args, "tp_backend", "nccl")
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"--tp {tp}: must be in 1..{MAX_TP}")
    if tp > 1 and "launch" not in modes:
        raise ValueError(f"--tp {tp}: it runs the launch rows (--device cuda --modes ...,launch)")
    return tp, tp_backend


def options(args) -> RoundOptions:
    """The run's options from the parsed arguments.

    Raises: ValueError naming the bad argument and the rule it breaks.
    """
    from ... import wire

    if args.slots is not None and args.sweep:
        raise ValueError(f"--slots {args.slots} with --sweep: give one or the other")
    if args.slots is not None:
        slots = _ints(args.slots, "--slots")
    else:
        slots = list(SWEEP) if args.sweep in (None, True) else [DEFAULT_SLOTS]
    for s in slots:
        if not 1 <= s <= wire.MAX_ENTRIES:
            raise ValueError(f"--slots {s}: must be in 1..{wire.MAX_ENTRIES} (the wire's cap on entries per round)")
    if len(set(slots)) != len(slots):
        raise ValueError(f"--slots {args.slots}: a slot count appears twice")
    if not 1 <= args.num_spec <= wire.MAX_N_OUT:
        raise ValueError(f"--num-spec {args.num_spec}: must be in 1..{wire.MAX_N_OUT} (the wire's cap)")
    if not 1 <= args.row_bytes <= wire.MAX_ROW_BYTES:
        raise ValueError(f"--row-bytes {args.row_bytes}: must be in 1..{wire.MAX_ROW_BYTES} (the wire's cap)")
    for s in slots:
        size = wire.round_sections(s, s * PROMPT_TOKENS, args.row_bytes).size
        if size > wire.MAX_PAYLOAD:
            raise ValueError(
                f"--row-bytes {args.row_bytes} at {s} slots: a ROUND of {size} bytes is over "
                f"the wire's {wire.MAX_PAYLOAD}-byte cap"
            )
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: must be >= 1")
    if args.warmup < 1:
        raise ValueError(
            f"--warmup {args.warmup}: must be >= 1 (the first round announces every slot: never a steady-state figure)"
        )
    if args.timeout_ms < 1:
        raise ValueError(f"--timeout-ms {args.timeout_ms}: must be >= 1")
    late_ms = getattr(args, "worker_late_ms", 0)
    if not 0 <= late_ms < args.timeout_ms:
        raise ValueError(
            f"--worker-late-ms {late_ms}: must be in 0..{args.timeout_ms - 1}, below --timeout-ms "
            "(a later answer is a timeout)"
        )
    if args.device_metadata and args.device != "cuda":
        raise ValueError("--device-metadata: only with --device cuda")
    allowed = (CUDA_MODES if args.device == "cuda" else MODES) + OPT_IN_MODES
    if args.modes is None:
        modes = [m for m in allowed if m not in OPT_IN_MODES]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in modes:
            if m == "launch" and args.device != "cuda":
                raise ValueError("--modes launch: only with --device cuda")
            if m not in allowed:
                raise ValueError(f"--modes {args.modes!r}: unknown mode {m!r}; choose from {', '.join(allowed)}")
        if not modes:
            raise ValueError(f"--modes {args.modes!r}: no mode named")
    modes = [m for m in ORDER if m in modes]  # table order, each once
    tp, tp_backend = check_tp(args, modes)
    sampled = getattr(args, "sampled", False)
    if sampled:
        check_sampled_caps(args.num_spec, slots if args.slots is not None else [])
    return RoundOptions(
        tuple(slots),
        args.num_spec,
        args.row_bytes,
        args.rounds,
        args.warmup,
        tuple(modes),
        args.timeout_ms,
        args.device,
        args.device_metadata,
        getattr(args, "drafter", "markov"),
        late_ms,
        sampled,
        tp,
        tp_backend,
    )
