"""transformers' assisted generate() with drafts from a loopback worker
(remote_dspark.integrations.transformers): token for token what model.generate() returns,
for a tiny GPT-2 and a tiny Llama (weights spread wide, so no near-tie decides a token),
200 new tokens, past the worker's window. With the target's own weights as the draft
nearly every draft is accepted; with an unrelated draft nearly none, and the output is
the same; a worker stopped mid-generation changes nothing but the speed."""

import threading

import pytest
import torch
from helpers import DraftedWindows, drafter_env, tiny_llama

from remote_dspark.config import RemoteConfig
from remote_dspark.demo.harness import engine_env
from remote_dspark.drafter.lm.hf import load_hf
from remote_dspark.engine import RemoteDSpark
from remote_dspark.worker import Worker

transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
from remote_dspark.integrations import transformers as integration  # noqa: E402

K, WINDOW, NEW = 5, 64, 200
PROMPTS = ([5, 17, 3, 99, 42, 7, 7, 1], [60, 2, 2, 31])


def tiny(kind: str, seed: int):
    """A tiny model of ``kind`` seeded ``seed``, with no end-of-sequence token (every
    generation runs its 200 tokens)."""
    torch.manual_seed(seed)
    no_ends = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=128, n_positions=512, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5, **no_ends
        )
        return transformers.GPT2LMHeadModel(config).eval()
    return tiny_llama(seed, 128, positions=512)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def target(request, tmp_path_factory):
    """(kind, the target model, its directory): the draft of its own weights loads from it."""
    model = tiny(request.param, 0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def served(model_dir, **env):
    """A loopback worker drafting from the model in ``model_dir`` (rows that hold the whole
    generation: the draft sees what the target sees) and a started RemoteDSpark on it, sync
    mode unless ``env`` says otherwise, a deadline no loaded machine misses."""
    drafter = load_hf(str(model_dir), "cpu", WINDOW, cache_slots=4, max_context=256)
    worker = Worker(drafter, "127.0.0.1", 0, window=WINDOW).start()
    variables = {"VLLM_DSPARK_REMOTE_ASYNC": "0", "VLLM_DSPARK_REMOTE_TIMEOUT_MS": "5000", **env}
    environ = engine_env(worker.port, drafter.drafter_identity.hex(), drafter.markov_identity.hex(), **variables)
    cfg = RemoteConfig.from_env(environ)
    try:
        rd = RemoteDSpark(cfg, num_spec=K, max_slots=4, row_bytes=0, vocab_size=128, environ=environ).start()
    except BaseException:
        worker.stop()
        raise
    return worker, rd


def acceptance(rd) -> float:
    s = rd.stats()
    return sum(s.accepted_at) / max(1, sum(s.offered_at))


def plain(model, prompt):
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)


def test_greedy_output_is_the_models_own_and_its_own_weights_draft_nearly_all_of_it(target):
    kind, model, path = target
    worker, rd = served(path)
    try:
        for prompt in PROMPTS:
            got = integration.generate(model, torch.tensor([prompt]), rd, max_new_tokens=NEW, do_sample=False)
            assert torch.equal(got, plain(model, prompt)) and got.shape[1] == len(prompt) + NEW
        assert acceptance(rd) >= 0.95, f"{kind}: {rd.stats()}"
    finally:
        rd.close()
        worker.stop()


def test_an_unrelated_draft_is_rejected_and_the_output_is_unchanged(target, tmp_path):
    kind, model, _ = target
    tiny(kind, 1).save_pretrained(tmp_path)  # other weights, same shape
    worker, rd = served(tmp_path)
    try:
        got = integration.generate(model, torch.tensor([PROMPTS[0]]), rd, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(got, plain(model, PROMPTS[0]))
        assert sum(rd.stats().offered_at) > 100 and acceptance(rd) < 0.3
    finally:
        rd.close()
        worker.stop()


class StopAt(transformers.LogitsProcessor):
    """Stops ``worker`` once the sequence reaches ``length`` tokens; the scores unchanged."""

    def __init__(self, worker, length: int):
        self.worker, self.length = worker, length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.length and self.worker is not None:
            self.worker, worker = None, self.worker
            worker.stop()
        return scores


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_a_worker_stopped_mid_generation_changes_nothing_but_the_speed(target, mode):
    kind, model, path = target
    env = {} if mode == "sync" else {"VLLM_DSPARK_REMOTE_ASYNC": "1", "VLLM_DSPARK_REMOTE_ASYNC_PROXY": "process"}
    worker, rd = served(path, **env)
    try:
        prompt = torch.tensor([PROMPTS[0]])
        stop = transformers.LogitsProcessorList([StopAt(worker, 80)])
        got = integration.generate(model, prompt, rd, max_new_tokens=NEW, do_sample=False, logits_processor=stop)
        assert torch.equal(got, plain(model, PROMPTS[0]))
        s = rd.stats()
        assert s.mode == mode and stop[0].worker is None  # it did stop, mid-way
        assert 0 < sum(s.accepted_at) < NEW - 80  # drafts before, none after
    finally:
        rd.close()
        worker.stop()


def test_concurrent_generations_share_one_remote_drafter_on_slots_of_their_own(target):
    """Two threads, one rd: each output is its model's own, and nearly every draft is
    accepted (two generations on one slot would draft from each other's tokens)."""
    kind, model, path = target
    worker, rd = served(path)
    got, errors = {}, []

    def run(i):
        try:
            got[i] = integration.generate(model, torch.tensor([PROMPTS[i]]), rd, max_new_tokens=NEW, do_sample=False)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        for i, prompt in enumerate(PROMPTS):
            assert torch.equal(got[i], plain(model, prompt))
        assert acceptance(rd) >= 0.95
        assert len(integration.slots_of(rd)._free) == 4  # both slots given back
    finally:
        rd.close()
        worker.stop()


def test_a_generation_ended_mid_announcement_lets_its_slot_go():
    """A worker taking 16 tokens a round: a 40-token prompt takes three rounds to
    announce, and a generation of 3 new tokens ends after two. Its slot is released (no
    slot still announcing), and the next generation, on that slot, is announced NEW_GEN
    and first drafted from its whole context; each output is the model's own."""
    model = tiny("gpt2", 0)
    rec = DraftedWindows()
    worker = Worker(rec, "127.0.0.1", 0, max_round_tokens=16).start()
    try:
        environ = drafter_env(rec, worker.port, VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000")
        rd = RemoteDSpark(RemoteConfig.from_env(environ), num_spec=K, max_slots=4, row_bytes=0, environ=environ)
        with rd:
            long_prompt = [(7 * i + 3) % 128 for i in range(40)]
            got = integration.generate(model, torch.tensor([long_prompt]), rd, max_new_tokens=3, do_sample=False)
            assert torch.equal(got, model.generate(torch.tensor([long_prompt]), max_new_tokens=3, do_sample=False))
            assert rd.stats().announce.chunks >= 2 and rd.stats().announce.announcing == 0  # let go
            assert rec.drafted == []  # never whole: no drafts
            got = integration.generate(model, torch.tensor([PROMPTS[0]]), rd, max_new_tokens=5, do_sample=False)
            assert torch.equal(got, model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=False))
            assert rec.drafted[0] == (0, PROMPTS[0])  # the same slot, its whole context first
    finally:
        worker.stop()


def test_what_generate_cannot_take_is_refused_naming_it(target, monkeypatch):
    _, model, path = target
    worker, rd = served(path)
    try:
        with pytest.raises(RuntimeError, match=r"assistant_model=\.\.\.\): the drafts come from rd"):
            integration.generate(model, torch.tensor([[1, 2]]), rd, assistant_model=model)
        with pytest.raises(RuntimeError, match=r"input_ids of shape \(2, 2\): assisted generation takes \[1, n\]"):
            integration.generate(model, torch.tensor([[1, 2], [3, 4]]), rd)
        monkeypatch.setattr(integration, "MISSING", "GenerationMixin._assisted_decoding")
        with pytest.raises(RuntimeError, match=r"needs GenerationMixin._assisted_decoding, .* \(tested with"):
            integration.generate(model, torch.tensor([[1, 2]]), rd)
    finally:
        rd.close()
        worker.stop()
