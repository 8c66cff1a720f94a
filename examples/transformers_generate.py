"""transformers' assisted generate() with drafts from a remote worker, runnable as it is:

    python examples/transformers_generate.py        # starts its own loopback worker

A tiny GPT-2 is saved into a temporary directory and served by a worker as the draft (the
target's own weights here: nearly every draft is accepted); the target generates 120
tokens through `remote_dspark.integrations.transformers.generate`, and the output is
checked against the target's own `generate()`. docs/integration.md explains it;
tests/integrations/test_examples.py runs it.
"""

import os
import tempfile

import torch
import transformers

from remote_dspark.config import RemoteConfig
from remote_dspark.drafter.lm.hf import load_hf
from remote_dspark.engine import RemoteDSpark
from remote_dspark.integrations.transformers import generate
from remote_dspark.worker import Worker

K, NEW = 5, 120


def main() -> int:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=512, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5, eos_token_id=None
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        # The remote drafter: `remote-dspark worker --hf-model DIR` on another machine in a
        # deployment; here a loopback worker whose rows hold the whole generation.
        drafter = load_hf(model_dir, "cpu", window=64, cache_slots=4, max_context=256)
        with Worker(drafter, "127.0.0.1", 0) as worker:
            env = dict(
                os.environ,
                VLLM_DSPARK_REMOTE=f"tcp://127.0.0.1:{worker.port}",
                VLLM_DSPARK_REMOTE_IDENTITY=drafter.drafter_identity.hex(),
                VLLM_DSPARK_REMOTE_MARKOV_IDENTITY=drafter.markov_identity.hex(),
                VLLM_DSPARK_REMOTE_POLICY="capacity",
                VLLM_DSPARK_REMOTE_TIMEOUT_MS="2000",  # generous: a CPU test machine may be busy
                VLLM_DSPARK_REMOTE_STATS_FILE="",
                VLLM_DSPARK_REMOTE_LOG_EVERY="0",
            )
            rd = RemoteDSpark(
                RemoteConfig.from_env(env), num_spec=K, max_slots=4, row_bytes=0, vocab_size=128, environ=env
            ).start()
            try:
                prompt = torch.tensor([[5, 17, 3, 99, 42, 7]])
                out = generate(model, prompt, rd, max_new_tokens=NEW, do_sample=False)
                same = torch.equal(out, model.generate(prompt, max_new_tokens=NEW, do_sample=False))
                st = rd.stats()
                accepted, offered = sum(st.accepted_at), sum(st.offered_at)
                print(f"{NEW} tokens, identical to generate(): {same}, {accepted}/{offered} drafts accepted")
                return 0 if same and accepted >= 0.9 * offered else 1
            finally:
                rd.close()


if __name__ == "__main__":
    raise SystemExit(main())
