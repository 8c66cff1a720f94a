"""Speculative sampling through the whole remote path is lossless: an engine with
``VLLM_DSPARK_SAMPLED_TOP32=1`` against a loopback worker whose drafter samples, the
engine's ``rejection_sample`` over the target's distributions and the drafts' q, and the
tokens it emits are distributed exactly as the target's own samples (chi-square over
thousands of seeded samples), the first and the second generated token both (the second
after a round's acceptance or rejection, and, when only one token came, after a next
round at the true position). The draft is deliberately poor (the built-in Markov model
against a random bigram target over 128 tokens, so the top-32 truncation matters), and
the acceptance is the q path's ``sum min(p, q)``, far above the ``sum p q`` that
token matching would give with the same drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import P_VALUE_MIN, chi2_p, drafter_env

from remote_dspark.config import RemoteConfig
from remote_dspark.config.mode import Mode
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import SyntheticLanguage, builtin_model
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.engine.sampler import Q_SCALE, rejection_sample
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

VOCAB, K, SLOTS, BATCHES = 128, 4, 256, 16  # 4096 samples per test
CONTEXT = SyntheticLanguage().text(12, seed=5)  # every entry's prompt: the Markov model knows it


@pytest.fixture(scope="module")
def worker():
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, window=64).start()
    yield w
    w.stop()


def target(seed: int = 3) -> torch.Tensor:
    """A bigram target [V, V] (row x: the next token's distribution after x), unlike the
    Markov model: random logits, a quarter of each row impossible."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64) * 1.5
    logits[torch.rand(VOCAB, VOCAB, generator=gen) < 0.25] = -torch.inf
    return torch.softmax(logits, dim=1).float()


def engine(worker, mode: Mode) -> RemoteDSpark:
    env = drafter_env(
        worker.drafter, worker.port, mode, VLLM_DSPARK_SAMPLED_TOP32="1", VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000"
    )
    rd = RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=K, max_slots=SLOTS, row_bytes=0)
    return rd  # started by its with


def verify(P: torch.Tensor, last: torch.Tensor, d, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's step: the target's p after each entry's last token and after each of
    its drafts, then ``rejection_sample`` -> (tokens [n, K + 1], emitted [n])."""
    prev = torch.cat((last.unsqueeze(1), d.tokens.long()), dim=1)  # the token before each position
    return rejection_sample(P[prev], d.tokens, d.counts, d.q_ids, d.q_weights, generator=gen)


def two_tokens(rd: RemoteDSpark, P: torch.Tensor, temperature: np.ndarray, batch_seed: int):
    """One prompt per slot, every slot its own seed: (first token [n], second token [n],
    first round's drafts). Slots given one token by the first round get their second from
    a next round, which sends that token at its true position."""
    n = SLOTS
    gen = torch.Generator().manual_seed(batch_seed)
    seeds = np.arange(n, dtype=np.uint64) + np.uint64(batch_seed * n) + np.uint64(2**63)  # past int64's range
    slots = np.arange(n)
    first = rd.round(Batch.from_lists(slots, [CONTEXT] * n, [0] * n, [True] * n, temperature=temperature, seed=seeds))
    assert first.outcome is Outcome.OK and first.source == "remote"
    tokens, emitted = verify(P, torch.full((n,), CONTEXT[-1]), first, gen)
    accepted = [tokens[i, : emitted[i]].tolist() for i in range(n)]
    nxt = rd.round(
        Batch.from_lists(slots, accepted, [len(CONTEXT)] * n, [False] * n, temperature=temperature, seed=seeds)
    )
    assert nxt.outcome is Outcome.OK and not nxt.resync
    more, _ = verify(P, tokens[torch.arange(n), emitted - 1], nxt, gen)
    second = torch.where(emitted >= 2, tokens[:, 1], more[:, 0])
    return tokens[:, 0], second, first


@pytest.mark.parametrize("mode", [Mode.SYNC])
def test_the_tokens_emitted_through_the_remote_sampled_path_follow_the_target(worker, mode):
    P = target()
    temperature = np.where(np.arange(SLOTS) % 4 == 0, 0.0, 1.0)  # a quarter greedy: one-hot q, exact too
    firsts, seconds = [], []
    with engine(worker, mode) as rd:
        for b in range(BATCHES):
            f, s, _ = two_tokens(rd, P, temperature, b)
            firsts.append(f)
            seconds.append(s)
    firsts, seconds = torch.cat(firsts), torch.cat(seconds)
    n = len(firsts)
    p_first = P[CONTEXT[-1]].double()
    p_second = p_first @ P.double()  # the marginal of the token after the first
    observed = [torch.bincount(x, minlength=VOCAB).numpy() for x in (firsts, seconds)]
    p1, p2 = chi2_p(observed[0], n * p_first.numpy()), chi2_p(observed[1], n * p_second.numpy())
    assert p1 > P_VALUE_MIN and p2 > P_VALUE_MIN, (p1, p2)


def test_the_q_path_is_taken_acceptance_is_sum_min_p_q_not_token_matching(worker):
    """Every entry's first draft has the same q (one prompt, one temperature), and the
    target after the prompt is made near it (70 % q, 30 % the random bigram), so under
    the rule a first draft is accepted with probability ``sum_x min(p(x), q(x))``; token
    matching (no q: accept when the target's own sample equals the draft) would accept
    with ``sum_x p(x) q(x)``, far less for a q spread over many tokens."""
    temperature, rounds = np.full(SLOTS, 2.0), 4

    def round_of(rd, b):
        seeds = np.arange(SLOTS, dtype=np.uint64) + np.uint64(b * SLOTS)
        d = rd.round(
            Batch.from_lists(
                np.arange(SLOTS), [CONTEXT] * SLOTS, [0] * SLOTS, [True] * SLOTS, temperature=temperature, seed=seeds
            )
        )
        assert d.outcome is Outcome.OK and (d.counts == K).all()
        return d

    P = target()
    accepted = 0
    with engine(worker, Mode.SYNC) as rd:
        d = round_of(rd, 0)
        assert (d.q_ids[:, 0] == d.q_ids[0, 0]).all() and (d.q_weights[:, 0] == d.q_weights[0, 0]).all()
        q = torch.zeros(VOCAB, dtype=torch.float64)
        q[d.q_ids[0, 0].long()] = d.q_weights[0, 0].double() / Q_SCALE
        p = 0.7 * q + 0.3 * P[CONTEXT[-1]].double()
        P[CONTEXT[-1]] = p.float()
        for b in range(1, rounds + 1):
            _, emitted = verify(P, torch.full((SLOTS,), CONTEXT[-1]), round_of(rd, b), torch.Generator().manual_seed(b))
            accepted += int((emitted > 1).sum())
    by_rule, by_matching = float(torch.minimum(p, q).sum()), float((p * q).sum())
    trials = rounds * SLOTS
    rate = accepted / trials
    se = (by_rule * (1 - by_rule) / trials) ** 0.5
    assert abs(rate - by_rule) < 5 * se, (rate, by_rule, se)
    assert by_rule - by_matching > 10 * se, (by_rule, by_matching, se)
