"""Deployment: the coordinator CLI, the Kubernetes manifests, the compose file, the image.

No Docker engine or Kubernetes cluster is needed: the manifests are validated
offline against the Kubernetes OpenAPI schemas that kubernetes-validate
ships, the compose file and Dockerfile are checked for consistency, and the
CLI runs against real psserver/psworker processes on 127.0.0.1. Building the
image and running compose happens only where ``docker info`` works.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from coordinator import LocalCluster, cli  # noqa: E402
from coordinator.cluster_spec import ClusterConfigError  # noqa: E402
from psserver.client import PSClient  # noqa: E402
from psserver.process import child_env, start_task  # noqa: E402

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

DEPLOY = os.path.join(ROOT, "deploy")
COMPOSE = os.path.join(ROOT, "docker-compose.yml")
ELASTIC = os.path.join(ROOT, "docker-compose.elastic.yml")
#: Kubernetes version the manifests are validated against (grpc probes: GA in 1.27).
K8S_VERSION = "1.31.0"
PORT = 2222
METRICS_PORT = 9100   # Prometheus metrics (tests/integration/test_metrics.py checks them in full)
DATA_PORT = 2223      # the data port (tests/integration/test_data_port.py)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def manifest_files():
    return sorted(p for p in glob.glob(os.path.join(DEPLOY, "*.yaml"))
                  if os.path.basename(p) != "kustomization.yaml")


def resources():
    return [d for p in manifest_files() for d in load_all(p)]


def by_kind(kind):
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


def pod_specs():
    """(name, pod spec, pod labels) of every workload."""
    out = []
    for d in resources():
        if d["kind"] in ("StatefulSet", "Job", "Deployment"):
            t = d["spec"]["template"]
            out.append((d["metadata"]["name"], t["spec"], t["metadata"]["labels"]))
    return out


def tls_env(cluster) -> dict:
    tls = getattr(cluster, "tls", None)
    return tls.env() if tls else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Kubernetes manifests ------------------------------------------------------------------
@pytest.mark.parametrize("path", manifest_files(), ids=os.path.basename)
def test_manifest_validates_against_the_kubernetes_schemas(path):
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install -e '.[test]'): "
               "the manifests cannot be checked against the Kubernetes schemas")
    docs = load_all(path)
    assert docs, f"{path} holds no resource"
    for doc in docs:
        try:
            kv.validate(doc, K8S_VERSION, strict=True)   # strict: unknown fields are errors
        except kv.ValidationError as exc:
            pytest.fail(f"{os.path.basename(path)}: {doc['kind']}/{doc['metadata']['name']}: "
                        f"{exc.message} at {'.'.join(map(str, exc.path))}")


def test_strict_validation_would_catch_a_typo():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    sts = by_kind("StatefulSet")["ps"]
    bad = json.loads(json.dumps(sts))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": PORT}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    with open(os.path.join(DEPLOY, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    assert kust["kind"] == "Kustomization"
    listed = set(kust["resources"])
    on_disk = {os.path.basename(p) for p in manifest_files()}
    assert listed == on_disk, (f"not in kustomization.yaml: {sorted(on_disk - listed)}; "
                               f"listed but missing: {sorted(listed - on_disk)}")
    # beside the manifests only scripts, notes and directories (wheelhouse/, overlays)
    files = [p for p in os.listdir(DEPLOY) if os.path.isfile(os.path.join(DEPLOY, p))]
    assert files and all(p.endswith((".yaml", ".sh", ".md")) for p in files), files


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.timeout(60)
def test_kustomize_renders_every_resource():
    out = subprocess.run(["kubectl", "kustomize", DEPLOY], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout) if d)
    assert kinds == sorted(d["kind"] for d in resources())


def test_manifests_are_namespace_agnostic_and_fit_together():
    res = resources()
    assert not [d["metadata"]["name"] for d in res if "namespace" in d["metadata"]]
    secrets, cms, pvcs = by_kind("Secret"), by_kind("ConfigMap"), by_kind("PersistentVolumeClaim")
    assert set(secrets["pstrain-auth"]["stringData"]) >= {"token", "tls.crt", "tls.key", "ca.crt"}

    # The cluster spec names the StatefulSets' pods under their headless Services.
    cluster = json.loads(cms["pstrain-cluster"]["data"]["tf_config.json"])["cluster"]
    services, sets = by_kind("Service"), by_kind("StatefulSet")
    for role in ("ps", "worker"):
        sts = sets[role]
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None"
        assert cluster[role] == [f"{role}-{i}.{svc['metadata']['name']}:{PORT}"
                                 for i in range(sts["spec"]["replicas"])]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert svc["spec"]["selector"].items() <= labels.items()
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert c["command"][:4] == ["coordinator", "task", "--type", role]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
            "grpc": PORT, "data": DATA_PORT, "metrics": METRICS_PORT}
        assert c["command"][c["command"].index("--data-port") + 1] == str(DATA_PORT)
        assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
            "grpc": (PORT, "grpc"), "data": (DATA_PORT, "data"),
            "metrics": (METRICS_PORT, "metrics")}
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == PORT, (role, probe)
    assert sets["ps"]["spec"]["replicas"] == 2

    job = by_kind("Job")["pstrain-coordinator"]
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["coordinator", "run"] and "--cluster" in cmd

    # Only the job's own pods reach the port.
    (policy,) = by_kind("NetworkPolicy").values()
    selected = policy["spec"]["podSelector"]["matchLabels"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [PORT, DATA_PORT, METRICS_PORT]
    (peer,) = rule["from"]
    for name, spec, labels in pod_specs():
        assert selected.items() <= labels.items(), name
        assert peer["podSelector"]["matchLabels"].items() <= labels.items(), name

    # Every workload: non-root, resources set, references resolve.
    for name, spec, labels in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in cms, name
            if "secret" in v:
                s = secrets[v["secret"]["secretName"]]
                assert {i["key"] for i in v["secret"].get("items", [])} <= set(s["stringData"])
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, name
        for c in spec["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (name, m["name"])
            env = {e["name"]: e for e in c["env"]}
            ref = env["PSTRAIN_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]]["stringData"]
            path = env["TF_CONFIG_FILE"]["value"]
            mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
            assert "subPath" not in mount   # a subPath mount never sees ConfigMap updates
            assert os.path.basename(path) in cms[volumes[mount["name"]]["configMap"]["name"]]["data"]
    assert any(m["mountPath"] == "/checkpoints"
               for m in job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"])


# -- docker compose ------------------------------------------------------------------------
def compose():
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def _command(service) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_compose_services_share_one_image_and_bind_all_interfaces():
    c = compose()
    services = c["services"]
    assert {"ps0", "ps1", "worker", "coordinator"} <= set(services)
    assert len({json.dumps([s.get("image"), s.get("build")], sort_keys=True)
                for s in services.values()}) == 1
    assert all(s.get("image") and s.get("build") for s in services.values())
    roles = {"psserver": [], "psworker": []}
    for name, s in services.items():
        cmd = _command(s)
        if cmd[0] in roles:
            roles[cmd[0]].append(name)
            assert _flag(cmd, "--host") == "0.0.0.0", name
            assert _flag(cmd, "--port") == str(PORT), name
            assert _flag(cmd, "--data-port") == str(DATA_PORT), name   # fixed, as in deploy/
            assert s["restart"] in ("on-failure", "unless-stopped", "always"), name
            assert "coordinator" in s["healthcheck"]["test"] and "health" in s["healthcheck"]["test"]
        assert "PSTRAIN_AUTH_TOKEN" in s["environment"], name
    assert sorted(roles["psserver"]) == ["ps0", "ps1"] and roles["psworker"] == ["worker"]
    # Scalable: nothing that pins one container per service.
    assert not {"container_name", "ports", "hostname"} & set(services["worker"])


def test_compose_references_resolve():
    c = compose()
    services, volumes = c["services"], set(c.get("volumes") or {})
    for name, s in services.items():
        for dep, cond in (s.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)
        for v in s.get("volumes", []):
            source = v.split(":")[0] if isinstance(v, str) else v["source"]
            if not source.startswith((".", "/")):
                assert source in volumes, (name, source)
    coord = services["coordinator"]
    assert "checkpoints:/checkpoints" in coord["volumes"]
    cmd = _command(coord)
    assert cmd[:2] == ["coordinator", "run"]
    assert cmd[cmd.index("examples/digits.py") + 1:] == ["--cluster", "tf_config", "--replication"]
    # TF_CONFIG and --worker-dns name services that exist, on the port they listen on.
    cluster = json.loads(coord["environment"]["TF_CONFIG"])["cluster"]
    addresses = cluster["ps"] + cluster.get("worker", []) + [_flag(cmd, "--worker-dns")]
    for addr in addresses:
        host, port = addr.rsplit(":", 1)
        assert host in services, addr
        assert _flag(_command(services[host]), "--port") == port, addr
    assert sorted(a.split(":")[0] for a in cluster["ps"]) == ["ps0", "ps1"]


def test_the_elastic_compose_file_scales_both_roles_found_by_dns():
    with open(ELASTIC) as f:
        c = yaml.safe_load(f)
    services = c["services"]
    assert set(services) == {"ps", "worker", "coordinator"}
    main = compose()["services"]["worker"]   # the same image and build as the shipped job's
    for name, s in services.items():
        assert (s["image"], s["build"]) == (main["image"], main["build"]), name
        assert "PSTRAIN_AUTH_TOKEN" in s["environment"], name
    for name, binary in (("ps", "psserver"), ("worker", "psworker")):
        s, cmd = services[name], _command(services[name])
        assert cmd[0] == binary and _flag(cmd, "--host") == "0.0.0.0"
        assert (_flag(cmd, "--port"), _flag(cmd, "--data-port")) == (str(PORT), str(DATA_PORT))
        assert not {"container_name", "ports", "hostname"} & set(s), name   # scalable
        assert "health" in s["healthcheck"]["test"]
        assert services["coordinator"]["depends_on"][name]["condition"] == "service_healthy"
    cmd = _command(services["coordinator"])
    assert cmd[:2] == ["coordinator", "run"] and "examples/ctr.py" in cmd
    assert (_flag(cmd, "--ps-dns"), _flag(cmd, "--worker-dns")) == \
        (f"ps:{PORT}", f"worker:{PORT}")
    assert "--replication" not in cmd   # (a replicated job refuses servers being added)
    assert json.loads(services["coordinator"]["environment"]["TF_CONFIG"]) == {"cluster": {}}


# -- Dockerfile ----------------------------------------------------------------------------
def test_dockerfile_is_multi_stage_non_root_with_examples():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=python:3.11-slim")
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) == 2 and all("${BASE_IMAGE}" in ln for ln in froms)
    final = text[text.rindex("\nFROM "):]
    assert "COPY --from=builder /opt/venv /opt/venv" in final
    assert "pip" not in final and "gcc" not in final
    assert re.search(r"^USER (?!root|0\b)\S+", final, re.M)
    assert "COPY examples" in final and "[examples]" in text
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignore = f.read()
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in src.split():
            assert f"!{path.rstrip('/')}" in ignore, f".dockerignore leaves out {path}"


def compose_command() -> list[str] | None:
    """Compose v2 (`docker compose`) where it answers, else v1 (`docker-compose`,
    Debian 12's 1.29), else None."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            r = subprocess.run(cmd + ["version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return cmd
    return None


def _docker_usable() -> str | None:
    if shutil.which("docker") is None:
        return "the docker command is not installed"
    try:
        r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker info` failed: {exc}"
    if r.returncode != 0:
        last = ((r.stderr or r.stdout).strip().splitlines() or [""])[-1]
        return f"`docker info` failed (no Docker engine): {last}"
    if compose_command() is None:
        return "neither `docker compose` (v2) nor `docker-compose` (v1) answers"
    return None


def _compose_project(file: str, name: str):
    """(the compose command for ``file`` as project ``name``, its environment:
    a fresh token and the test image, run(*args, timeout) -> CompletedProcess);
    skips the test without Docker (fails it with PSTRAIN_REQUIRE_DOCKER=1)."""
    why = _docker_usable()
    if why:
        if os.environ.get("PSTRAIN_REQUIRE_DOCKER") == "1":
            pytest.fail(f"PSTRAIN_REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)
    project = compose_command() + ["-f", file, "-p", name]
    env = {**os.environ, "PSTRAIN_AUTH_TOKEN": os.urandom(8).hex(),
           "PSTRAIN_IMAGE": "pstrain:test"}

    def run(*args, timeout=600):
        return subprocess.run(project + list(args), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    return project, env, run


KILL_PSSERVER = ("import os\n"
                 "for p in filter(str.isdigit, os.listdir('/proc')):\n"
                 "    try:\n"
                 "        if b'psserver' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
                 "            os.kill(int(p), 9)\n"
                 "    except OSError:\n"
                 "        pass\n")


# The sha256 of every .py file of the four packages, by path: run here on the
# source tree and in the image on what it installed.
CODE_DIGEST = ("import hashlib, importlib, pathlib\n"
               "h = hashlib.sha256()\n"
               "for pkg in ('protos', 'psserver', 'psworker', 'coordinator'):\n"
               "    root = pathlib.Path(importlib.import_module(pkg).__file__).parent\n"
               "    for f in sorted(root.rglob('*.py')):\n"
               "        h.update(f'{pkg}/{f.relative_to(root)}'.encode() + f.read_bytes())\n"
               "print(h.hexdigest())\n")


def _accuracy(out: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", out)
    assert found, out[-5000:]
    return float(found[-1])


@pytest.mark.timeout(1500)
def test_image_builds_and_compose_trains_digits_through_a_parameter_server_kill():
    """The shipped compose file, with whichever Compose is installed: the image
    builds (offline where BASE_IMAGE names a local base and deploy/wheelhouse
    holds wheels: deploy/build-image.sh), 3 workers train digits to 0.90; then
    a longer run whose ps1 server process is SIGKILLed mid-job (inside the
    container: `docker kill` would not trigger its restart policy) finishes,
    the coordinator failing over to the replicas (nothing re-created from an
    initializer, nothing lost); then one whose ps1 container is killed for
    good (`compose kill`) finishes on ps0 and exits 0; `down -v` removes it all.
    PSTRAIN_REQUIRE_DOCKER=1 (CI): fail instead of skipping without Docker."""
    project, env, compose = _compose_project(COMPOSE, "pstrain-test")
    try:
        # 1. The shipped job, as `docker compose up` runs it, with 3 workers.
        r = compose("up", "--build", "--scale", "worker=3", "--exit-code-from", "coordinator",
                    timeout=1400)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
        assert "workers 3" in r.stdout, r.stdout[-5000:]
        assert _accuracy(r.stdout) >= 0.90
        # The image runs the code of this tree, whatever wheels deploy/wheelhouse holds.
        here = subprocess.run([sys.executable, "-c", CODE_DIGEST], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout
        there = subprocess.run(["docker", "run", "--rm", "--workdir", "/", "pstrain:test",
                                "python3", "-c", CODE_DIGEST], text=True,
                               capture_output=True, timeout=120)
        assert there.returncode == 0, there.stderr
        assert there.stdout == here, "the image's packages differ from this source tree"
        # 2. A longer run, with ps1's server process SIGKILLed after the first epoch.
        assert compose("up", "-d", "--scale", "worker=3", "ps0", "ps1", "worker").returncode == 0
        out = _run_killing(project, env,
                           lambda: compose("exec", "-T", "ps1", "python", "-c", KILL_PSSERVER))
        assert "epoch 30/30" in out, out[-5000:]
        assert "failing over" in out, out[-5000:]          # the replicas took over
        assert "no checkpoint holds its shards" not in out and "re-creat" not in out, out[-5000:]
        assert _accuracy(out) >= 0.90
        # 3. ps1's whole container killed for good (`kill`: its restart policy does not
        # bring it back, a node lost): training goes on from the replicas on ps0 and the
        # job, clean-up included (its deletes follow the routes), exits 0 (issue 33 item 10).
        assert compose("up", "-d", "--scale", "worker=3", "ps0", "ps1", "worker").returncode == 0
        out = _run_killing(project, env, lambda: compose("kill", "ps1"))
        assert "epoch 30/30" in out and "failing over" in out, out[-5000:]
        assert "Traceback" not in out, out[-5000:]
        assert _accuracy(out) >= 0.90
    finally:
        compose("down", "-v", "--remove-orphans", timeout=120)


@pytest.mark.timeout(900)
def test_compose_adds_a_parameter_server_to_a_running_job_when_its_service_scales():
    """docker-compose.elastic.yml: examples/ctr.py on a `ps` service of 2
    replicas found by DNS (`coordinator run --ps-dns ps:2222`); once its first
    epoch is done, `up --scale ps=3`: the coordinator finds the third server
    and adds it (rows of the table move there, and an even share of the
    DLRM's variable shards); then `--scale ps=2`: Compose stops that server,
    which waits to be drained (--leave-timeout), the coordinator drains it
    (its rows and variable shards move back) and it exits; the job trains on
    to the end, exit 0, with no step failed. PSTRAIN_REQUIRE_DOCKER=1: fail,
    not skip."""
    project, env, compose = _compose_project(ELASTIC, "pstrain-elastic-test")
    try:
        r = compose("build", timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert compose("up", "-d", "ps", "worker").returncode == 0
        run = subprocess.Popen(project + ["run", "--rm", "coordinator", "coordinator", "run",
                                          "--wait-ready", "180", "--worker-dns", "worker:2222",
                                          "--ps-dns", "ps:2222", "examples/ctr.py",
                                          "--cluster", "tf_config", "--epochs", "5"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        lines, scale = [], iter([("epoch 1/", "ps=3"), (" added (", "ps=2")])
        when, ps = next(scale)
        for line in run.stdout:
            lines.append(line)
            if when in line:
                scaled = compose("up", "-d", "--no-recreate", "--scale", ps, "--scale",
                                 "worker=2", "ps")
                assert scaled.returncode == 0, scaled.stderr
                when, ps = next(scale, (None, None))
                if when is None:
                    break
        lines += run.stdout.readlines()
        out = "".join(lines)
        assert run.wait(timeout=600) == 0, out[-5000:]
        added = re.findall(r"parameter server (\S+) added \(the cluster spec lists it\): "
                           r"1 table\(s\), (\d+) rows moved, (\d+) variable shard", out)
        assert len(added) == 1 and int(added[0][1]) > 0, out[-5000:]
        assert int(added[0][2]) >= 1, out[-5000:]   # (an even share of the DLRM's variables)
        servers = re.findall(r"parameter servers now \[([^]]*)\]", out)
        assert [x.count(":2222") for x in servers] == [2, 3, 2], out[-5000:]
        assert added[0][0] in servers[1] and added[0][0] not in servers[2]
        drained = re.findall(r"parameter server (\S+) drained \(it is leaving\): "
                             r"1 table\(s\), (\d+) rows moved, (\d+) variable shard", out)
        assert drained == [(added[0][0], drained[0][1], added[0][2])], out[-5000:]
        assert int(drained[0][1]) > 0, out[-5000:]
        assert "epoch 5/5" in out and "Traceback" not in out, out[-5000:]
        auc = re.findall(r"test AUC: ([0-9.]+)", out)
        assert auc and float(auc[-1]) >= 0.70, out[-3000:]
    finally:
        compose("down", "-v", "--remove-orphans", timeout=120)


def _run_killing(project: list[str], env: dict, kill) -> str:
    """The compose job's coordinator, 30 epochs with replication; ``kill()``
    once its second epoch starts. Its output (it must exit 0)."""
    run = subprocess.Popen(project + ["run", "--rm", "coordinator", "coordinator", "run",
                                      "--wait-ready", "180", "--worker-dns", "worker:2222",
                                      "examples/digits.py", "--cluster", "tf_config",
                                      "--replication", "--epochs", "30"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if line.startswith("epoch 2/"):
            killed = kill()
            assert killed.returncode in (0, 137), killed.stderr
            break
    lines += run.stdout.readlines()
    assert run.wait(timeout=900) == 0, "".join(lines)[-5000:]
    return "".join(lines)


# -- coordinator CLI: pieces -----------------------------------------------------------------
@pytest.mark.parametrize("hostname,index", [("ps-0", 0), ("worker-12", 12), ("my-ps-3", 3),
                                            ("worker-1.worker.ns.svc.cluster.local", 1)])
def test_ordinal_from_statefulset_hostname(hostname, index):
    assert cli.ordinal(hostname) == index


@pytest.mark.parametrize("hostname", ["ps", "ps-", "ps-x", "0", "a1b2c3d4e5f6"])
def test_ordinal_needs_a_numeric_suffix(hostname):
    with pytest.raises(ClusterConfigError, match="--index"):
        cli.ordinal(hostname)


CONFIG = json.dumps({"cluster": {"ps": ["ps-0.ps:2222", "ps-1.ps:2223"],
                                 "worker": ["worker-0.worker:2224"]}})


def test_task_command_substitutes_the_task_and_takes_its_port():
    argv, tf_config = cli.task_command(CONFIG, "ps", 1, extra=("--grace", "20"))
    assert argv == [sys.executable, "-m", "psserver", "--host", "0.0.0.0", "--port", "2223",
                    "--grace", "20"]
    assert json.loads(tf_config) == {**json.loads(CONFIG), "task": {"type": "ps", "index": 1}}
    argv, tf_config = cli.task_command(CONFIG, "worker", 0, host="::")
    assert argv[2:] == ["psworker", "--host", "::", "--port", "2224"]
    assert json.loads(tf_config)["task"] == {"type": "worker", "index": 0}


@pytest.mark.parametrize("text,match", [
    (CONFIG, "not in the cluster's 1 worker"),        # ordinal beyond the list
    ("{not json", "not valid JSON"),
    ('{"task": {}}', '"cluster"'),
])
def test_task_command_errors_say_what_is_wrong(text, match):
    with pytest.raises(ClusterConfigError, match=match):
        cli.task_command(text, "worker", 1)


def test_run_passes_the_script_its_own_arguments():
    args = cli.build_parser().parse_args(
        ["run", "--wait-ready", "5", "train.py", "--cluster", "tf_config", "--wait-ready", "1"])
    assert (args.wait_ready, args.script) == (5.0, "train.py")
    assert args.script_args == ["--cluster", "tf_config", "--wait-ready", "1"]
    assert cli.build_parser().parse_args(["run", "t.py"]).wait_ready == 120


def test_resolve_workers_and_discovery_file(tmp_path, monkeypatch):
    assert cli.resolve_workers("127.0.0.1", 2222) == ["127.0.0.1:2222"]
    assert cli.resolve_workers("no-such-host.invalid", 2222) == []
    monkeypatch.setattr(cli, "resolve_workers",
                        lambda host, port: ["10.0.0.3:2222", "10.0.0.2:2222"])
    env = {"TF_CONFIG": json.dumps({"cluster": {"ps": ["ps0:2222"], "worker": ["10.0.0.2:2222"]}})}
    d = cli.SpecDiscovery({"worker": "worker:2222"}, env, interval=60)
    try:
        with open(d.path) as f:
            assert json.load(f)["cluster"] == {"ps": ["ps0:2222"],
                                               "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}
        # a look that resolves nothing (a DNS hiccup): the last answer stands
        monkeypatch.setattr(cli, "resolve_workers", lambda host, port: [])
        d.refresh()
        with open(d.path) as f:
            assert json.load(f)["cluster"]["worker"] == ["10.0.0.2:2222", "10.0.0.3:2222"]
        monkeypatch.setattr(cli, "resolve_workers", lambda host, port: ["10.0.0.2:2222"])
        d.refresh()   # (a replica went: it leaves)
        with open(d.path) as f:
            assert json.load(f)["cluster"]["worker"] == ["10.0.0.2:2222"]
    finally:
        d.stop()
    with pytest.raises(ClusterConfigError, match="HOST:PORT"):
        cli.SpecDiscovery({"worker": "worker"}, env)
    with pytest.raises(ClusterConfigError, match="no cluster description"):
        cli.SpecDiscovery({"worker": "worker:2222"}, {})


# -- coordinator run: errors a person can act on ------------------------------------------
@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('TRAINED')\n")
    return str(path)


@pytest.mark.parametrize("env,code,match", [
    ({}, 2, "no cluster description: set TF_CONFIG"),
    ({"TF_CONFIG": "{oops"}, 2, "not valid JSON"),
    ({"TF_CONFIG_FILE": "/nonexistent/tf_config.json"}, 2, "cannot read cluster file"),
    ({"TF_CONFIG": '{"cluster": {"worker": ["w:1"]}}'}, 2, "no parameter servers"),
    ({"TF_CONFIG": '{"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, '
                   '"task": {"type": "worker", "index": 0}}'}, 2, "is the chief"),
])
def test_run_refuses_a_bad_cluster_description(monkeypatch, capsys, script, env, code, match):
    for var in ("TF_CONFIG", "TF_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["run", script]) == code
    err = capsys.readouterr()
    assert match in err.err and "TRAINED" not in err.out


@pytest.mark.timeout(30)
def test_run_names_the_tasks_that_do_not_come_up(monkeypatch, capsys, script, start_ps):
    ps = start_ps()
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.delenv("TF_CONFIG_FILE", raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": [ps.address],
                                                            "worker": [dead]}}))
    assert cli.main(["run", "--wait-ready", "1.5", script]) == cli.EXIT_NOT_READY
    err = capsys.readouterr().err
    assert f"ps 0 at {ps.address} is serving" in err
    assert f"worker 0 at {dead}: UNAVAILABLE" in err and "--wait-ready" in err


@pytest.mark.timeout(30)
def test_run_with_ps_dns_finds_the_servers_and_has_the_job_follow_them(
        monkeypatch, capsys, tmp_path, start_ps):
    """``--ps-dns``: the servers a name resolves to are the script's parameter
    servers (looked up again: those found later join), and the script's
    ClusterCoordinator follows them (PSTRAIN_ELASTIC_SERVERS=1)."""
    ps = start_ps()
    port = ps.address.rsplit(":", 1)[1]
    path = tmp_path / "show.py"
    path.write_text("import json, os\n"
                    "print('ELASTIC', os.environ.get('PSTRAIN_ELASTIC_SERVERS'))\n"
                    "print('PS', json.load(open(os.environ['TF_CONFIG_FILE']))['cluster']['ps'])\n")
    for var in ("TF_CONFIG_FILE", "PSTRAIN_ELASTIC_SERVERS"):   # (cli.main sets them:
        monkeypatch.setenv(var, "")                              # put back as they were)
        monkeypatch.delenv(var)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {}}))
    assert cli.main(["run", "--wait-ready", "0", "--ps-dns", f"localhost:{port}",
                     str(path)]) == 0
    out = capsys.readouterr()
    assert "ELASTIC 1" in out.out and f"PS ['127.0.0.1:{port}']" in out.out
    assert f"parameter servers now ['127.0.0.1:{port}']" in out.err
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {}}))
    assert cli.main(["run", "--wait-ready", "0", "--ps-dns", "localhost", str(path)]) == 2
    assert "--ps-dns wants HOST:PORT" in capsys.readouterr().err


# -- coordinator health, against real tasks --------------------------------------------------
@pytest.mark.timeout(60)
def test_health_of_a_real_psserver_and_psworker(start_ps, monkeypatch, capsys):
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN", raising=False)
    ps = start_ps(env={"PSTRAIN_AUTH_TOKEN": "s3cret"})   # health is public: no token needed
    r = subprocess.run([sys.executable, "-m", "coordinator", "health", ps.address],
                       env=child_env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and f"{ps.address}: SERVING" in r.stdout, r.stdout + r.stderr
    worker = start_task("psworker", ["--port", "0"])
    try:
        assert cli.main(["health", worker.address]) == 0
        assert cli.main(["health", "--service", "pstrain.v1.Worker", worker.address]) == 0
    finally:
        worker.terminate()
    assert cli.main(["health", "--timeout", "2", worker.address]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_health_over_tls_uses_the_tls_settings(start_ps, tmp_path, monkeypatch):
    pytest.importorskip("cryptography", reason="cryptography is not installed")
    from psserver.tls import generate_self_signed
    tls = generate_self_signed(str(tmp_path))
    ps = start_ps(env=tls.env())
    for k in tls.env():
        monkeypatch.delenv(k, raising=False)
    assert cli.check_health(ps.address, timeout=2)[0] is False          # plaintext: refused
    assert cli.check_health(ps.address, timeout=10, environ=tls.env()) == (True, "SERVING")


# -- coordinator task / run: real processes --------------------------------------------------
@pytest.mark.timeout(60)
def test_task_starts_the_task_of_its_ordinal(tmp_path):
    ports = [free_port(), free_port()]
    cfg = tmp_path / "tf_config.json"
    cfg.write_text(json.dumps({"cluster": {"ps": [f"127.0.0.1:{p}" for p in ports],
                                           "worker": ["127.0.0.1:1"]}}))
    t = start_task("coordinator", ["task", "--type", "ps", "--hostname", "ps-1",
                                   "--host", "127.0.0.1", "--", "--grace", "1"],
                   env={"TF_CONFIG_FILE": str(cfg)})
    try:
        assert t.role == "psserver" and t.address == f"127.0.0.1:{ports[1]}"
        assert cli.check_health(t.address) == (True, "SERVING")
        assert t.output().startswith("coordinator: starting ps 1:")
    finally:
        assert t.terminate() == 0     # exec'd: SIGTERM reaches psserver, which exits 0
    r = subprocess.run([sys.executable, "-m", "coordinator", "task", "--type", "worker",
                        "--hostname", "worker-3"], env=child_env({"TF_CONFIG_FILE": str(cfg)}),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "worker:3 is not in the cluster's 1 worker" in r.stderr


TINY_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from coordinator import (ClusterCoordinator, ParameterServerStrategy,
                             TFConfigClusterResolver, push_gradients, read_variables)

    strategy = ParameterServerStrategy(TFConfigClusterResolver())
    v = strategy.create_variable("deploy_test_v", shape=(3,), initializer="ones",
                                 optimizer="sgd", optimizer_params={"learning_rate": 1.0})

    def step(g):   # defined in __main__: goes to the worker by value
        push_gradients([(v, np.full(3, g, "float32"))])
        return float(read_variables([v])[0].sum())

    with ClusterCoordinator(strategy) as coord:
        print("RESULT", coord.schedule(step, args=(0.5,)).fetch(), "ARGV", sys.argv[1:],
              "NAME", __name__, flush=True)
    strategy.delete_variable(v)
""")


@pytest.mark.timeout(90)
def test_run_trains_a_script_on_the_cluster_in_tf_config_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_SCRIPT)
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        cfg = tmp_path / "tf_config.json"
        cfg.write_text(json.dumps({"cluster": cluster.snapshot().as_dict()}))
        env = child_env({"TF_CONFIG_FILE": str(cfg), "PSTRAIN_AUTH_TOKEN": cluster.token,
                         **tls_env(cluster)})
        env.pop("TF_CONFIG", None)
        r = subprocess.run([sys.executable, "-m", "coordinator", "run", "--wait-ready", "30",
                            str(path), "--flag", "x"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESULT 1.5 ARGV ['--flag', 'x'] NAME __main__" in r.stdout, r.stdout + r.stderr
    assert "worker 0 at" in r.stderr and "is serving" in r.stderr


@pytest.mark.timeout(120)
def test_run_digits_on_an_existing_cluster_with_worker_discovery(tmp_path):
    """The compose coordinator's command: ps in TF_CONFIG, workers found by DNS."""
    with LocalCluster(num_ps=2, num_workers=1) as cluster:
        spec = cluster.snapshot()
        worker_port = spec.worker[0].rsplit(":", 1)[1]
        env = child_env({"TF_CONFIG": json.dumps({"cluster": {"ps": list(spec.ps)}}),
                         "PSTRAIN_AUTH_TOKEN": cluster.token, **tls_env(cluster)})
        env.pop("TF_CONFIG_FILE", None)
        env.pop("PYTHONPATH", None)   # the example makes the repository importable itself
        r = subprocess.run(
            [sys.executable, "-m", "coordinator", "run", "--wait-ready", "30",
             "--worker-dns", f"localhost:{worker_port}",
             os.path.join(ROOT, "examples", "digits.py"), "--cluster", "tf_config",
             "--epochs", "2", "--steps-per-epoch", "50"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
        assert r.returncode == 0, r.stdout + r.stderr
        # It leaves the shared parameter servers as it found them.
        for addr in spec.ps:
            with PSClient(addr, token=cluster.token,
                          **({"tls": cluster.tls} if getattr(cluster, "tls", None) else {})) as c:
                assert c.list_variables() == []
    assert f"workers now ['127.0.0.1:{worker_port}']" in r.stderr
    assert "2 ps, 1 worker, 100 steps" in r.stdout   # (issue 35 item 12: "1 workers") and "epoch 2/2  steps 100/100" in r.stdout
    acc = float(r.stdout.strip().splitlines()[-1].split(":")[1])
    assert acc >= 0.85, r.stdout
