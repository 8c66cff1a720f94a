"""A toy engine drives RemoteDSpark against a loopback worker: python examples/engine_step.py

Its target continues a cyclic language (token t is followed by t + 1 mod its vocabulary,
16 here) for four requests. Each step it asks the remote drafter for drafts, keeps those
that match its own next tokens, reports what it accepted and announces again any slot the
worker lost. examples/engine_to_worker.py runs the same engine against a worker you start.
"""

import os

import torch

from remote_dspark.config import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.engine import Batch, RemoteDSpark, apply_cost_overrides
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

K, SLOTS, VOCAB, STEPS = 4, 4, 16, 30  # drafts a round, requests, vocabulary, steps


def engine(env: dict[str, str], vocab: int = VOCAB) -> tuple[int, int]:
    """STEPS steps of the toy engine over ``vocab`` tokens, configured by ``env``; prints
    its rounds and returns (ok rounds, drafts accepted)."""
    # 1. Early, on every rank, before the engine builds its depth policy: the remote
    #    round's costs go into the environment (here the depth policy is off: nothing).
    cfg = RemoteConfig.from_env(env)  # a ValueError names a bad variable
    apply_cost_overrides(cfg, env, depth_policy_on=False, num_spec=K)
    # 2. One RemoteDSpark per engine (per rank with tp_group=...), started once.
    hidden = torch.randn(SLOTS, 8)  # the rows the drafter may read
    rd = RemoteDSpark(
        cfg, num_spec=K, max_slots=SLOTS, row_bytes=hidden[0].numel() * 4, vocab_size=vocab, environ=env
    ).start()
    try:
        seqs = [[s * 3 % vocab] for s in range(SLOTS)]  # each request's tokens so far
        sent = [0] * SLOTS  # how many the worker has seen
        accepted_total = 0
        for _ in range(STEPS):
            # 3. Each step, one entry per request: the tokens since its last round (0 sent:
            #    a NEW_GEN entry with the whole context), their first position, its row.
            batch = Batch.from_lists(
                list(range(SLOTS)),
                [q[n:] for q, n in zip(seqs, sent)],
                sent,
                [n == 0 for n in sent],
                hidden,
                torch.arange(SLOTS),
            )
            out = rd.round(batch)  # drafts [SLOTS, K], counts [SLOTS]
            sent = [len(q) for q in seqs]
            accepted, offered = verify(seqs, out, vocab)
            accepted_total += sum(accepted)
            # 4. After verifying: what was accepted, and the slots the worker lost (a new
            #    worker, a new proxy), announced again whole next round.
            rd.record_accepted(accepted, offered)
            sent = [0 if out.resync_all or s in out.resync else n for s, n in enumerate(sent)]
        st = rd.stats()
        print(f"{st.total_rounds} rounds ({st.rounds[Outcome.OK]} ok), {accepted_total} accepted, mode {st.mode}")
        return st.rounds[Outcome.OK], accepted_total
    finally:
        rd.close()  # 5. within 2 s, whatever the remote does


def verify(seqs: list[list[int]], out, vocab: int) -> tuple[list[int], list[int]]:
    """The target's verification: each request accepts the drafts that match its next
    tokens, then appends the target's own next token (t + 1). Returns the accepted and
    offered counts per draft position."""
    accepted, offered = [0] * K, [0] * K
    for s, seq in enumerate(seqs):
        for i in range(int(out.counts[s])):
            offered[i] += 1
            if int(out.tokens[s, i]) != (seq[-1] + 1) % vocab:
                break
            accepted[i] += 1
            seq.append(int(out.tokens[s, i]))
        seq.append((seq[-1] + 1) % vocab)
    return accepted, offered


def main() -> int:
    # The remote drafter: on another machine in a deployment; here a loopback worker.
    drafter = MarkovDrafter(MarkovModel.from_tokens([t % VOCAB for t in range(4 * VOCAB)], order=1, top=1))
    worker = Worker(drafter, "127.0.0.1", 0).start()
    try:
        env = dict(
            os.environ,
            VLLM_DSPARK_REMOTE=f"tcp://127.0.0.1:{worker.port}",
            VLLM_DSPARK_REMOTE_IDENTITY=drafter.drafter_identity.hex(),
            VLLM_DSPARK_REMOTE_MARKOV_IDENTITY=drafter.markov_identity.hex(),
            VLLM_DSPARK_REMOTE_POLICY="capacity",
            VLLM_DSPARK_REMOTE_ASYNC="1",
            VLLM_DSPARK_REMOTE_ASYNC_PROXY="process",
            VLLM_DSPARK_REMOTE_STATS_FILE="",
            VLLM_DSPARK_REMOTE_LOG_EVERY="0",
            # A deployment keeps the 50 ms default; here a shared machine's stall must not
            # cost a round (the test suite runs this and expects every round answered).
            VLLM_DSPARK_REMOTE_TIMEOUT_MS="1000",
        )
        ok, accepted = engine(env)
        return 0 if ok == STEPS and accepted > STEPS else 1
    finally:
        worker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
