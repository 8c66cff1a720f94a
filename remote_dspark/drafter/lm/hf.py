"""transformers causal LMs as drafters (``remote-dspark worker --hf-model DIR``).

:func:`load_hf` loads a model saved with ``save_pretrained`` from a local directory,
``local_files_only`` (never the network) and without ``trust_remote_code`` (only the
architectures transformers itself ships). transformers is the optional ``hf`` extra,
imported only here.

The drafter itself, its rounds and its cache, is :mod:`remote_dspark.drafter.lm.hf_rounds`.

Identities: the drafter identity is the sha256 of ``config.json`` and the weight files
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth`` and their index files) in name order,
each as its name, size and bytes; the Markov identity is zeros. The vocabulary size the
worker compares at HELLO is ``config.vocab_size``; its position table (``max_positions``)
is ``config.max_position_embeddings`` (None where the config has none).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ...trust import untrusted_because
from .drafter import pick_device
from .hf_rounds import HFDrafter

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


def load_hf(
    model_dir: str,
    device: str | torch.device | None = None,
    window: int = 64,
    cache_slots: int = 1024,
    row_tokens: int | None = None,
) -> HFDrafter:
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
    return HFDrafter(
        model.to(dev, dtype).eval(),
        vocab_size=int(config.vocab_size),
        identity=dir_identity(path),
        device=dev,
        window=window,
        max_positions=positions,
        cache_slots=cache_slots,
        max_tokens=row_tokens,
    )
