"""``remote-dspark bench generate``: transformers' ``generate()`` four ways, on the same
prompts and models.

``plain``       the target alone, greedy;
``assistant``   transformers' own assisted generation, the draft model in this process
                (``assistant_model=``; k drafts a round, its schedule constant and its
                confidence threshold off, so it drafts as the remote path does);
``sync``        the draft served by a ``remote-dspark worker`` on 127.0.0.1 (a child
                process), rounds from the engine thread
                (:func:`remote_dspark.integrations.transformers.generate`, ``ASYNC=0``);
``process``     the same through the supervised proxy process (``ASYNC_PROXY=process``);
``process-spec`` ``process`` against a second worker that pre-drafts (``--lm-speculate``
                ``--speculate``, default 16 outcomes a stream): its rounds that hit (the
                worker's hits over the remote rounds) and whether its tokens are
                ``process``'s (the cache changes no output). Not run unless named in
                ``--modes``.

``--sample`` adds three rows that sample at temperature 1 (``do_sample=True``, top-k and
top-p off), on the same prompts from the same torch seed:

``assistant-sample``  transformers' own assisted sampling with the draft in this process;
``sync-sample``       the remote drafter with sampled drafts (``VLLM_DSPARK_SAMPLED_TOP32=1``,
                      sync mode), its drafts' distributions handed to transformers as
                      candidate logits;
``process-sample``    the same through the supervised proxy process.

``--redraw`` adds ``sync-sample-redraw``: ``sync-sample`` with the engine redrawing the
drafts from their q with its own randomness (``VLLM_DSPARK_REMOTE_SAMPLED_REDRAW=1``,
exact against any worker): its accepted drafts per round against ``sync-sample``'s are
what the defence costs. ``--temperature`` sets the sample rows' temperature (a random
model's logits are nearly flat, about 0.3 apart: 0.1 there samples as a trained model
near 1 does).

Both verify by speculative sampling (accept a draft with probability ``min(1, p/q)``), so
their tokens differ from ``plain``'s and between them, their distribution does not; what
they compare is acceptance: accepted drafts per round and tokens per target forward
(the remote draft's q is the draft's top 32 ids, the in-process assistant's its whole
vocabulary). A sampled session drafts at most 16 tokens a round (``--num-spec``). A
random pair's distributions are nearly flat over the whole vocabulary, so the top 32
hold little of the draft's mass and ``sync-sample`` accepts almost nothing there; the
sample rows mean something with trained models (``--target``, ``--draft``).

The models: ``--target DIR --draft DIR`` (transformers models saved in local
directories, loaded as the worker loads them), or a random pair (``--random
KIND:LxW``, default ``gpt2:24x1024``: GPT-2 medium's shape) whose draft is the target's
first ``--draft-layers`` layers (4) with its embeddings and head (all its layers: the
target itself, as ``--draft`` the target's own directory is). Each mode first runs one
short generation unmeasured (kernels, graphs, connections), then generates
``--new-tokens`` tokens after each of ``--prompts`` random prompts. A row gives the
mode's wall time over all prompts, tokens per second, target forwards per generated
token, tokens per target forward, accepted drafts per round (per target forward: each
forward verifies one round), acceptance (accepted / offered drafts; for the assistant:
tokens the target did not have to produce itself over the draft's forwards) and, for
the remote modes, the mean round latency. Every greedy mode's tokens are checked against
``plain``'s. The goals (never asserted): ``process`` within 1.1x of ``assistant``'s wall
time; with the target itself as the draft, ``sync`` and ``process`` each accepting at
least 0.95 of the drafts with ``plain``'s tokens (the worker at its default flags keeps
whole streams, so nothing is lost once a sequence passes its 64-token window); with
``--sample``, the ratio of ``sync-sample``'s accepted drafts per round to
``assistant-sample``'s.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import time

MODES = ("plain", "assistant", "sync", "process")
SPEC_MODE = "process-spec"  # process against a worker with --lm-speculate
SAMPLE_MODES = ("assistant-sample", "sync-sample", "process-sample")  # --sample's rows
REDRAW_MODE = "sync-sample-redraw"  # --redraw's row
SAMPLE = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}  # temperature 1, nothing cut
GREEDY = {"do_sample": False}
MAX_SAMPLED_SPEC = 16  # a sampled session's drafts per round (wire.MAX_SAMPLED_N_OUT)
GOAL_X = 1.1  # process wall time over assistant's, at most
GOAL_SELF = 0.95  # a greedy remote mode's acceptance at least, when the draft is the target
WINDOW = 64


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="transformers generate(): plain, its in-process assistant, and the remote drafter (sync, process)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", metavar="DIR", help="the target: a transformers causal LM in a local directory")
    p.add_argument("--draft", metavar="DIR", help="the draft model's directory (with --target)")
    p.add_argument("--random", default="gpt2:24x1024", metavar="KIND:LxW", help="a random target (gpt2:24x1024)")
    p.add_argument(
        "--draft-layers",
        type=int,
        default=4,
        help="a random target's layers the draft keeps (default 4; all: the target itself)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the models run")
    p.add_argument("--prompts", type=int, default=3, help="prompts per mode (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per round (default 5)")
    p.add_argument("--timeout-ms", type=int, default=1000, help="the remote round's deadline (default 1000)")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to run (default {','.join(MODES)})")
    p.add_argument(
        "--speculate",
        type=int,
        default=16,
        help=f"{SPEC_MODE}'s worker: --lm-speculate N, outcomes pre-drafted a stream (default 16)",
    )
    p.add_argument("--sample", action="store_true", help=f"add {' and '.join(SAMPLE_MODES)}: sampled rows")
    p.add_argument("--redraw", action="store_true", help=f"add {REDRAW_MODE}: sync-sample, the engine redrawing")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled rows' temperature (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    device: str
    prompts: int
    prompt_tokens: int
    new_tokens: int
    num_spec: int
    timeout_ms: int
    modes: tuple[str, ...]
    temperature: float = 1.0  # the sampled rows'
    speculate: int = 16  # process-spec's worker's --lm-speculate


def options(args) -> GenerateOptions:
    """Raises: ValueError naming the bad argument."""
    from ..worker.drafters import MAX_SPECULATE

    if (args.target is None) != (args.draft is None):
        raise ValueError("--target and --draft go together (or neither: --random)")
    limits = (("prompts", 1, 1000), ("prompt_tokens", 1, 4096), ("new_tokens", 1, 8192), ("num_spec", 1, 32))
    for name, low, high in limits + (
        ("timeout_ms", 1, 600_000),
        ("draft_layers", 1, 64),
        ("speculate", 1, MAX_SPECULATE),
    ):
        if not low <= getattr(args, name) <= high:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in {low}..{high}")
    modes = tuple(m.strip() for m in args.modes.split(","))
    known = MODES + SAMPLE_MODES + (REDRAW_MODE, SPEC_MODE)
    if not modes or any(m not in known for m in modes):
        raise ValueError(f"--modes {args.modes!r}: choose from {', '.join(known)}")
    if args.sample:
        modes += tuple(m for m in SAMPLE_MODES if m not in modes)
    if args.redraw and REDRAW_MODE not in modes:
        modes += (REDRAW_MODE,)
    if not (args.temperature > 0 and args.temperature < float("inf")):
        raise ValueError(f"--temperature {args.temperature}: must be a finite number > 0")
    if any(m in SAMPLE_MODES + (REDRAW_MODE,) for m in modes) and args.num_spec > MAX_SAMPLED_SPEC:
        raise ValueError(f"--num-spec {args.num_spec}: sampled drafts take at most {MAX_SAMPLED_SPEC} a round")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return GenerateOptions(
        device,
        args.prompts,
        args.prompt_tokens,
        args.new_tokens,
        args.num_spec,
        args.timeout_ms,
        modes,
        args.temperature,
        args.speculate,
    )


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def measure_mode(mode: str, opts: GenerateOptions, target, draft, worker, prompts, tick) -> tuple[dict, list]:
    """One mode's row and its outputs (one generation per prompt, after a warm-up);
    ``tick(note)`` before each."""
    import torch

    from ..config import RemoteConfig
    from ..engine import RemoteDSpark
    from ..integrations.transformers import generate
    from .hf_models import Forwards
    from .speculation import SpecCounters, figures

    fwd = Forwards(target)
    draft_fwd = Forwards(draft)
    rd = None
    sampled = mode in SAMPLE_MODES + (REDRAW_MODE,)
    if mode in ("sync", "process", SPEC_MODE, "sync-sample", "process-sample", REDRAW_MODE):
        proxied = mode.startswith("process")
        switches = {"VLLM_DSPARK_REMOTE_ASYNC": "1" if proxied else "0"}
        if proxied:
            switches["VLLM_DSPARK_REMOTE_ASYNC_PROXY"] = "process"
        if sampled:
            switches["VLLM_DSPARK_SAMPLED_TOP32"] = "1"
        if mode == REDRAW_MODE:
            switches["VLLM_DSPARK_REMOTE_SAMPLED_REDRAW"] = "1"
        env = worker.env(VLLM_DSPARK_REMOTE_TIMEOUT_MS=str(opts.timeout_ms), **switches)
        cfg, vocab = RemoteConfig.from_env(env), target.config.vocab_size
        rd = RemoteDSpark(cfg, num_spec=opts.num_spec, max_slots=4, row_bytes=0, vocab_size=vocab).start()

    def once(prompt, new_tokens):
        kwargs = dict(max_new_tokens=new_tokens, **(SAMPLE | {"temperature": opts.temperature} if sampled else GREEDY))
        if mode in ("assistant", "assistant-sample"):
            return target.generate(prompt, assistant_model=draft, **kwargs)
        if rd is not None:
            return generate(target, prompt, rd, **kwargs)
        return target.generate(prompt, **kwargs)

    try:
        once(prompts[0], min(8, opts.new_tokens))  # warm-up, unmeasured
        torch.manual_seed(0)  # a sampled mode's randomness (the target's and the drafts'), the same each run
        fwd.calls = draft_fwd.calls = 0
        before = rd.stats() if rd is not None else None
        counted = SpecCounters.read(worker.metrics_url) if mode == SPEC_MODE else None
        outputs, wall = [], 0.0
        for i, prompt in enumerate(prompts):
            tick(f"{mode}: prompt {i + 1}/{len(prompts)}")
            _sync(opts.device)
            t0 = time.perf_counter()
            outputs.append(once(prompt, opts.new_tokens))
            _sync(opts.device)
            wall += time.perf_counter() - t0
        tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(outputs, prompts))
        row = {"mode": mode, "device": opts.device, "wall_s": round(wall, 3), "tokens": tokens}
        row["tokens_per_s"] = round(tokens / wall, 1)
        row["target_forwards_per_token"] = round(fwd.calls / tokens, 3)
        row["tokens_per_forward"] = round(tokens / max(1, fwd.calls), 3)
        row["accepted_per_round"] = round((tokens - fwd.calls) / max(1, fwd.calls), 3)  # each forward: 1 + accepted
        row["acceptance"] = _acceptance(mode, tokens, fwd.calls, draft_fwd.calls, before, rd)
        row["round_ms"] = _round_ms(before, rd.stats()) if rd is not None else None
        rounds = rd.stats().round_latency.count - before.round_latency.count if rd is not None else 0
        row["hit_share"] = (
            figures(counted, SpecCounters.read(worker.metrics_url), rounds)["hit_share"] if counted else None
        )
        return row, outputs
    finally:
        fwd.remove()
        draft_fwd.remove()
        if rd is not None:
            rd.close()


def _acceptance(mode, tokens, target_calls, draft_calls, before, rd) -> float | None:
    if mode == "plain":
        return None
    if mode in ("assistant", "assistant-sample"):  # a target forward: 1 + accepted tokens; a draft forward: one draft
        return round((tokens - target_calls) / max(1, draft_calls), 4)
    after = rd.stats()
    accepted = sum(after.accepted_at) - sum(before.accepted_at)
    offered = sum(after.offered_at) - sum(before.offered_at)
    return round(accepted / max(1, offered), 4)


def _round_ms(before, after) -> float | None:
    """The mean remote round over the measured generations (ms)."""
    n = after.round_latency.count - before.round_latency.count
    return round((after.round_latency.sum - before.round_latency.sum) / n * 1e3, 3) if n else None


def make_report(opts: GenerateOptions, name: str, rows: list[dict], same: dict, itself: bool = False) -> dict:
    """``same``: by mode, whether its tokens are plain's (and ``SPEC_MODE + "/process"``:
    whether process-spec's are process's)."""
    from .speculation import generate_goals

    by = {r["mode"]: r for r in rows}
    for r in rows:
        r["same_tokens_as_plain"] = same.get(r["mode"])
    if SPEC_MODE in by:
        by[SPEC_MODE]["same_tokens_as_process"] = same.get(SPEC_MODE + "/process")
    goals = []
    for mode in ("sync", "process") if itself and "plain" in by else ():  # the draft is the target
        if mode in by:
            r = by[mode]
            met = r["acceptance"] >= GOAL_SELF and bool(r["same_tokens_as_plain"])
            goal = f"{mode}: acceptance >= {GOAL_SELF} and the same tokens as plain (the draft is the target)"
            goals.append({"goal": goal, "value": r["acceptance"], "met": met})
    if "assistant" in by and "process" in by:
        ratio = by["process"]["wall_s"] / by["assistant"]["wall_s"]
        goals.append(
            {
                "goal": f"process wall time / assistant's <= {GOAL_X}x",
                "value": round(ratio, 3),
                "met": ratio <= GOAL_X,
            }
        )
    goals += generate_goals(by)
    ratios = []
    if all(m in by for m in SAMPLE_MODES):
        theirs = by["assistant-sample"]["accepted_per_round"]
        ratios.append(
            {
                "ratio": "sync-sample accepted drafts per round / assistant-sample's",
                "value": round(by["sync-sample"]["accepted_per_round"] / theirs, 3) if theirs else None,
            }
        )
    if "sync-sample" in by and REDRAW_MODE in by:
        theirs = by["sync-sample"]["accepted_per_round"]
        ratios.append(
            {
                "ratio": f"{REDRAW_MODE} accepted drafts per round / sync-sample's (the redraw's cost)",
                "value": round(by[REDRAW_MODE]["accepted_per_round"] / theirs, 3) if theirs else None,
            }
        )
    config = dataclasses.asdict(opts) | {"models": name, "window": WINDOW}
    return {"bench": "generate", "config": config, "rows": rows, "goals": goals, "ratios": ratios}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"generate(), {c['models']}, k={c['num_spec']}, sampled at {c['temperature']:g}: {c['prompts']} prompts "
        f"of {c['prompt_tokens']} tokens, "
        f"{c['new_tokens']} new tokens each",
        f"{'mode':<18} {'device':>6} {'wall s':>8} {'tokens/s':>9} {'fwd/token':>9} {'token/fwd':>9} "
        f"{'acc/round':>9} {'accept':>7} {'round ms':>8} {'hits':>6} same",
        "-" * 105,
    ]
    for r in report["rows"]:
        accept = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        round_ms = "-" if r["round_ms"] is None else f"{r['round_ms']:.2f}"
        hits = "-" if r["hit_share"] is None else f"{r['hit_share']:.0%}"
        same = {True: "yes", False: "NO", None: "-"}[r["same_tokens_as_plain"]]
        lines.append(
            f"{r['mode']:<18} {r['device']:>6} {r['wall_s']:>8.3f} {r['tokens_per_s']:>9,.1f} "
            f"{r['target_forwards_per_token']:>9.3f} {r['tokens_per_forward']:>9.3f} {r['accepted_per_round']:>9.3f} "
            f"{accept:>7} {round_ms:>8} {hits:>6} {same}"
        )
    for g in report["goals"]:
        value = "" if g["value"] is None else f"{g['value']}{g.get('unit', '' if 'acceptance' in g['goal'] else 'x')}, "
        lines.append(f"goal {g['goal']}: {value}{'met' if g['met'] else 'NOT met'}")
    for q in report["ratios"]:
        lines.append(f"{q['ratio']}: {q['value']}x")
    return "\n".join(lines)


def run(args) -> int:
    import torch
    import transformers

    from ..demo.harness import WorkerProcess
    from ..drafter.lm.hf import load_hf
    from ..progress import Progress
    from .hf_models import parse_random, random_pair

    opts = options(args)
    transformers.logging.set_verbosity_error()
    pair = contextlib.nullcontext((args.target, args.draft, f"{args.target} / {args.draft}"))
    with pair if args.target else random_pair(args.random, args.draft_layers) as (target_dir, draft_dir, name):
        target = load_hf(target_dir, opts.device, WINDOW, cache_slots=0).model.lm  # the worker's own loader
        draft = load_hf(draft_dir, opts.device, WINDOW, cache_slots=0).model.lm
        draft.generation_config.num_assistant_tokens = opts.num_spec
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        gen = torch.Generator().manual_seed(0)
        vocab = target.config.vocab_size
        prompts = [
            torch.randint(0, vocab, (1, opts.prompt_tokens), generator=gen).to(opts.device) for _ in range(opts.prompts)
        ]
        # default flags: the worker keeps whole streams (the draft sees what the target sees)
        extra = ("--hf-model", draft_dir, "--lm-device", opts.device, "--window", str(WINDOW))
        extra += ("--lm-cache-slots", "8")
        bar, done = Progress(len(opts.modes) * opts.prompts, "generate"), itertools.count()

        def tick(note: str) -> None:
            bar.update(next(done), note)

        rows, outputs = [], {}
        spec = (*extra, "--lm-speculate", str(opts.speculate), "--metrics-port", "0")  # its hits on /metrics
        with contextlib.ExitStack() as stack:
            workers = {"": stack.enter_context(WorkerProcess(chaos=False, extra=extra))}
            if SPEC_MODE in opts.modes:
                workers[SPEC_MODE] = stack.enter_context(WorkerProcess(chaos=False, extra=spec))
            for mode in opts.modes:
                worker = workers.get(mode, workers[""])
                row, outputs[mode] = measure_mode(mode, opts, target, draft, worker, prompts, tick)
                rows.append(row)
        bar.update(bar.total)
    plain = outputs.get("plain")
    greedy = {m: o for m, o in outputs.items() if m not in SAMPLE_MODES + (REDRAW_MODE,)}  # sampled: other tokens
    same = {m: all(torch.equal(a, b) for a, b in zip(o, plain)) for m, o in greedy.items()} if plain else {}
    if SPEC_MODE in outputs and "process" in outputs:
        same[SPEC_MODE + "/process"] = all(map(torch.equal, outputs[SPEC_MODE], outputs["process"]))
    itself = args.draft == args.target if args.target else args.draft_layers == parse_random(args.random)[1]
    report = make_report(opts, name, rows, same, itself)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
