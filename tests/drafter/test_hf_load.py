"""Loading a transformers model (``--hf-model DIR``, ``lm.hf``): only safetensors files in
DIR that nobody else may write are opened, whatever the index names; a model too big for
memory is refused from its config before anything is allocated; every failure to load is
a refusal naming the flag."""

import json
import os
import shutil

import psutil
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
from safetensors.torch import load_file, save_file  # noqa: E402 (transformers' own dependency)

from remote_dspark.drafter.lm import hf  # noqa: E402
from remote_dspark.drafter.lm.hf import load_hf  # noqa: E402

CONFIG = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2)
GIANT = {"vocab_size": 1 << 28, "n_embd": 8192}  # the attack: 2^28 x 8192, 8 TiB in float32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT-2 saved by save_pretrained (one safetensors file), and its weights."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("saved")
    transformers.GPT2LMHeadModel(CONFIG).save_pretrained(path)
    return path, load_file(path / "model.safetensors")


def model_dir(tmp_path, saved, name="model", config=None, **tensors_by_file):
    """A 0700 directory with the saved config (``config`` entries over it) and, per
    keyword, a safetensors file of those tensors (none: the saved model.safetensors)."""
    src, _ = saved
    path = tmp_path / name
    path.mkdir(mode=0o700)
    raw = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    if not tensors_by_file:
        shutil.copy(src / "model.safetensors", path)
    for file, tensors in tensors_by_file.items():
        save_file(tensors, path / file, metadata={"format": "pt"})
    return path


def write_index(path, shard_of):
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard_of}))


def planted(tmp_path, saved):
    """The attacker's weights (every value 0.125) in a 0777 directory, mode 0666."""
    _, weights = saved
    evil = tmp_path / "evil"
    evil.mkdir()
    os.chmod(evil, 0o777)
    save_file({k: torch.full_like(v, 0.125) for k, v in weights.items()}, evil / "w.safetensors")
    os.chmod(evil / "w.safetensors", 0o666)
    return evil / "w.safetensors"


# --- what is opened ------------------------------------------------------------------------


def test_hf_model_files_others_may_write_are_never_loaded(tmp_path, saved):
    """A model directory or weight file others can write is refused (and a directory
    without config.json, plainly)."""
    model = tmp_path / "model"
    model.mkdir(mode=0o700)
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(str(model), "cpu")
    model = model_dir(tmp_path, saved, "writable")
    os.chmod(model / "model.safetensors", 0o666)
    with pytest.raises(ValueError, match=r"not loaded: file .*model.safetensors may be written by others"):
        load_hf(str(model), "cpu")
    os.chmod(model / "model.safetensors", 0o644)
    os.chmod(model, 0o777)
    with pytest.raises(ValueError, match=r"not loaded: directory .* may be written by others"):
        load_hf(str(model), "cpu")


def test_pickled_weights_are_never_loaded(tmp_path, saved):
    """A pytorch_model.bin (a pickle: loading it runs its code) is refused, naming it,
    even when it is this user's own and holds the model's weights."""
    _, weights = saved
    path = model_dir(tmp_path, saved, "pickled")
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"^--hf-model .*: no safetensors weights .*pytorch_model.bin: pickles"):
        load_hf(str(path), "cpu", window=16)


def test_an_index_naming_a_file_outside_the_directory_is_refused_naming_it(tmp_path, saved):
    """The model's weights in two shards beside their index load; the same index naming
    the attacker's shard (0666, in a 0777 directory) by an absolute path, through
    ``..``, or in a sub-folder that is a link out of DIR is refused naming the name."""
    _, weights = saved
    names = sorted(weights)
    half = len(names) // 2
    good = model_dir(
        tmp_path, saved, "sharded", a={k: weights[k] for k in names[:half]}, b={k: weights[k] for k in names[half:]}
    )
    write_index(good, {k: "a" if i < half else "b" for i, k in enumerate(names)})
    loaded = load_hf(str(good), "cpu", window=16).model.lm.state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in names)

    evil = planted(tmp_path, saved)
    for case, shard in (("absolute", str(evil)), ("dotdot", "../evil/w.safetensors"), ("folder", "sub/w.safetensors")):
        path = model_dir(tmp_path, saved, case, a={"unused": torch.zeros(1)})  # no model.safetensors: the index
        if case == "folder":
            os.symlink(evil.parent, path / "sub")
        write_index(path, {k: "a" if i < half else shard for i, k in enumerate(names)})
        why = rf"^--hf-model '{path}': .*index.json names the shard '{shard}', not a file in the model's directory"
        with pytest.raises(ValueError, match=why):
            load_hf(str(path), "cpu", window=16)


def test_a_shard_that_is_a_link_out_of_the_directory_or_missing_is_refused_naming_it(tmp_path, saved):
    """A shard the index names beside it that is a link (to the attacker's shard), named
    like a shard or not, or that is not there, is refused naming the file."""
    _, weights = saved
    evil = planted(tmp_path, saved)
    for case, shard in (("named", "model-00001-of-00001.safetensors"), ("unnamed", "w"), ("missing", "gone")):
        path = model_dir(tmp_path, saved, case, a={"unused": torch.zeros(1)})
        if case != "missing":
            os.symlink(evil, path / shard)
        write_index(path, dict.fromkeys(weights, shard))
        why = "is not a regular file" if case != "missing" else "No such file"
        with pytest.raises(ValueError, match=rf"^--hf-model '{path}': not loaded: .*{path / shard}.*{why}"):
            load_hf(str(path), "cpu", window=16)


def test_a_config_naming_a_hub_kernel_or_a_quantization_is_refused(tmp_path, saved):
    """transformers would fetch a kernel named ``org/name`` from the Hub (code from outside
    DIR) for the attention or experts, at any depth of the config; a quantized model
    brings its own kernels."""
    for case, entry in (
        ("attention", {"attn_implementation": "kernels-community/flash-attn3"}),
        ("sub", {"text_config": {"_experts_implementation": {"": "org/experts"}}}),
    ):
        path = model_dir(tmp_path, saved, case, config=entry)
        with pytest.raises(ValueError, match=r"^--hf-model .*config.json names kernels from the Hub \((kernels|org)"):
            load_hf(str(path), "cpu", window=16)
    path = model_dir(tmp_path, saved, "quantized", config={"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match=r"^--hf-model .*a quantized model \(quantization_config\) is not loaded"):
        load_hf(str(path), "cpu", window=16)


# --- size and errors -----------------------------------------------------------------------


def test_a_giant_config_is_refused_from_its_size_before_anything_is_allocated(tmp_path, saved):
    """The attack's 2^28 x 8192 vocabulary (its checkpoint holds none of the model's weights,
    so transformers would initialise them all): refused naming the flag, the parameters,
    the bytes and the memory there is, while the process's RSS stays small."""
    path = model_dir(tmp_path, saved, "giant", config=GIANT, **{"model.safetensors": {"unused": torch.zeros(1)}})
    process = psutil.Process()
    before = process.memory_info().rss
    why = r"^--hf-model .*: the model \(2,199,[\d,]{11} parameters\) needs 8,799,[\d,]{11} bytes in float32 .* over "
    with pytest.raises(ValueError, match=why + r"the [\d,]+ bytes of memory available on this host$"):
        load_hf(str(path), "cpu", window=16)
    assert process.memory_info().rss - before < 256 << 20


def test_a_config_of_too_many_modules_is_refused_while_it_is_built(tmp_path, saved, monkeypatch):
    """A config of a million layers would hold gigabytes of Python modules before its size
    is known: the meta build stops at MAX_MODULES (lowered here: 8 GPT-2 blocks have 13
    modules each), naming it; under it the model is built."""
    monkeypatch.setattr(hf, "MAX_MODULES", 64)
    path = model_dir(tmp_path, saved, "deep", config={"n_layer": 8})
    with pytest.raises(ValueError, match=r"^--hf-model .*: the model has more than 64 modules \(layers, experts\)"):
        load_hf(str(path), "cpu", window=16)
    monkeypatch.setattr(hf, "MAX_MODULES", 8 * 13 + 8)  # built, then its 7 more blocks have no weights
    with pytest.raises(ValueError, match=r"^--hf-model .*: weights missing from the checkpoint: transformer.h.1"):
        load_hf(str(path), "cpu", window=16)


def test_a_model_over_the_hosts_available_memory_is_refused_naming_the_figures(tmp_path, saved, monkeypatch):
    """The bound is the host's available memory: the model in float32 and its checkpoint
    (75,648 + the file's bytes) over it are refused, naming both figures."""
    path = model_dir(tmp_path, saved)
    ckpt = (path / "model.safetensors").stat().st_size
    monkeypatch.setattr(hf, "memory_free", lambda device: 75_648 + ckpt - 1)
    with pytest.raises(ValueError, match=rf"needs 75,648 bytes in float32 and its checkpoint {ckpt:,}: .* over the"):
        load_hf(str(path), "cpu", window=16)
    monkeypatch.setattr(hf, "memory_free", lambda device: 75_648 + ckpt)
    assert load_hf(str(path), "cpu", window=16).vocab_size == 128


def test_every_failure_to_load_is_a_refusal_naming_the_flag(tmp_path, saved):
    """Whatever transformers, safetensors or torch raise on a bad directory is a
    ValueError naming --hf-model, never a traceback of theirs."""
    _, weights = saved
    wrong = {k: torch.zeros(v.shape[::-1] if v.dim() == 2 else (v.shape[0] + 1,)) for k, v in weights.items()}
    cases = {
        "garbled": (None, None, r"SafetensorError"),
        "not json": (None, None, r"config.json: not JSON \(Expecting property name"),
        "unknown": ({"model_type": "no-such-model"}, None, r"no-such-model"),
        "not causal": ({"model_type": "t5"}, None, r"T5Config \('t5'\) has no causal LM in transformers"),
        "shapes": (None, wrong, r"RuntimeError: .*ignore_mismatched_sizes"),
        "missing": (None, {k: v for k, v in weights.items() if "ln_f" not in k}, r"weights missing .*ln_f.bias"),
    }
    for case, (config, tensors, why) in cases.items():
        path = model_dir(tmp_path, saved, case.replace(" ", "-"), config=config)
        if tensors is not None:
            save_file(tensors, path / "model.safetensors")
        if case == "garbled":
            (path / "model.safetensors").write_bytes(b"\xff" * 64)
        if case == "not json":
            (path / "config.json").write_text("{not json")
        with pytest.raises(ValueError, match=rf"^--hf-model '{path}': .*{why}") as e:
            load_hf(str(path), "cpu", window=16)
        assert not isinstance(e.value, RuntimeError), case
