"""Model drafters for the worker: torch, imported only when one is asked for.

* :func:`builtin_drafter` (``remote-dspark worker --drafter lm``): the tiny built-in
  transformer (:mod:`.model`) behind the batched drafter with its per-stream KV cache
  (:mod:`.drafter`, :mod:`.cache`);
* :func:`hf_drafter` (``--hf-model DIR``): a transformers causal LM from a local
  directory (:mod:`.hf`, driven as the built-in model by :mod:`.hf_model`; the ``hf`` extra).

Their round: static buffers and CUDA graphs (:mod:`.graphs`), attention over the KV
store's rows in place (:mod:`.attention`, its Triton kernels in :mod:`._kernels`), a
call's memory budget (:mod:`.budget`) and sampled drafts in torch (:mod:`.sampling`).

``import remote_dspark`` and the Markov worker never import this package: the worker
(:func:`remote_dspark.worker.drafters.load_drafter`) imports it for these drafters only.
"""

from __future__ import annotations


def builtin_drafter(
    device: str | None = None, cache_slots: int = 1024, window: int = 64, row_tokens: int | None = None
):
    """The built-in model's :class:`~remote_dspark.drafter.lm.drafter.LMDrafter`."""
    from .drafter import LMDrafter

    return LMDrafter(device=device, cache_slots=cache_slots, window=window, max_tokens=row_tokens)


def hf_drafter(
    model_dir: str,
    device: str | None = None,
    cache_slots: int = 1024,
    window: int = 64,
    row_tokens: int | None = None,
):
    """The drafter of the transformers model in ``model_dir`` (:func:`~remote_dspark.drafter.lm.hf.load_hf`)."""
    from .hf import load_hf

    return load_hf(model_dir, device, window, cache_slots, row_tokens)
