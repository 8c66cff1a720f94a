"""deploy/kubernetes/ against the worker it deploys: the container's arguments are the
worker's real flags (parsed by the real parser), the probes and the PodMonitor ask for
paths a real worker's metrics server serves, every port the probes, the Service and the
PodMonitor name is the port the flags open, the Service and the PodMonitor select the
Deployment's pods, and the key file the worker is given is one its rule for a secret
accepts (the init container's own command run here). Loopback only; the worker started
is stopped by its test."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

import pytest
import yaml
from helpers import REPO

from remote_dspark.cli import worker as worker_cli
from remote_dspark.cli.main import build_parser
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.transport.auth import load_key
from remote_dspark.transport.endpoint import parse_endpoint
from remote_dspark.worker import Worker
from remote_dspark.worker.limits import parse_listen

HERE = Path(REPO) / "deploy" / "kubernetes"
BASE, MONITORED = HERE / "base", HERE / "with-podmonitor"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def rendered(folder: Path = MONITORED) -> list[dict]:
    """The objects ``kubectl apply -k folder`` applies: its resources, a folder among them
    read as its own kustomization. Only ``resources`` is used (no patches or generators),
    so this is kustomize's output up to order (the kubectl test compares them)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources"}, f"{folder}: more than resources"
    out = []
    for name in kustomization["resources"]:
        path = folder / name
        out += rendered(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    return out


HEADLESS = "Service/remote-dspark-worker-pods"


def manifests(folder: Path = MONITORED) -> dict[str, dict]:
    """Every object ``folder`` applies, by kind; a second object of a kind (the headless
    Service) by kind and name."""
    out: dict[str, dict] = {}
    for doc in rendered(folder):
        key = doc["kind"] if doc["kind"] not in out else f"{doc['kind']}/{doc['metadata']['name']}"
        assert key not in out, f"{folder}: a second {key}"
        out[key] = doc
    return out


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    return manifests()


def pod_spec(objects) -> dict:
    return objects["Deployment"]["spec"]["template"]["spec"]


def container(objects, name: str, init: bool = False) -> dict:
    found = [c for c in pod_spec(objects)["initContainers" if init else "containers"] if c["name"] == name]
    assert len(found) == 1, f"no (or more than one) container {name!r}"
    return found[0]


def worker_args(objects) -> argparse.Namespace:
    """The worker container's command line as the worker's own parser reads it."""
    c = container(objects, "worker")
    assert c["command"] == ["remote-dspark", "worker"]
    try:
        args = build_parser().parse_args(["worker", *c["args"]])
    except SystemExit:
        pytest.fail(f"remote-dspark worker refuses the manifest's arguments {c['args']} (its error is above)")
    assert args.func is worker_cli.run
    return args


def container_port(c: dict, port) -> int:
    """The number of ``port`` (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    assert len(numbers) == 1, f"container {c['name']} has no port named {port!r}"
    return numbers[0]


def mount_of(c: dict, path: str) -> tuple[dict, str]:
    """The volume mount of container ``c`` that holds ``path`` (the deepest), and the
    path inside the volume."""
    p = PurePosixPath(path)
    mounts = [m for m in c.get("volumeMounts", []) if p.is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of container {c['name']}"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    return m, p.relative_to(m["mountPath"]).as_posix()


def volume(objects, name: str) -> dict:
    return next(v for v in pod_spec(objects)["volumes"] if v["name"] == name)


def pod_labels(objects) -> dict:
    return objects["Deployment"]["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


@contextlib.contextmanager
def loopback_worker():
    """A worker (the Markov drafter) with its metrics server on 127.0.0.1, stopped after."""
    model = MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=1)
    w = Worker(MarkovDrafter(model), "127.0.0.1", 0, metrics_port=0).start()
    try:
        yield w
    finally:
        w.stop()


def status_of(w: Worker, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_each_kustomization_lists_its_folder_and_only_the_overlay_needs_the_operator():
    """The base applies on any cluster (no Prometheus Operator kind in it); the overlay
    is the base and a PodMonitor."""
    for folder in (BASE, MONITORED):
        listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
        here = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert {n for n in listed if not (folder / n).is_dir()} == here, folder
    base = manifests(BASE)
    assert set(base) == {"Deployment", "Service", HEADLESS, "PersistentVolumeClaim"}
    assert not any(d["apiVersion"].startswith("monitoring.coreos.com/") for d in base.values())
    assert set(manifests(MONITORED)) == set(base) | {"PodMonitor"}


def test_the_model_volume_is_the_claim_the_base_defines(objects):
    """The Deployment's model volume is the base's claim, which every replica, on any
    node, can mount."""
    args = worker_args(objects)
    model_mount, _ = mount_of(container(objects, "worker"), args.hf_model)
    claim = volume(objects, model_mount["name"])["persistentVolumeClaim"]
    pvc = manifests(BASE)["PersistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"] and claim["readOnly"] is True
    if objects["Deployment"]["spec"]["replicas"] > 1:
        assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here (its kustomize renders the folders)")
def test_kubectl_renders_the_same_objects_and_an_overlay_renames_the_image(tmp_path):
    """``kubectl kustomize`` of the base and the overlay gives the objects read above;
    an overlay of one's own with ``images`` (docs/deploy.md) gives every container the
    registry's image."""

    def kustomize(folder: Path) -> list[dict]:
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return list(yaml.safe_load_all(out.stdout))

    def names(docs):
        return sorted((d["kind"], d["metadata"]["name"]) for d in docs)

    for folder in (BASE, MONITORED):
        assert names(kustomize(folder)) == names(rendered(folder))
    name, tag = "registry.internal/ml/remote-dspark-worker", "0.1.0-cuda"
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(MONITORED, tmp_path)],
                "images": [{"name": "remote-dspark-worker", "newName": name, "newTag": tag}],
            }
        )
    )
    deployment = next(d for d in kustomize(tmp_path) if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["initContainers"] + spec["containers"]} == {f"{name}:{tag}"}


def test_the_worker_runs_with_its_real_flags_reachable_from_other_pods(objects):
    args = worker_args(objects)
    host, port = parse_listen(args.listen)
    assert host not in LOOPBACK and port != 0, f"--listen {args.listen}: the Service cannot reach it"
    assert args.metrics_host not in LOOPBACK, "--metrics-host: the kubelet's probes cannot reach it"
    assert args.metrics_port not in (None, 0)
    c = container(objects, "worker")
    assert {p["containerPort"] for p in c["ports"]} == {port, args.metrics_port}
    model_mount, _ = mount_of(c, args.hf_model)
    assert model_mount["readOnly"] is True
    if args.lm_device == "cuda":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_probes_ask_the_metrics_port_for_paths_the_worker_serves(objects):
    args = worker_args(objects)
    c = container(objects, "worker")
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 while busy, not only while stopping
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    probes = [c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        assert container_port(c, probe["port"]) == args.metrics_port, probe
    endpoint = objects["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert len(endpoint) == 1 and container_port(c, endpoint[0]["port"]) == args.metrics_port
    with loopback_worker() as w:
        assert status_of(w, "/no-such-path") == 404
        for path in {p["path"] for p in probes} | {endpoint[0]["path"]}:
            assert status_of(w, path) == 200, path


def test_the_service_and_the_podmonitor_select_the_pods_and_their_ports(objects):
    args = worker_args(objects)
    _, listen_port = parse_listen(args.listen)
    labels = pod_labels(objects)
    assert selects(objects["Deployment"]["spec"]["selector"]["matchLabels"], labels)
    assert selects(objects["PodMonitor"]["spec"]["selector"]["matchLabels"], labels)
    service = objects["Service"]["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    assert selects(service["selector"], labels)
    c = container(objects, "worker")
    ports = {p["name"]: container_port(c, p["targetPort"]) for p in service["ports"]}
    assert ports == {"drafting": listen_port, "metrics": args.metrics_port}


def test_the_headless_service_resolves_to_every_ready_pods_drafting_port(objects):
    """The engines' Service: no cluster IP (its name resolves to each ready pod's own
    address, a fleet), the Deployment's pods, the worker's listening port."""
    args = worker_args(objects)
    _, listen_port = parse_listen(args.listen)
    service = objects[HEADLESS]["spec"]
    assert service["clusterIP"] == "None" or service["clusterIP"] is None
    assert not service.get("publishNotReadyAddresses", False)  # a busy or stopping pod leaves the answer
    assert selects(service["selector"], pod_labels(objects))
    c = container(objects, "worker")
    assert {p["name"]: (p["port"], container_port(c, p["targetPort"])) for p in service["ports"]} == {
        "drafting": (listen_port, listen_port)
    }


@pytest.mark.parametrize(
    "doc,marker",
    [("README.md", "### On Kubernetes"), ("docs/deploy.md", "## Kubernetes"), ("docs/design/worker.md", "## Many")],
)
def test_the_docs_point_engines_at_the_headless_service(objects, doc, marker):
    """The engine's VLLM_DSPARK_REMOTE in each document's Kubernetes section is the
    headless Service's name and drafting port, and the engine's own parser takes it."""
    section = (Path(REPO) / doc).read_text().split(marker, 1)[1].split("\n## ", 1)[0]
    raw = re.search(r"VLLM_DSPARK_REMOTE=([^\s`]+)", section).group(1)
    endpoint = parse_endpoint(raw.replace("<namespace>", "default"))
    service = objects[HEADLESS]
    assert endpoint.scheme == "tcp" and endpoint.host.split(".")[0] == service["metadata"]["name"]
    assert endpoint.port == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "drafting")


def test_the_key_file_the_worker_is_given_is_one_it_accepts(objects, tmp_path):
    """A Secret's files are root's (group too: the pod sets no fsGroup), so the worker
    cannot take one as its key (unreadable at 0400, refused with any access for others);
    it takes the init container's copy, made as the worker's user. The copy's command is
    run here over the pod's volumes laid out in ``tmp_path``, and the worker's own loader
    reads the result."""
    args = worker_args(objects)
    worker, copier = container(objects, "worker"), container(objects, "key-copy", init=True)
    key_mount, key_rel = mount_of(worker, args.key_file)
    assert key_mount["readOnly"] is True
    assert "emptyDir" in volume(objects, key_mount["name"]), "the worker's key is the init container's copy"
    secret_volume = next(v for v in pod_spec(objects)["volumes"] if "secret" in v)
    assert secret_volume["name"] not in {m["name"] for m in worker["volumeMounts"]}
    pod_uid = pod_spec(objects)["securityContext"]["runAsUser"]
    for c in (worker, copier):  # the copy's owner is the reader: the same user
        assert c.get("securityContext", {}).get("runAsUser", pod_uid) == pod_uid

    key = b"a pre-shared key of at least 16 bytes\n"
    for item in secret_volume["secret"]["items"]:
        secret_file = tmp_path / secret_volume["name"] / item["path"]
        secret_file.parent.mkdir(parents=True, exist_ok=True)
        secret_file.write_bytes(key)
        mode = item.get("mode", secret_volume["secret"]["defaultMode"])
        assert mode & stat.S_IROTH, f"{item['path']}: root's, mode {mode:04o}: the copier ({pod_uid}) cannot read it"
        os.chmod(secret_file, mode)
    (tmp_path / key_mount["name"]).mkdir()
    os.chmod(tmp_path / key_mount["name"], 0o777)  # an emptyDir is world-writable

    def local(arg: str) -> str:
        if not arg.startswith("/"):
            return arg
        m, rel = mount_of(copier, arg)
        return str(tmp_path / m["name"] / rel)

    subprocess.run([local(a) for a in copier["command"]], check=True, timeout=30)
    assert load_key(str(tmp_path / key_mount["name"] / key_rel), "--key-file").secret == key.strip()


def test_every_container_runs_unprivileged(objects):
    spec = pod_spec(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "fsGroup" not in spec["securityContext"]  # it would make the key group-readable
    for c in spec["initContainers"] + spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], c["name"]
        assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 1) != 0, c["name"]
