"""Model drafters for the worker: torch, imported only when one is asked for.

* :func:`builtin_drafter` (``remote-dspark worker --drafter lm``): the tiny built-in
  transformer (:mod:`.model`) behind the batched drafter with its streams' KV in a
  paged pool (:mod:`.drafter`, :mod:`.cache`, :mod:`.pool`);
* :func:`hf_drafter` (``--hf-model DIR``): a transformers causal LM from a local
  directory (:mod:`.hf`, driven as the built-in model by :mod:`.hf_model`; the ``hf`` extra).

Their round: its arrays on the host (:mod:`.arrays`), static buffers and CUDA graphs
(:mod:`.graphs`), attention over the KV
pool's blocks in place (:mod:`.attention`, its Triton kernels in :mod:`._kernels`), a
call's memory budget (:mod:`.budget`) and sampled drafts in torch (:mod:`.sampling`).

``import remote_dspark`` and the Markov worker never import this package: the worker
(:func:`remote_dspark.worker.drafters.load_drafter`) imports it for these drafters only.
"""

from __future__ import annotations


def builtin_drafter(
    device: str | None = None,
    cache_slots: int = 1024,
    window: int = 64,
    max_context: int | None = None,
    kv_bytes: int | None = None,
    speculate: int = 0,
):
    """The built-in model's :class:`~remote_dspark.drafter.lm.drafter.LMDrafter`."""
    from .drafter import LMDrafter

    return LMDrafter(
        device=device,
        cache_slots=cache_slots,
        window=window,
        max_context=max_context,
        kv_bytes=kv_bytes,
        speculate=speculate,
    )


def hf_drafter(
    model_dir: str,
    device: str | None = None,
    cache_slots: int = 1024,
    window: int = 64,
    max_context: int | None = None,
    kv_bytes: int | None = None,
    speculate: int = 0,
):
    """The drafter of the transformers model in ``model_dir`` (:func:`~remote_dspark.drafter.lm.hf.load_hf`)."""
    from .hf import load_hf

    return load_hf(model_dir, device, window, cache_slots, max_context, kv_bytes, speculate)
