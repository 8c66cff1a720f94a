"""``remote-dspark markov build``: a Markov cache file from a token file."""

from __future__ import annotations

import argparse

from ..drafter.markov import MAX_ORDER, MAX_TOP, MarkovModel, read_tokens


def add_parser(sub) -> None:
    p = sub.add_parser(
        "markov",
        help="Markov cache files for the reference worker",
        description="Build Markov cache files (format: remote_dspark/drafter/markov.py).",
    )
    msub = p.add_subparsers(dest="markov", metavar="ACTION", required=True)
    b = msub.add_parser(
        "build",
        help="build a cache from a token file and print its identity",
        description="Count next tokens after every K-token context of TOKENS "
        "(whitespace-separated integers in a .txt file, else raw "
        "little-endian int32) and write the cache. Its sha256, printed, is "
        "the Markov identity (VLLM_DSPARK_REMOTE_MARKOV_IDENTITY).",
    )
    b.add_argument("tokens", help="token file (.txt: whitespace-separated integers; else int32 LE)")
    b.add_argument("-o", "--output", required=True, help="cache file to write")
    b.add_argument("--order", type=int, default=2, help=f"context length K, 1..{MAX_ORDER} (default 2)")
    b.add_argument("--top", type=int, default=4, help=f"next tokens kept per context, 1..{MAX_TOP} (default 4)")
    b.set_defaults(func=build)


def build(args: argparse.Namespace) -> int:
    try:
        tokens = read_tokens(args.tokens)
    except OSError as e:
        raise ValueError(f"{args.tokens}: {e.strerror}") from e
    if len(tokens) <= args.order:
        raise ValueError(f"{args.tokens}: {len(tokens)} tokens, need more than --order {args.order}")
    bad = next((t for t in tokens if not -(2**31) <= t < 2**31), None)
    if bad is not None:
        raise ValueError(f"{args.tokens}: token {bad} does not fit a 32-bit token id")
    model = MarkovModel.from_tokens(tokens, order=args.order, top=args.top)
    try:
        model.save(args.output)
    except OSError as e:
        raise ValueError(f"--output {args.output!r}: {e.strerror}") from e
    print(f"wrote {args.output}: order {model.order}, {len(model.table)} contexts from {len(tokens)} tokens")
    print(f"VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={model.identity.hex()}")
    return 0
