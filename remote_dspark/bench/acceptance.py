"""``remote-dspark bench acceptance``: the share of drafts a target accepts when the
drafter is the target itself, along sequences far longer than the worker's window.

Draft = target weights, so every draft a drafter makes from the target's whole context
is accepted: what is lost shows what the remote path loses (positions, history). For
each ``--max-context`` and each of ``--sequences`` sequences: a random prompt, the
target's own greedy continuation of it (transformers ``generate``, the whole context at
positions 0...), then rounds through a loopback worker serving the model at default
flags otherwise, as an engine drives them: NEW_GEN with the prompt (``min(32,
--window)`` tokens), then the tokens since the last round (the accepted drafts and the
target's own token). A round's drafts are accepted up to the first that differs from the
target's continuation. Acceptance (accepted / offered) is given overall, over the first
window of context and past it.

A model drafter keeps each stream whole, up to ``--max-context`` tokens (its default:
the model's positions): its drafts past the first window come from the whole sequence,
as the target's do, so nothing is lost past it.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

GOAL = 0.99  # acceptance along the whole sequence, for a drafter that keeps all of it
PROMPT_TOKENS = 32  # at most: the first NEW_GEN holds the whole prompt (min(32, --window))


def add_parser(sub) -> None:
    p = sub.add_parser(
        "acceptance",
        help="drafts accepted when the drafter is the target, along sequences several windows long",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument("--hf-model", metavar="DIR", help="a transformers causal LM saved in this local directory")
    model.add_argument(
        "--hf-random",
        metavar="KIND:LxW",
        default="llama:2x256",
        help="a randomly initialised model of this shape instead (default llama:2x256; kinds gpt2, llama)",
    )
    p.add_argument("--window", type=int, default=64, help="the worker's --window (default 64)")
    p.add_argument("--tokens", type=int, default=1500, help="sequence length past the prompt (default 1500)")
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per round (default 5)")
    p.add_argument("--sequences", type=int, default=3, help="sequences per --max-context (default 3)")
    p.add_argument(
        "--max-context",
        default="default",
        metavar="T[,T...]",
        help="the worker's --max-context to compare: numbers, or 'default' (the worker's default); default 'default'",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class AcceptanceOptions:
    window: int
    tokens: int
    num_spec: int
    sequences: int
    max_context: tuple[int | None, ...]  # None: the worker's default
    device: str

    @property
    def prompt(self) -> int:
        return min(PROMPT_TOKENS, self.window)

    @property
    def total(self) -> int:
        return self.prompt + self.tokens


def options(args) -> AcceptanceOptions:
    """Raises: ValueError naming the bad argument."""
    for name, low in (("window", 1), ("tokens", 1), ("num_spec", 1), ("sequences", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {low}")
    sizes = []
    for part in args.max_context.split(","):
        part = part.strip()
        if part == "default":
            sizes.append(None)
        elif part.isdigit() and int(part) >= 2:
            sizes.append(int(part))
        else:
            raise ValueError(f"--max-context {args.max_context!r}: {part!r} is not 'default' or a number >= 2")
    return AcceptanceOptions(args.window, args.tokens, args.num_spec, args.sequences, tuple(sizes), args.device)


def target_sequences(model, opts: AcceptanceOptions, vocab: int) -> list[list[int]]:
    """``opts.sequences`` prompts and the target's greedy continuation of each (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(11)
    out = []
    n = opts.total - opts.prompt + opts.num_spec
    for _ in range(opts.sequences):
        ids = torch.randint(0, vocab, (1, opts.prompt), generator=gen).to(model.device)
        with torch.inference_mode():
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(seq[0].tolist())
    return out


def accept_along(
    client, slot: int, seq: list[int], opts: AcceptanceOptions, first_round: int
) -> tuple[list, list, int]:
    """The rounds of one sequence (module docstring): (accepted, offered) over the first
    window of context and past it, and the next round id."""
    from .. import wire

    accepted, offered = [0, 0], [0, 0]
    end, sent, rid = opts.prompt, None, first_round
    while end < opts.total:
        if sent is None:  # NEW_GEN: the whole prompt (at most a window)
            entry = wire.Entry(slot, opts.num_spec, 0, tuple(seq[:end]), new_gen=True)
        else:
            entry = wire.Entry(slot, opts.num_spec, sent, tuple(seq[sent:end]))
        drafts = client.round(rid, [wire.encode_round_entries(rid, 1, 10_000, [entry], b"", 0)], 60_000).row(0)
        n = 0
        while n < len(drafts) and drafts[n] == seq[end + n]:
            n += 1
        which = int(end - opts.prompt >= opts.window)
        accepted[which] += n
        offered[which] += len(drafts)
        sent, end, rid = end, end + n + 1, rid + 1
    return accepted, offered, rid


def measure(path: str, name: str, opts: AcceptanceOptions, bar) -> list[dict]:
    from .. import wire
    from ..drafter.lm.hf import load_hf
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient
    from ..worker import Worker

    rows, seqs = [], None
    for i, size in enumerate(opts.max_context):
        bar.update(i, f"--max-context {size or 'default'}")
        device = None if opts.device == "auto" else opts.device
        d = load_hf(path, device, opts.window, opts.sequences, max_context=size)
        seqs = seqs or target_sequences(d.model.lm, opts, d.vocab_size)  # one set for every size
        accepted, offered = [0, 0], [0, 0]
        hello = wire.Hello(d.drafter_identity, d.markov_identity, 1, opts.sequences, 0, opts.num_spec)
        with Worker(d, "127.0.0.1", 0, window=opts.window, max_slots=opts.sequences) as w:
            c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{w.port}"), hello, 1, 60.0)
            try:
                rid = 1
                for slot, seq in enumerate(seqs):
                    a, o, rid = accept_along(c, slot, seq, opts, rid)
                    accepted = [x + y for x, y in zip(accepted, a)]
                    offered = [x + y for x, y in zip(offered, o)]
            finally:
                c.close()
        rows.append(
            {
                "model": name,
                "device": str(d.device),
                "max_context": d.max_context,
                "acceptance": round(sum(accepted) / max(1, sum(offered)), 4),
                "first_window": round(accepted[0] / max(1, offered[0]), 4),
                "past_window": round(accepted[1] / max(1, offered[1]), 4),
                "offered": sum(offered),
            }
        )
    bar.update(len(opts.max_context))
    return rows


def make_report(opts: AcceptanceOptions, rows: list[dict]) -> dict:
    whole = [r for r in rows if r["max_context"] >= opts.total + opts.num_spec]
    goals = [
        {
            "goal": f"acceptance >= {GOAL} along {opts.total} tokens, --max-context {r['max_context']}",
            "value": r["acceptance"],
            "met": r["acceptance"] >= GOAL,
        }
        for r in whole
    ]
    config = dataclasses.asdict(opts) | {"prompt_tokens": opts.prompt, "total_tokens": opts.total}
    return {"config": config, "rows": rows, "goals": goals}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"acceptance, drafter = target, k={c['num_spec']}, window {c['window']}: {c['sequences']} sequences of "
        f"{c['total_tokens']} tokens ({c['prompt_tokens']}-token prompts)",
        f"{'model':<16} {'device':>6} {'max context':>11} {'acceptance':>10} {'1st window':>10} {'past it':>8}",
        "-" * 66,
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['model']:<16} {r['device']:>6} {r['max_context']:>11} {r['acceptance']:>10.4f} "
            f"{r['first_window']:>10.4f} {r['past_window']:>8.4f}"
        )
    for g in report["goals"]:
        lines.append(f"goal {g['goal']}: {g['value']}, {'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def run(args) -> int:
    from ..progress import Progress
    from .hf_models import model_dir

    opts = options(args)
    import transformers

    transformers.logging.set_verbosity_error()
    with model_dir(args.hf_model, None if args.hf_model else args.hf_random) as (path, name):
        rows = measure(path, name, opts, Progress(len(opts.max_context), "acceptance rows"))
    report = make_report(opts, rows)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
