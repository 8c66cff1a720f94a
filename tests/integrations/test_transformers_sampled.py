"""transformers' generate(do_sample=True) with sampled drafts from a loopback worker
(remote_dspark.integrations.transformers): the candidate logits carry each draft's
distribution q, transformers' speculative sampling accepts a draft with probability
min(1, p/q), and the tokens are distributed exactly as the target's own.

The target is a tiny Llama of 64 ids with flat logits; the draft an unrelated one of the
same shape (a deliberately poor draft: it agrees with the target on about half of the
mass). Two new tokens after one prompt: the first round drafts one token, so the first
generated token is the accepted draft or the residual's draw, and the second the bonus
token or the next step after a rejection. Both are compared with the target's exact
distributions by chi-square (p > 1e-4 under fixed seeds: deterministic given the seeds;
an exact sampler fails it with probability 1e-4 over the seeds). The acceptance is
min(p, q)'s mass, many standard errors above token matching's sum p q."""

import numpy as np
import pytest
import torch
from helpers import P_VALUE_MIN, chi2_p, tiny_llama

from remote_dspark.config import RemoteConfig
from remote_dspark.demo.harness import engine_env
from remote_dspark.drafter.lm.hf import load_hf
from remote_dspark.drafter.sampling import TOTAL, top32
from remote_dspark.engine import RemoteDSpark
from remote_dspark.worker import Worker

transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
from remote_dspark.integrations import transformers as integration  # noqa: E402

VOCAB, K, WINDOW = 64, 4, 64
PROMPT = [5, 17, 3, 9, 42, 7]
SAMPLES = 1500
SAMPLING = dict(do_sample=True, temperature=1.0, top_k=40, top_p=0.95)  # as the target samples


def tiny(seed: int, init: float = 0.1):
    """A tiny Llama of VOCAB ids seeded ``seed`` (small weights: flat next-token
    distributions)."""
    return tiny_llama(seed, VOCAB, init=init)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the target, the draft, the draft's directory)."""
    target, draft = tiny(0), tiny(1)
    path = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(path)
    return target, draft, path


def served(model_dir, sampled: bool):
    """A loopback worker drafting from ``model_dir`` and a started sync-mode RemoteDSpark
    on it, with sampled drafts when ``sampled``."""
    drafter = load_hf(str(model_dir), "cpu", WINDOW, cache_slots=4, max_context=256)
    worker = Worker(drafter, "127.0.0.1", 0, window=WINDOW).start()
    variables = {
        "VLLM_DSPARK_REMOTE_ASYNC": "0",
        "VLLM_DSPARK_REMOTE_TIMEOUT_MS": "5000",
        "VLLM_DSPARK_SAMPLED_TOP32": "1" if sampled else "0",
    }
    environ = engine_env(worker.port, drafter.drafter_identity.hex(), drafter.markov_identity.hex(), **variables)
    cfg = RemoteConfig.from_env(environ)
    try:
        rd = RemoteDSpark(cfg, num_spec=K, max_slots=4, row_bytes=0, vocab_size=VOCAB, environ=environ).start()
    except BaseException:
        worker.stop()
        raise
    return worker, rd


def processed(logits: torch.Tensor) -> torch.Tensor:
    """The target's distribution of next tokens under SAMPLING, as transformers
    processes its logits (temperature, then top-k, then top-p), in float64."""
    warpers = transformers.LogitsProcessorList(
        [
            transformers.TemperatureLogitsWarper(SAMPLING["temperature"]),
            transformers.TopKLogitsWarper(SAMPLING["top_k"]),
            transformers.TopPLogitsWarper(SAMPLING["top_p"]),
        ]
    )
    return warpers(None, logits.float()).double().softmax(-1)


@torch.no_grad()
def target_distributions(target) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact distributions of the first and second new token after PROMPT
    under SAMPLING: p1, and p2 = sum over t of p1(t) p(. | PROMPT + t)."""
    p1 = processed(target(torch.tensor([PROMPT])).logits[:, -1])[0]
    both = torch.cat([torch.tensor([PROMPT]).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
    p2 = p1 @ processed(target(both).logits[:, -1])
    return p1.numpy(), p2.numpy()


def chi_square_p(tokens: np.ndarray, p: np.ndarray) -> float:
    """``helpers.chi2_p`` of the ``tokens`` drawn against probabilities ``p``."""
    return chi2_p(np.bincount(tokens, minlength=len(p)), p * len(tokens))


def draws(target, rd, n: int) -> np.ndarray:
    """[n, 2]: the two new tokens of ``n`` sampled generations after PROMPT, seeded."""
    torch.manual_seed(1234)
    prompt = torch.tensor([PROMPT])
    out = [integration.generate(target, prompt, rd, max_new_tokens=2, **SAMPLING)[0, -2:] for _ in range(n)]
    return torch.stack(out).numpy()


def test_sampled_drafts_keep_the_targets_distribution_and_are_accepted_as_min_p_q(models):
    target, draft, path = models
    worker, rd = served(path, sampled=True)
    try:
        tokens = draws(target, rd, SAMPLES)
        s = rd.stats()
    finally:
        rd.close()
        worker.stop()
    p1, p2 = target_distributions(target)
    assert chi_square_p(tokens[:, 0], p1) > P_VALUE_MIN
    assert chi_square_p(tokens[:, 1], p2) > P_VALUE_MIN
    # Each generation is one round of one draft at PROMPT's end, q the draft's top 32.
    assert s.offered_at[0] == SAMPLES and sum(s.offered_at[1:]) == 0
    with torch.no_grad():
        logits = draft(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    ids, weights = top32(logits[None], np.ones(1, np.float32))
    q = np.zeros(VOCAB)
    q[ids[0]] = weights[0] / TOTAL
    q_path, matching = np.minimum(p1, q).sum(), (p1 * q).sum()
    accepted = s.accepted_at[0] / SAMPLES
    se = np.sqrt(q_path * (1 - q_path) / SAMPLES)
    assert abs(accepted - q_path) < 5 * se, (accepted, q_path, se)  # 5 SE: false failure ~6e-7
    assert q_path - matching > 20 * se, (q_path, matching, se)  # the draft is poor, min(p, q) far above p q


def test_a_seeded_sampled_generation_is_reproducible_and_draft_seed_decides_the_drafts(models):
    target, _, path = models
    worker, rd = served(path, sampled=True)
    prompt = torch.tensor([PROMPT])
    try:
        runs = []
        for seed in (7, 7):
            torch.manual_seed(seed)
            runs.append(integration.generate(target, prompt, rd, max_new_tokens=24, do_sample=True))
        assert torch.equal(*runs)
        offered = []
        for _ in range(2):  # the same target randomness, the same draft seed: the same drafts
            before = sum(rd.stats().offered_at)
            torch.manual_seed(3)
            runs.append(integration.generate(target, prompt, rd, max_new_tokens=24, do_sample=True, draft_seed=99))
            offered.append(sum(rd.stats().offered_at) - before)
        assert torch.equal(runs[2], runs[3]) and offered[0] == offered[1] > 0
    finally:
        rd.close()
        worker.stop()


def test_an_unsampled_rd_samples_by_token_matching(models):
    """No distributions from the worker: candidate logits None, a draft kept only when it
    is the token the target samples (greedy drafts on a flat target: rarely)."""
    target, _, path = models
    worker, rd = served(path, sampled=False)
    try:
        torch.manual_seed(5)
        prompt = torch.tensor([PROMPT])
        outs = [integration.generate(target, prompt, rd, max_new_tokens=8, do_sample=True) for _ in range(40)]
        assert all(o.shape == (1, len(PROMPT) + 8) and torch.equal(o[0, : len(PROMPT)], prompt[0]) for o in outs)
        assert len({tuple(o[0].tolist()) for o in outs}) > 30  # sampled, not greedy
        s = rd.stats()
        assert sum(s.offered_at) > 100 and sum(s.accepted_at) / sum(s.offered_at) < 0.2
    finally:
        rd.close()
        worker.stop()


def test_a_sampled_rd_without_sampling_drafts_greedily_and_gives_the_models_own_tokens(tmp_path):
    """The target's own weights as the draft, temperature 0: every greedy draft is the
    target's token, so nearly all are accepted, and the output is model.generate's."""
    target = tiny(0, init=0.5)
    target.save_pretrained(tmp_path)
    worker, rd = served(tmp_path, sampled=True)
    try:
        prompt = torch.tensor([PROMPT])
        got = integration.generate(target, prompt, rd, max_new_tokens=40, do_sample=False)
        assert torch.equal(got, target.generate(prompt, max_new_tokens=40, do_sample=False))
        s = rd.stats()
        assert sum(s.offered_at) > 20 and sum(s.accepted_at) / sum(s.offered_at) >= 0.95
    finally:
        rd.close()
        worker.stop()


def test_candidate_logits_are_log_q_at_the_listed_ids_and_minus_infinity_elsewhere():
    ids = np.stack([np.arange(32), np.arange(63, 31, -1)]).astype(np.int32)
    weights = np.zeros((2, 32), np.uint16)
    weights[0, :3] = (TOTAL - 2, 1, 1)
    weights[1, 0] = TOTAL
    logits = integration.candidate_logits(ids, weights, 70)
    assert logits.shape == (1, 2, 70) and logits.dtype == torch.float32
    q = logits.softmax(-1)[0].double().numpy()
    dense = np.zeros((2, 70))
    np.put_along_axis(dense, ids.astype(np.int64), weights / TOTAL, 1)
    assert np.allclose(q, dense, rtol=1e-6, atol=0)
    assert torch.isneginf(logits[0, 0, 3:]).all() and torch.isneginf(logits[0, 1, :63]).all()
    with pytest.raises(ValueError, match=r"ids: 0\.\.63 outside the target's logits 0\.\.49"):
        integration.candidate_logits(ids, weights, 50)
    with pytest.raises(ValueError, match=r"ids \(2, 31\), weights \(2, 32\): expected \[c, 32\] both"):
        integration.candidate_logits(ids[:, :31], weights, 70)
