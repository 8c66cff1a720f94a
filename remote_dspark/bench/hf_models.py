"""transformers models for the benchmarks: a directory of the operator's (``--hf-model
DIR``) or a randomly initialised one of a named shape (``--hf-random KIND:LAYERSxWIDTH``),
saved with ``save_pretrained`` into a private temporary directory, loaded through the
worker's own loader (:func:`remote_dspark.drafter.lm.hf.load_hf`) and removed at the end.

Shapes (random weights, seeded):

``gpt2:LxW``   GPT-2: learned positions, 2048 of them (or ``positions``), vocabulary
               50257, W/64 heads;
``llama:LxW``  Llama: rotary positions, 2048 of them (or ``positions``), vocabulary 32000,
               W/64 heads and a quarter as many KV heads (grouped), an MLP of 8/3 W.

``gpt2:12x768`` is GPT-2 small's shape. :func:`random_pair` saves a random target and a
draft of its first layers (``bench generate``); :class:`Forwards` counts a model's calls.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator

KINDS = ("gpt2", "llama")
_SPEC = re.compile(r"(?P<kind>[a-z0-9]+):(?P<layers>\d+)x(?P<width>\d+)")


def parse_random(spec: str) -> tuple[str, int, int]:
    """``KIND:LAYERSxWIDTH`` -> (kind, layers, width).

    Raises: ValueError naming ``--hf-random`` and what is wrong."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"--hf-random {spec!r}: expected KIND:LAYERSxWIDTH, e.g. gpt2:12x768 (kinds: {KINDS})")
    kind, layers, width = m["kind"], int(m["layers"]), int(m["width"])
    if kind not in KINDS:
        raise ValueError(f"--hf-random {spec!r}: unknown kind {kind!r}; choose one of {KINDS}")
    if not 1 <= layers <= 64 or not 64 <= width <= 8192 or width % 64:
        raise ValueError(f"--hf-random {spec!r}: layers 1..64 and a width of 64..8192, a multiple of 64")
    return kind, layers, width


POSITIONS = 2048  # a random model's positions unless told


def random_model(kind: str, layers: int, width: int, seed: int = 0, positions: int = POSITIONS):
    """A randomly initialised causal LM of the shape (module docstring), float32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    heads = width // 64
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=positions,
    )
    return transformers.LlamaForCausalLM(config)


@contextlib.contextmanager
def model_dir(hf_model: str | None, hf_random: str | None, positions: int = POSITIONS) -> Iterator[tuple[str, str]]:
    """(directory, name) of the model the flags name: ``hf_model`` as given, or a random
    one of ``positions`` positions saved into a private temporary directory for the
    ``with`` block."""
    if hf_model is not None:
        yield hf_model, hf_model.rstrip("/").rsplit("/", 1)[-1]
        return
    kind, layers, width = parse_random(hf_random)
    path = tempfile.mkdtemp(prefix="remote-dspark-bench-model-")  # mode 0700: this user's
    try:
        random_model(kind, layers, width, positions=positions).save_pretrained(path)
        yield path, hf_random
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def random_pair(spec: str, draft_layers: int):
    """(target directory, draft directory, name) of a random target of ``spec``'s shape and
    a draft of its first ``draft_layers`` layers (its embeddings, final norm and head
    too; all of them: the target's own directory), saved into private temporary
    directories for the ``with`` block."""
    kind, layers, width = parse_random(spec)
    if draft_layers > layers:
        raise ValueError(f"--draft-layers {draft_layers}: the target {spec} has {layers} layers; keep as many or fewer")
    target = random_model(kind, layers, width)
    if draft_layers == layers:  # the draft is the target itself
        path = tempfile.mkdtemp(prefix="remote-dspark-bench-model-")
        try:
            target.save_pretrained(path)
            yield path, path, f"{spec} / the target itself"
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return
    draft = random_model(kind, draft_layers, width)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)  # the other layers: unexpected keys
    assert not missing, missing
    paths = [tempfile.mkdtemp(prefix="remote-dspark-bench-model-") for _ in range(2)]  # mode 0700
    try:
        target.save_pretrained(paths[0])
        draft.save_pretrained(paths[1])
        yield paths[0], paths[1], f"{spec} / {draft_layers} layers"
    finally:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


class Forwards:
    """Counts a model's forward calls (a forward hook, until :meth:`remove`)."""

    def __init__(self, model):
        self.calls = 0
        self._hook = model.register_forward_hook(self._count)

    def _count(self, *args) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._hook.remove()
