"""transformers causal LMs as drafters (``remote-dspark worker --hf-model DIR``).

:func:`load_hf` loads a model saved with ``save_pretrained`` from a local directory,
``local_files_only`` (never the network) and without ``trust_remote_code`` (only the
architectures transformers itself ships). transformers is the optional ``hf`` extra,
imported only here.

A round re-encodes every entry's window: one left-padded batch with its
``attention_mask`` and ``position_ids`` (each context at its true positions,
``DraftBatch.positions``; padding at the context's first position, masked out), then
``width - 1`` greedy steps on the model's own KV cache (``past_key_values``; ``cache``
in transformers 5), one forward over all entries per step. Nothing is kept across
rounds: a cache per slot for any architecture (its cache classes, rotary or learned
positions, sliding windows) is out of scope here; the built-in model's drafter
(:mod:`remote_dspark.drafter.lm.drafter`) keeps one.

Identities: the drafter identity is the sha256 of ``config.json`` and the weight files
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth`` and their index files) in name order,
each as its name, size and bytes; the Markov identity is zeros. The vocabulary size the
worker compares at HELLO is ``config.vocab_size``; its position table (``max_positions``)
is ``config.max_position_embeddings`` (None where the config has none).
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from pathlib import Path

import numpy as np
import torch

from ...trust import untrusted_because
from ..contract import DraftBatch, DraftResult, empty_result
from .drafter import MARKOV_NONE, greedy_result, pick_device, top2

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def model_files(path: Path) -> list[str]:
    """``config.json`` and the weight files of ``path``, sorted: what is loaded and hashed."""
    return sorted(
        p.name for p in path.iterdir() if p.is_file() and (p.name == "config.json" or p.name.endswith(_WEIGHTS))
    )


def dir_identity(path: Path) -> bytes:
    """sha256 of ``config.json`` and the weight files of ``path`` (module docstring)."""
    h = hashlib.sha256(b"remote-dspark hf drafter v1\0")
    for name in model_files(path):
        f = path / name
        h.update(f"\0{name}:{f.stat().st_size}\0".encode())
        with open(f, "rb") as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
    return h.digest()


def load_hf(model_dir: str, device: str | torch.device | None = None, window: int = 64) -> HFDrafter:
    """The drafter of the transformers causal LM saved in ``model_dir``, for contexts of
    ``window`` tokens: its ``max_width`` is what the model's positions leave past a window
    (the worker refuses a HELLO whose num_spec is wider).

    Raises:
        ValueError: ``model_dir`` is not a local directory, transformers cannot load it,
            or its positions cannot hold a window and a draft.
        ImportError: transformers is not installed (the ``hf`` extra).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(
            f"--hf-model {model_dir!r}: not a local directory (a model is never downloaded; "
            "save it with save_pretrained first)"
        )
    files = model_files(path)
    if "config.json" not in files:
        raise ValueError(f"--hf-model {model_dir!r}: no config.json (save the model with save_pretrained)")
    # A weight file may be a pickle: the files are held to the rule for loaded code (trust).
    for name in files:
        why = untrusted_because(str(path / name))
        if why is not None:
            raise ValueError(f"--hf-model {model_dir!r}: not loaded: {why}")
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"--hf-model needs transformers ({e}): pip install remote-dspark[hf]") from e
    dev = pick_device(device)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--hf-model {model_dir!r}: {e}") from e
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and window + 1 > positions:
        raise ValueError(
            f"--hf-model {model_dir!r}: the model has {positions} positions, fewer than a window of "
            f"{window} (--window) and one draft"
        )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    drafter = HFDrafter(model.to(dev, dtype).eval(), int(config.vocab_size), dir_identity(path), dev)
    drafter.max_width = positions - window if positions is not None else None
    drafter.max_positions = positions
    return drafter


class HFDrafter:
    """Greedy drafting from a transformers causal LM, every window re-encoded per round.

    Args: the loaded model (on ``device``), its vocabulary size, its drafter identity.
    """

    def __init__(self, model, vocab_size: int, identity: bytes, device: torch.device):
        self.model, self.device = model, device
        self.vocab_size = vocab_size
        self.drafter_identity = identity
        self.markov_identity = MARKOV_NONE
        self.max_width: int | None = None  # drafts per entry the positions leave (load_hf sets it)
        self.max_positions: int | None = None  # the model's position table (load_hf sets it)
        self._lock = threading.Lock()  # the worker's connection threads share one drafter
        # The KV cache's argument and output name: ``cache`` in transformers 5, before it
        # ``past_key_values`` (probed, not version-checked).
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        """Raises: ValueError for an entry past the position table (the worker drops
        those: :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`)."""
        n, width = len(batch), batch.width
        if n == 0 or width == 0:
            return empty_result(n, width, batch.want_margin)
        if batch.beyond(self.max_positions).any():
            raise ValueError(f"an entry's context and {width} drafts pass the model's {self.max_positions} positions")
        ctx_lens = np.diff(batch.offsets).astype(np.int64)
        take = np.maximum(ctx_lens, 1)  # an empty context: one dummy token, no drafts
        s = int(take.max())
        cols = np.arange(s)
        valid = cols >= (s - take)[:, None]  # left padding
        src = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        idx = np.clip(batch.offsets[1:, None] - s + cols, 0, len(src) - 1)
        tok = np.where(valid, src[idx], 0)
        ints = torch.from_numpy(np.stack([tok, valid]).astype(np.int64)).to(self.device)  # the one copy in
        ids, mask = ints[0], ints[1]
        first = torch.from_numpy(np.where(ctx_lens > 0, batch.starts(), 0)).to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0) + first[:, None]  # padding: the first position
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            token, margin = top2(out.logits[:, -1, : self.vocab_size])
            tokens, margins = [token], [margin]
            last = pos[:, -1:]
            for _ in range(1, width):  # one batched forward per draft step
                last = last + 1
                mask = torch.cat([mask, torch.ones_like(last)], 1)
                out = self.model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=last,
                    use_cache=True,
                    **{self._cache_arg: getattr(out, self._cache_arg)},
                )
                token, margin = top2(out.logits[:, -1, : self.vocab_size])
                tokens.append(token)
                margins.append(margin)
            res = torch.cat([torch.stack(tokens, 1).float(), torch.stack(margins, 1)], 1).cpu().numpy()
        return greedy_result(batch, ctx_lens, res[:, :width], res[:, width:])
