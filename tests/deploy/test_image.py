"""The worker's image (the repository's Dockerfile) against the worker and the manifests:
it runs as the pods' unprivileged user, builds the native library in a stage of its own
and names it for the worker (so the image that runs needs no compiler), takes the model
from the volume the manifests mount, its flags are the worker's real flags, and its tag
is the one the manifests name. No builder runs here (none is reachable on the machines
this suite runs on): the last test runs the Dockerfile's steps as shell, in a temporary
directory and a fresh virtual environment, without an index, up to the installed worker
answering ``--help`` and loading the library with no compiler."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO
from image_steps import exec_form, expand, host_env, parse, run_stages, stage_args
from test_kubernetes import container, manifests, pod_spec, worker_args

from remote_dspark import native
from remote_dspark.cli.main import build_parser
from remote_dspark.worker.limits import parse_listen

ROOT = Path(REPO)
TEXT = (ROOT / "Dockerfile").read_text()
GLOBAL_ARGS, STAGES = parse(TEXT)
BUILD, FINAL = STAGES[0], STAGES[-1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
COMPILER = re.compile(r"\b(gcc|clang|cc|build-essential|libc6-dev)\b")


def values(stage) -> dict[str, str]:
    """The stage's ARGs and ENVs with their default values (PATH left as $PATH)."""
    out = {**stage_args(stage, GLOBAL_ARGS, {}), "PATH": "$PATH"}
    for ins in stage.all("ENV"):
        out.update({k: expand(v, out) for k, v in (w.split("=", 1) for w in ins.args.split())})
    return out


def final_args() -> list[str]:
    return exec_form(FINAL.all("CMD")[-1].args)


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    return manifests()


def test_the_image_runs_as_the_pods_unprivileged_user(objects):
    user = FINAL.all("USER")[-1].args
    assert re.fullmatch(r"\d+:\d+", user), f"USER {user}: numeric, so runAsNonRoot can check it"
    uid, gid = map(int, user.split(":"))
    assert uid != 0 and gid != 0
    security = pod_spec(objects)["securityContext"]
    assert (uid, gid) == (security["runAsUser"], security["runAsGroup"])
    created = " ".join(i.args for i in FINAL.all("RUN") if "useradd" in i.args)
    assert f"--uid {uid}" in created and f"--gid {gid}" in created


def test_the_compiler_is_in_the_build_stage_only_and_the_library_is_named():
    """The build stage installs a compiler before it builds the library; the image that
    runs installs none, copies the build's prefix and names the library by the variable
    the package reads, at the path the build stage installed it to."""
    runs = [i.args for i in BUILD.all("RUN")]
    built = next(n for n, r in enumerate(runs) if "native.locate()" in r)
    assert any("apt-get install" in r and COMPILER.search(r) for r in runs[:built])
    assert not any(COMPILER.search(i.args) for i in FINAL.all("RUN")), "a compiler in the image that runs"
    target = expand(re.search(r'install -D -m 0755 "\$lib" "([^"]+)"', runs[built]).group(1), values(BUILD))
    assert values(FINAL)[native.ENV_LIB] == target
    prefix = values(FINAL)["PREFIX"]
    assert target.startswith(prefix + "/")
    copied = [i.args for i in FINAL.all("COPY")]
    assert copied == [f"--from={BUILD.name} ${{PREFIX}} ${{PREFIX}}"], copied
    check = " ".join(i.args for i in FINAL.all("RUN"))
    assert "native.load()" in check and "worker --help" in check, "the image checks the library it runs with"


def test_the_entrypoint_is_the_manifests_worker_with_its_real_flags(objects):
    """ENTRYPOINT is the manifests' command; CMD parses with the worker's parser, reads the
    model from the image's volume (the manifests' mount), listens beyond loopback on the
    ports the image exposes, and every flag of it is the manifests' too."""
    worker = container(objects, "worker")
    assert exec_form(FINAL.all("ENTRYPOINT")[-1].args) == worker["command"]
    args = build_parser().parse_args(["worker", *final_args()])
    volumes = [v for i in FINAL.all("VOLUME") for v in exec_form(i.args)]
    assert args.hf_model in volumes
    assert worker_args(objects).hf_model == args.hf_model
    host, port = parse_listen(args.listen)
    assert host == "0.0.0.0" and args.metrics_host == "0.0.0.0"
    exposed = {int(p) for i in FINAL.all("EXPOSE") for p in i.args.split()}
    assert exposed == {port, args.metrics_port}
    assert set(final_args()) <= set(worker["args"]), "the manifests' worker flags differ from the image's"


def test_the_manifests_name_the_tag_the_documented_build_gives(objects):
    """The Dockerfile's build commands (one per VARIANT its torch step knows) tag
    ``remote-dspark-worker:<version>-<variant>``; the manifests run the cuda one (their
    worker drafts on a GPU), under that name, which an overlay's ``images`` replaces."""
    built = dict(re.findall(r"docker build --build-arg VARIANT=(\w+) -t (\S+) \.", TEXT))
    torch_step = next(i.args for i in BUILD.all("RUN") if "torch==" in i.args)
    assert set(built) == set(re.findall(r"(\w+)\) index=", torch_step)) == {"cpu", "cuda"}
    for variant, tag in built.items():
        assert tag == f"remote-dspark-worker:{VERSION}-{variant}"
    assert worker_args(objects).lm_device == "cuda"
    spec = pod_spec(objects)
    assert {c["image"] for c in spec["initContainers"] + spec["containers"]} == {built["cuda"]}
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file():
            assert "PLACEHOLDER" not in path.read_text(), path


def test_the_build_context_holds_what_copy_takes():
    """Everything COPY takes exists and is sent (.dockerignore sends nothing else), and
    it is enough to install the package: its readme and its native sources."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [line for line in lines if line and not line.startswith("#")]
    sources = [s for i in BUILD.all("COPY") for s in i.args.split()[:-1]]
    assert ignore[0] == "*"
    assert set(sources) == {line[1:] for line in ignore if line.startswith("!")}
    for s in sources:
        assert (ROOT / s).exists(), s
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["readme"] in sources
    assert all(p.relative_to(ROOT).parts[0] in sources for p in native.build.SOURCES)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dockerfiles_steps_build_a_worker_that_runs_without_a_compiler(tmp_path):
    """Every RUN step but three, in order, as shell, in a fresh virtual environment:
    apt-get (the compiler is this machine's), the torch download (no index is reachable:
    torch and the build backend come from this suite's environment, read-only, on
    PYTHONPATH; pip runs with no index) and useradd (the steps run as this user).
    Then, with the image's environment and CC naming no compiler, the installed package
    (not this checkout) loads the library the build stage made, and the entrypoint
    answers ``--help``."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here: the build stage's library cannot be built")
    python_dir = tmp_path / "python"
    python_dir.mkdir()
    (python_dir / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    borrowed = next(p for p in sys.path if p.endswith("site-packages"))
    prefix, src, workdir = tmp_path / "opt" / "remote-dspark", tmp_path / "src", tmp_path / "root"
    workdir.mkdir()
    base = host_env(
        PATH=f"{python_dir}:{host_env()['PATH']}",
        HOME=str(tmp_path / "home"),
        PYTHONPATH=borrowed,
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",  # pip's spelling of "off"
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_CACHE_DIR="1",
    )
    ran = run_stages(
        TEXT,
        ROOT,
        workdir=workdir,
        overrides={"PREFIX": str(prefix), "SRC": str(src)},
        base_env=base,
        skips={
            r"^apt-get ": "the compiler is this machine's",
            r"pip install .*torch==": "no index is reachable: torch comes from this suite's environment",
            r"\buseradd\b": "the steps run as this user",
        },
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    assert len(ran.ran) == len([i for s in STAGES for i in s.all("RUN")]) - 3
    env = {**ran.env, "CC": str(tmp_path / "no-such-compiler")}
    lib = prefix / "lib" / "remote-dspark" / "libremote_dspark_native.so"
    assert env[native.ENV_LIB] == str(lib) and lib.is_file()
    probe = "import remote_dspark, remote_dspark.native as n; print(remote_dspark.__file__); print(n.load().path)"
    out = subprocess.run(["python", "-c", probe], env=env, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    installed, loaded = out.stdout.split()
    assert Path(installed).is_relative_to(prefix) and loaded == str(lib)
    entry = exec_form(FINAL.all("ENTRYPOINT")[-1].args)
    out = subprocess.run([*entry, "--help"], env=env, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--hf-model" in out.stdout, out.stderr[-3000:]
