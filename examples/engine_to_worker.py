"""The toy engine of engine_step.py against a worker you started: python examples/engine_to_worker.py

Everything comes from the environment the README's Deployment section sets:
VLLM_DSPARK_REMOTE (the worker's address), the two identities it printed,
POLICY=capacity, ASYNC=1 and ASYNC_PROXY=process, and KEY_FILE with a worker's
--key-file. The vocabulary comes from --vocab, else from the worker's answer to a HELLO
(its drafter's vocabulary). It prints the engine's rounds: every one ok means the engine
and the worker agree. The toy target's language is not the worker's model's, so few of
its drafts are accepted; that is not what this checks. Exit status 0 when every round
was ok.
"""

import argparse
import os

from engine_step import STEPS, engine  # the example beside this one (python puts its folder first on the path)

from remote_dspark import wire
from remote_dspark.config import RemoteConfig
from remote_dspark.transport.client import DraftClient


def worker_vocab(cfg: RemoteConfig, env: dict[str, str]) -> int:
    """The vocabulary of the worker ``cfg`` names, from its HELLO_ACK (0: it does not say).
    One connection with the configured identities and key, closed with BYE at once.

    Raises: Refused (the worker said no: its reason), TransportError (no answer)."""
    hello = cfg.hello(wire.random_id(), max_slots=1, row_bytes=32, num_spec=1)
    client = DraftClient.connect(cfg.endpoint, hello, wire.random_id(), cfg.connect_timeout_ms / 1000.0, env, cfg.key)
    try:
        return client.ack.vocab_size
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--vocab", type=int, default=0, help="the engine's vocabulary (default: the worker's)")
    args = p.parse_args(argv)
    env = dict(os.environ)
    cfg = RemoteConfig.from_env(env)  # a ValueError names a bad variable
    vocab = args.vocab or worker_vocab(cfg, env)
    if vocab < 1:
        p.error("the worker does not say its vocabulary: give --vocab")
    print(f"worker at {cfg.endpoint}, vocabulary {vocab}")
    ok, _ = engine(env, vocab)
    return 0 if ok == STEPS else 1


if __name__ == "__main__":
    raise SystemExit(main())
