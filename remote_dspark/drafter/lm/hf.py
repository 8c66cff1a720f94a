"""transformers causal LMs as drafters (``remote-dspark worker --hf-model DIR``).

:func:`load_hf` loads a model saved with ``save_pretrained`` from a local directory
(never the network) and without ``trust_remote_code`` (only the architectures
transformers itself ships). transformers is the optional ``hf`` extra, imported only here.

What is opened is decided here, not by transformers (:func:`model_files`):
``config.json`` and the safetensors weights, ``model.safetensors`` or
``model.safetensors.index.json`` and every shard it names. Each is a plain name in DIR,
a regular file (not a link) held to the rule for loaded code (:mod:`remote_dspark.trust`);
an index naming anything else (an absolute path, ``..``, a sub-folder, a link out of
DIR, a missing file) is refused. Pickled weights (``*.bin``, ``*.pt``, ``*.pth``) are
never loaded: unpickling is running code, and safetensors is plain bytes behind a
header its reader checks against the file. transformers gets the config and the
tensors, not the directory (``from_pretrained(None, state_dict=...)``), so it opens no
file of its own (no generation config, adapter, custom code or index) and loads no
kernel from the Hub (``use_kernels=False``; a config naming a Hub kernel for its
attention or experts, or a quantization, is refused).

The model is driven as the built-in one is (:mod:`remote_dspark.drafter.lm.hf_model`): the
same drafter, its cache per stream and its CUDA graphs.

Before a weight is read the model's size is known: built on the meta device (shapes, no
storage; at most :data:`MAX_MODULES` modules), its parameters and buffers in the dtype
it runs in (bfloat16 on CUDA, float32 on the CPU) plus the checkpoint's bytes must fit
in the host's available memory (``MemAvailable``: both are in host memory while
loading), and on CUDA the model in the GPU's free memory. Every failure is a
``ValueError`` naming ``--hf-model``.

Identities: the drafter identity is the sha256 of the files loaded, in name order, each
as its name, size and bytes; the Markov identity is zeros. The vocabulary size the
worker compares at HELLO is ``config.vocab_size``; its position table (``max_positions``)
is ``config.max_position_embeddings`` (None where the config has none).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from pathlib import Path

import torch

from ...trust import untrusted_because
from .drafter import LMDrafter, pick_device
from .hf_model import HFModel, sliding_window_refusal
from .pool import memory_free, stream_columns

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_JSON_BYTES = 64 << 20  # a config or an index: a 90,000-tensor index is about 9 MB
# Modules the meta build may register (each ~5 KiB of Python objects): twenty times Llama
# 3.1 405B's 1,650, so a config of a million layers is refused before it is built (160 MiB).
MAX_MODULES = 1 << 15
# Keys whose value transformers may take for a kernel repository on the Hub ("org/name").
_KERNEL_KEYS = ("attn_implementation", "experts_implementation")


def model_files(path: Path) -> list[str]:
    """The names of the files of ``path`` that are loaded and hashed, sorted: ``config.json``
    and :func:`weight_files`, each checked (module docstring).

    Raises:
        ValueError: no config or no safetensors weights, a file untrusted, missing, a link,
            or not a plain name in ``path``, a JSON file over :data:`MAX_JSON_BYTES`.
    """
    if not os.path.lexists(path / CONFIG):
        raise ValueError(f"no {CONFIG} (save the model with save_pretrained)")
    _check(path, CONFIG, MAX_JSON_BYTES)
    names = weight_files(path)
    for name in names:
        if name != INDEX:  # the index was checked before it was read
            _check(path, name, None)
    return sorted({CONFIG, *names})


def weight_files(path: Path) -> list[str]:
    """The files of ``path`` the weights come from: ``model.safetensors`` (transformers'
    choice too when both are there), else the index, checked before it is read, and the
    shards it names, unchecked (:func:`model_files` checks them).

    Raises: ValueError where there are neither (naming the pickles, which are never loaded)."""
    if os.path.lexists(path / SINGLE):
        return [SINGLE]
    if os.path.lexists(path / INDEX):
        _check(path, INDEX, MAX_JSON_BYTES)
        return [INDEX, *shard_names(path / INDEX)]
    pickles = sorted(p.name for p in path.iterdir() if p.name.endswith(PICKLES))
    also = f" ({', '.join(pickles)}: pickles, never loaded)" if pickles else ""
    raise ValueError(f"no safetensors weights ({SINGLE} or {INDEX}){also}: save the model with save_pretrained")


def shard_names(index: Path) -> list[str]:
    """The shards ``index`` maps its tensors to, sorted, each a plain name beside it.

    Raises: ValueError naming the index and the first name that is not a plain one."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map of tensor names to shard files")
    for name in sorted(set(weight_map.values())):
        if name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
            raise ValueError(
                f"{index} names the shard {name!r}, not a file in the model's directory "
                "(only shards beside the index are loaded)"
            )
    return sorted(set(weight_map.values()))


def read_json(file: Path) -> dict:
    """The JSON object in ``file`` (checked, and capped, by :func:`model_files`).

    Raises: ValueError naming the file."""
    try:
        value = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file}: not JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: not a JSON object")
    return value


def _check(path: Path, name: str, max_bytes: int | None) -> None:
    """Refuse ``path / name`` unless trusted (a regular file, not a link; ``trust``) and,
    with ``max_bytes``, at most that big."""
    why = untrusted_because(str(path / name))
    if why is not None:
        raise ValueError(f"not loaded: {why}")
    size = (path / name).stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{path / name}: {size:,} bytes, over the {max_bytes:,} bytes a JSON file may have")


def dir_identity(path: Path) -> bytes:
    """sha256 of the files of ``path`` that are loaded (module docstring).

    Raises: ValueError as :func:`model_files`."""
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
    max_context: int | None = None,
    kv_bytes: int | None = None,
    speculate: int = 0,
) -> LMDrafter:
    """The drafter of the transformers causal LM saved in ``model_dir``, for contexts of
    ``window`` tokens, with ``cache_slots`` cached streams of up to ``max_context``
    tokens each in a KV pool of ``kv_bytes``, pre-drafting ``speculate`` outcomes a stream
    (:class:`~remote_dspark.drafter.lm.drafter.LMDrafter`: its ``max_width``, what a
    stream holds past its context, bounds the HELLO's num_spec).

    Raises:
        ValueError: naming ``--hf-model``: ``model_dir`` is not a local directory, a file
            is refused (:func:`model_files`), the config is refused, the model does not
            fit in memory or its positions cannot hold a window and a draft, or anything
            transformers, safetensors or torch raise while loading it.
        ImportError: transformers is not installed (the ``hf`` extra).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(
            f"--hf-model {model_dir!r}: not a local directory (a model is never downloaded; "
            "save it with save_pretrained first)"
        )
    try:
        return _load(path, pick_device(device), window, cache_slots, max_context, kv_bytes, speculate)
    except ImportError:
        raise
    except Exception as e:  # the directory is input: whatever loading it raises is a refusal
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"--hf-model {model_dir!r}: {why}") from e


def _load(
    path: Path,
    dev: torch.device,
    window: int,
    cache_slots: int,
    max_context: int | None,
    kv_bytes: int | None,
    speculate: int = 0,
) -> LMDrafter:
    """:func:`load_hf` past its directory check; raises whatever fails."""
    model_files(path)  # every file checked before transformers is imported or any file parsed
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"--hf-model needs transformers ({e}): pip install remote-dspark[hf]") from e
    config = _config(path / CONFIG, transformers)
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ValueError(f"{type(config).__name__} ({config.model_type!r}) has no causal LM in transformers")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and window + 1 > positions:
        raise ValueError(
            f"the model has {positions} positions, fewer than a window of {window} (--window) and one draft"
        )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shards = [path / name for name in weight_files(path) if name != INDEX]
    params, nbytes = model_size(cls, config, dtype)
    why = memory_refusal(params, nbytes, sum(f.stat().st_size for f in shards), dtype, dev)
    if why is not None:
        raise ValueError(why)
    why = sliding_window_refusal(config, stream_columns(max_context, positions)[0])
    if why is not None:
        raise ValueError(why)
    model = _with_weights(cls, config, shards, dtype)
    hf = HFModel(model.eval(), dir_identity(path), int(config.vocab_size), positions)
    return LMDrafter(
        hf,
        device=dev,
        cache_slots=cache_slots,
        window=window,
        max_context=max_context,
        kv_bytes=kv_bytes,
        speculate=speculate,
    )


def _config(file: Path, transformers):
    """The model's configuration, refused when it would have transformers fetch code
    (a Hub kernel) or quantize (quantizers bring kernels and sizes of their own)."""
    raw = read_json(file)
    if "quantization_config" in raw:
        raise ValueError(f"{file}: a quantized model (quantization_config) is not loaded")
    kernels = hub_kernels(raw)
    if kernels:
        raise ValueError(f"{file} names kernels from the Hub ({', '.join(kernels)}): code from outside the directory")
    return transformers.AutoConfig.from_pretrained(str(file.parent), local_files_only=True, trust_remote_code=False)


def hub_kernels(node, named: bool = False) -> list[str]:
    """The Hub kernel repositories (``org/name``) a config's attention or experts
    implementation names, at any depth (sub-configs, per-sub-config mappings)."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in hub_kernels(value, named or key.lstrip("_") in _KERNEL_KEYS)]
    return [node] if named and isinstance(node, str) and "/" in node else []


@contextlib.contextmanager
def _modules_at_most(limit: int):
    """Within: registering a module past ``limit`` (torch's global registration hook,
    held only for the meta build) raises ValueError."""
    count = 0

    def count_one(module, name, submodule):
        nonlocal count
        count += 1
        if count > limit:
            raise ValueError(f"the model has more than {limit:,} modules (layers, experts): not built")

    handle = torch.nn.modules.module.register_module_module_registration_hook(count_one)
    try:
        yield
    finally:
        handle.remove()


def model_size(cls, config, dtype: torch.dtype) -> tuple[int, int]:
    """``(parameters, bytes)`` of ``cls`` built from ``config`` on the meta device (shapes
    only, nothing allocated), its parameters and buffers counted once each, floating ones
    at ``dtype``'s size.

    Raises: ValueError past :data:`MAX_MODULES` modules."""
    with _modules_at_most(MAX_MODULES), torch.device("meta"):
        model = cls(config)
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    params = sum(t.numel() for t in model.parameters())
    nbytes = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)
    return params, nbytes


def memory_refusal(params: int, nbytes: int, checkpoint: int, dtype: torch.dtype, dev: torch.device) -> str | None:
    """Why a model of ``params`` parameters, ``nbytes`` in ``dtype``, loaded from
    ``checkpoint`` bytes of safetensors onto ``dev``, does not fit; None when it does.

    Loading holds the checkpoint's tensors and the model in host memory together; on
    CUDA the model then goes to the GPU."""
    model = f"the model ({params:,} parameters) needs {nbytes:,} bytes in {str(dtype).removeprefix('torch.')}"
    host = memory_free(torch.device("cpu"))
    if nbytes + checkpoint > host:
        return (
            f"{model} and its checkpoint {checkpoint:,}: {nbytes + checkpoint:,} bytes while loading, "
            f"over the {host:,} bytes of memory available on this host"
        )
    if dev.type == "cuda":
        free = memory_free(dev)
        if nbytes > free:
            return f"{model}, over the {free:,} bytes free on {dev}"
    return None


def _with_weights(cls, config, shards: list[Path], dtype: torch.dtype):
    """``cls`` with the tensors of ``shards`` (host memory, ``dtype``), transformers given
    no path to open. Raises: ValueError when a weight of the model is not in them."""
    from safetensors.torch import load_file

    state = {}
    for shard in shards:
        state.update(load_file(shard))
    model, info = cls.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype, use_kernels=False, output_loading_info=True
    )
    missing = sorted(info["missing_keys"])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"weights missing from the checkpoint: {shown}")
    return model
