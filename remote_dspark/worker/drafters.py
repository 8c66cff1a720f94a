"""The drafter a worker serves, built from its flags: ``--drafter markov|lm|MODULE:FACTORY``,
``--markov FILE``, ``--hf-model DIR``, ``--lm-device``, ``--lm-cache-slots``, ``--max-context``, ``--lm-speculate``.

``MODULE`` is the operator's own code, imported by name from ``sys.path``; nothing is
evaluated from the spec itself.
"""

from __future__ import annotations

import importlib

from .. import wire
from ..drafter.contract import BatchedDrafter, as_batched, vocab_size_of
from ..drafter.markov import MarkovDrafter, MarkovModel, builtin_model

# Drafters built in by name (``--drafter NAME``). The model drafters import torch, so
# their package is imported only when one is asked for: the Markov worker stays torch-free.
MARKOV, LM = "markov", "lm"
DEFAULT_MAX_CONTEXT = 8192  # --max-context: a model drafter's tokens a stream (the worker keeps as many)
MAX_SPECULATE = 64  # --lm-speculate: outcomes pre-drafted a stream at most


def load_drafter(
    spec: str | None,
    markov_path: str | None = None,
    identity: bytes | None = None,
    *,
    hf_model: str | None = None,
    lm_device: str | None = None,
    lm_cache_slots: int = 1024,
    lm_kv_mb: int | None = None,
    window: int = 64,
    max_context: int = DEFAULT_MAX_CONTEXT,
    lm_speculate: int = 0,
) -> BatchedDrafter:
    """The drafter ``--drafter`` names: ``markov`` (the default: the ``--markov`` file,
    else the built-in model), ``lm`` (the built-in torch model, :mod:`remote_dspark.drafter.lm`,
    on ``lm_device`` with ``lm_cache_slots`` cached streams of ``max_context`` tokens at
    most in a KV pool of ``lm_kv_mb`` MiB, None: the default share of the free memory,
    pre-drafting ``lm_speculate`` outcomes a stream in idle time, 0: none),
    or ``MODULE:FACTORY`` (``FACTORY()`` returns a batched or a per-entry drafter);
    ``hf_model`` (``--hf-model DIR``) is a transformers model from that local directory.
    Batched either way (:func:`as_batched`). ``identity`` replaces the drafter identity of
    the Markov and model drafters.

    ``MODULE`` is imported by name with :func:`importlib.import_module` (the operator's
    own code on ``sys.path``; nothing is evaluated from the spec itself).

    Raises: ValueError naming the spec, flag or file that could not be used.
    """
    if hf_model is not None or spec == LM:
        if hf_model is not None and spec not in (None, LM):
            raise ValueError(f"--hf-model {hf_model!r} with --drafter {spec!r}: give one of them")
        if markov_path:
            raise ValueError(f"--markov {markov_path!r}: only for the Markov drafter")
        drafter = _model_drafter(hf_model, lm_device, lm_cache_slots, lm_kv_mb, window, max_context, lm_speculate)
        if identity is not None:
            drafter.drafter_identity = identity
        return drafter
    if spec and spec != MARKOV:
        mod_name, sep, attr = spec.partition(":")
        if not sep or not mod_name or not attr:
            raise ValueError(f"--drafter {spec!r}: expected {MARKOV}, {LM} or MODULE:FACTORY")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--drafter {spec!r}: {e}") from e
        if not callable(factory):
            raise ValueError(f"--drafter {spec!r}: {attr} is not callable")
        drafter = factory()
        for name in ("drafter_identity", "markov_identity"):
            value = getattr(drafter, name, None)
            if not isinstance(value, bytes) or len(value) != 32:
                raise ValueError(f"--drafter {spec!r}: {name} must be 32 bytes, got {value!r}")
        try:
            vocab_size_of(drafter)
            return as_batched(drafter)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--drafter {spec!r}: {e}") from e
    try:
        model = MarkovModel.load(markov_path) if markov_path else builtin_model()
    except OSError as e:
        raise ValueError(f"--markov {markov_path!r}: {e}") from e
    return MarkovDrafter(model, identity)


def _model_drafter(
    hf_model: str | None,
    device: str | None,
    cache_slots: int,
    kv_mb: int | None,
    window: int,
    max_context: int,
    speculate: int = 0,
) -> BatchedDrafter:
    """The built-in LM drafter, or the transformers one of ``hf_model``.

    Raises: ValueError naming the flag (torch missing, a bad device or cache size)."""
    if not 1 <= max_context <= wire.MAX_CONTEXT:
        raise ValueError(f"--max-context {max_context}: not in 1..{wire.MAX_CONTEXT}")
    if cache_slots < 0:
        raise ValueError(f"--lm-cache-slots {cache_slots}: must be >= 0 (0: no cache)")
    if not 0 <= speculate <= MAX_SPECULATE:
        raise ValueError(f"--lm-speculate {speculate}: not in 0..{MAX_SPECULATE}")
    if speculate and not cache_slots:
        raise ValueError(f"--lm-speculate {speculate}: pre-drafts fork cached streams (--lm-cache-slots is 0)")
    if kv_mb is not None and kv_mb < 1:
        raise ValueError(f"--lm-kv-mb {kv_mb}: must be >= 1")
    if device not in (None, "auto", "cpu", "cuda"):
        raise ValueError(f"--lm-device {device!r}: expected auto, cpu or cuda")
    flag = f"--hf-model {hf_model!r}" if hf_model is not None else f"--drafter {LM}"
    try:
        from ..drafter import lm
    except ImportError as e:
        raise ValueError(f"{flag}: {e} (pip install remote-dspark[lm])") from e
    try:
        kv_bytes = None if kv_mb is None else kv_mb << 20
        if hf_model is not None:
            return lm.hf_drafter(hf_model, device, cache_slots, window, max_context, kv_bytes, speculate)
        return lm.builtin_drafter(device, cache_slots, window, max_context, kv_bytes, speculate)
    except (ImportError, ValueError) as e:
        why = str(e).removeprefix(f"{flag}: ")  # the loader's own messages name the flag already
        raise ValueError(f"{flag} (--lm-device {device or 'auto'}): {why}") from e
