"""Kubernetes as it is done now: deploy/jobset/ (a JobSet) and deploy/trainer/
(a Kubeflow Trainer v2 ClusterTrainingRuntime and TrainJob).

Offline only: no cluster, no JobSet or Trainer controller. Checked here:

* every field used is one the API has: the field paths of the JobSet and
  Trainer CRDs (read from the upstream versions named below, kept here as
  plain data), their enums, and the webhooks' rules that a manifest alone
  decides; the Job templates inside are checked against the Kubernetes schema
  (kubernetes-validate, as tests/integration/test_deploy.py does);
* the job is the base's job (deploy/*.yaml): success = the coordinator's,
  order ps -> worker -> coordinator, one image, the token from the Secret,
  ports, probes, security contexts, volumes;
* TF_CONFIG names the pods by the DNS names JobSet gives them
  (<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>), and every task
  finds its own index and port in it (with coordinator.cli's own code);
* the TrainJob names the ClusterTrainingRuntime, whose template is the JobSet;
* `kubectl kustomize` renders both directories (skipped without kubectl).

Every check is a function that raises AssertionError; test_each_check_can_fail
breaks the manifests one way at a time and expects it to.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from coordinator import cli  # noqa: E402
from coordinator.cluster_spec import parse_tf_config  # noqa: E402

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

DEPLOY = os.path.join(ROOT, "deploy")
JOBSET_DIR = os.path.join(DEPLOY, "jobset")
TRAINER_DIR = os.path.join(DEPLOY, "trainer")
K8S_VERSION = "1.31.0"   # as tests/integration/test_deploy.py
PORT, DATA_PORT, METRICS_PORT = 2222, 2223, 9100
ROLES = ("ps", "worker", "coordinator")            # the replicated jobs, in start order
TASK_CONTAINERS = {"ps": "psserver", "worker": "psworker"}

# -- What the APIs have (plain data, read from upstream; do not edit to make a test pass) --
#
# JobSet v0.12.0 (kubernetes-sigs/jobset, tag v0.12.0):
#   config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml, version v1alpha2:
#   the field paths of .spec down to each replicated job's Job template, whose
#   .spec is batch/v1's JobSpec (checked with kubernetes-validate) and whose
#   metadata, like the pod template's, keeps only JOB_TEMPLATE_METADATA.
#   (spec.volumeClaimPolicies is left out: not used.)
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_SPEC_FIELDS = frozenset({
    "replicatedJobs", "replicatedJobs[].name", "replicatedJobs[].groupName",
    "replicatedJobs[].replicas", "replicatedJobs[].dependsOn",
    "replicatedJobs[].dependsOn[].name", "replicatedJobs[].dependsOn[].status",
    "replicatedJobs[].template", "replicatedJobs[].template.metadata",
    "replicatedJobs[].template.metadata.annotations",
    "replicatedJobs[].template.metadata.finalizers",
    "replicatedJobs[].template.metadata.labels",
    "replicatedJobs[].template.metadata.name",
    "replicatedJobs[].template.metadata.namespace",
    "replicatedJobs[].template.spec",
    "network", "network.enableDNSHostnames", "network.subdomain",
    "network.publishNotReadyAddresses",
    "successPolicy", "successPolicy.operator", "successPolicy.targetReplicatedJobs",
    "failurePolicy", "failurePolicy.maxRestarts", "failurePolicy.restartStrategy",
    "failurePolicy.rules", "failurePolicy.rules[].name", "failurePolicy.rules[].action",
    "failurePolicy.rules[].onJobFailureReasons",
    "failurePolicy.rules[].onJobFailureMessagePatterns",
    "failurePolicy.rules[].targetReplicatedJobs",
    "startupPolicy", "startupPolicy.startupPolicyOrder",
    "suspend", "coordinator", "coordinator.replicatedJob", "coordinator.jobIndex",
    "coordinator.podIndex", "managedBy", "ttlSecondsAfterFinished",
})
JOBSET_ENUMS = {
    "successPolicy.operator": {"All", "Any"},
    "startupPolicy.startupPolicyOrder": {"AnyOrder", "InOrder"},
    "failurePolicy.restartStrategy": {"Recreate", "BlockingRecreate", "InPlaceRestart"},
    "failurePolicy.rules[].action": {"FailJobSet", "RestartJobSet",
                                     "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                                     "RestartJobAndIgnoreMaxRestarts"},
    "replicatedJobs[].dependsOn[].status": {"Ready", "Complete"},
}
# The Job template's spec keys in that CRD (batch/v1 JobSpec) and the metadata it keeps.
JOB_SPEC_FIELDS = frozenset({
    "activeDeadlineSeconds", "backoffLimit", "backoffLimitPerIndex", "completionMode",
    "completions", "managedBy", "manualSelector", "maxFailedIndexes", "parallelism",
    "podFailurePolicy", "podReplacementPolicy", "selector", "successPolicy", "suspend",
    "template", "ttlSecondsAfterFinished"})
JOB_TEMPLATE_METADATA = frozenset({"annotations", "finalizers", "labels", "name", "namespace"})
# JobSet's webhook (pkg/webhooks/jobset_webhook.go, v0.12.0) and feature gates
# (pkg/features/features.go): rule names, the job failure reasons it accepts,
# and what needs an alpha gate that is off by default.
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                       "MaxFailedIndexesExceeded", "PodFailurePolicy"}
ALPHA_GATED = {"failurePolicy.rules[].action": {"RestartJob", "RestartJobAndIgnoreMaxRestarts"},
               "failurePolicy.restartStrategy": {"InPlaceRestart"}}
# api/jobset/v1alpha2/jobset_types.go: the label on every pod, and the pod DNS name.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# Kubeflow Trainer v2.3.0 (kubeflow/trainer, tag v2.3.0):
#   manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml and
#   trainer.kubeflow.org_trainjobs.yaml, version v1alpha1. The runtime's
#   template.spec is JobSet v0.12.0's spec (the same field list: Trainer v2.3.0
#   builds on sigs.k8s.io/jobset v0.12.0).
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
MLPOLICY_FRAMEWORKS = {"torch", "mpi", "jax", "xgboost", "flux"}
RUNTIME_SPEC_FIELDS = frozenset({
    "mlPolicy", "mlPolicy.numNodes", "mlPolicy.torch", "mlPolicy.torch.envInjection",
    "mlPolicy.torch.envInjection.targets", "mlPolicy.torch.envInjection.targets[].jobName",
    "mlPolicy.torch.envInjection.targets[].containerNames", "mlPolicy.mpi",
    "mlPolicy.mpi.numProcPerNode", "mlPolicy.mpi.mpiImplementation",
    "mlPolicy.mpi.sshAuthMountPath", "mlPolicy.mpi.runLauncherAsNode", "mlPolicy.jax",
    "mlPolicy.xgboost", "mlPolicy.flux", "mlPolicy.flux.numProcPerNode",
    "podGroupPolicy", "podGroupPolicy.coscheduling",
    "podGroupPolicy.coscheduling.scheduleTimeoutSeconds", "podGroupPolicy.volcano",
    "template", "template.metadata", "template.metadata.annotations",
    "template.metadata.finalizers", "template.metadata.labels", "template.metadata.name",
    "template.metadata.namespace", "template.spec",
}) | {f"template.spec.{f}" for f in JOBSET_SPEC_FIELDS}
TRAINJOB_SPEC_FIELDS = frozenset({
    "runtimeRef", "runtimeRef.name", "runtimeRef.apiGroup", "runtimeRef.kind",
    "initializer", "trainer", "trainer.image", "trainer.command", "trainer.args",
    "trainer.env", "trainer.numNodes", "trainer.resourcesPerNode", "trainer.numProcPerNode",
    "runtimePatches", "suspend", "activeDeadlineSeconds", "managedBy",
})
# Trainer's runtime webhook (pkg/webhooks/trainingruntime_webhook.go) and
# JobSet builder (pkg/runtime/framework/plugins/jobset/builder.go), v2.3.0: the
# trainer role is the replicated job with this label; it must have replicas 1
# and a container named "node", the one a TrainJob's spec.trainer overrides.
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_CONTAINER = "node"


# -- loading -------------------------------------------------------------------------------
def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(path, kind):
    (doc,) = [d for d in load_all(path) if d["kind"] == kind]
    return doc


def manifests():
    """The documents this test checks, fresh copies (the mutations edit them)."""
    return {"jobset": one(os.path.join(JOBSET_DIR, "jobset.yaml"), "JobSet"),
            "runtime": one(os.path.join(TRAINER_DIR, "runtime.yaml"), "ClusterTrainingRuntime"),
            "trainjob": one(os.path.join(TRAINER_DIR, "trainjob.yaml"), "TrainJob")}


def base():
    """The base's resources (deploy/*.yaml) by (kind, name)."""
    out = {}
    for name in sorted(os.listdir(DEPLOY)):
        if name.endswith(".yaml") and name != "kustomization.yaml":
            for d in load_all(os.path.join(DEPLOY, name)):
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


# -- helpers -------------------------------------------------------------------------------
def field_paths(node, prefix="", leaves=frozenset()):
    """Every field path in node ("a.b[].c"), not descending into the paths in leaves."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            if path not in leaves:
                yield from field_paths(value, path, leaves)
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, (dict, list)):
                yield from field_paths(item, prefix + "[]", leaves)


def values_at(node, path):
    """The values at a field path ("a.b[].c"), over every list element."""
    nodes = [node]
    for part in path.split("."):
        many = part.endswith("[]")
        key = part[:-2] if many else part
        nodes = [n[key] for n in nodes if isinstance(n, dict) and key in n]
        if many:
            nodes = [item for n in nodes for item in n]
    return nodes


def rjobs(spec):
    return {r["name"]: r for r in spec["replicatedJobs"]}


def pod_spec(rjob):
    return rjob["template"]["spec"]["template"]["spec"]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def expand(text, variables):
    """Kubernetes' $(VAR) expansion in env values and commands ($$ aside)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: str(variables.get(m.group(1), m.group(0))), text)


def pod_count(rjob):
    job = rjob["template"]["spec"]
    return job.get("completions", job.get("parallelism", 1))


def dns_names(spec, jobset_name, rjob_name):
    """The hostnames JobSet gives a replicated job's pods, in task order."""
    rjob = rjobs(spec)[rjob_name]
    subdomain = (spec.get("network") or {}).get("subdomain") or jobset_name
    return [f"{jobset_name}-{rjob_name}-{j}-{p}.{subdomain}"
            for j in range(rjob.get("replicas", 1)) for p in range(pod_count(rjob))]


def startup_order(spec):
    """The order the replicated jobs start in: startupPolicy InOrder (list order), or a
    dependsOn chain in which each one waits for the one before it to be Ready."""
    names = [r["name"] for r in spec["replicatedJobs"]]
    uses_depends_on = any("dependsOn" in r for r in spec["replicatedJobs"])
    in_order = (spec.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
    assert not (in_order and uses_depends_on), \
        "startupPolicy InOrder and dependsOn may not be combined (JobSet's CEL rule)"
    if in_order:
        return names
    assert "dependsOn" not in spec["replicatedJobs"][0], \
        "the first replicated job cannot use dependsOn (JobSet's webhook)"
    for before, r in zip(spec["replicatedJobs"], spec["replicatedJobs"][1:]):
        assert r.get("dependsOn") == [{"name": before["name"], "status": "Ready"}], \
            f"{r['name']} does not wait for {before['name']} to be Ready: {r.get('dependsOn')}"
    return names


# -- checks (each raises AssertionError) ---------------------------------------------------
def check_fields(doc, api_version, kind, allowed, leaves, enums=None, gated=None):
    assert (doc["apiVersion"], doc["kind"]) == (api_version, kind), (doc["apiVersion"], doc["kind"])
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    unknown = sorted(set(field_paths(doc["spec"], "", leaves)) - allowed)
    assert not unknown, f"{kind}: not fields of the API: {unknown}"
    for path, values in (enums or {}).items():
        bad = [v for v in values_at(doc["spec"], path) if v not in values]
        assert not bad, f"{kind}: {path}: {bad} not in {sorted(values)}"
    for path, values in (gated or {}).items():
        used = [v for v in values_at(doc["spec"], path) if v in values]
        assert not used, f"{kind}: {path}: {used} needs an alpha feature gate (off by default)"


def check_jobset_fields(spec, prefix, doc, allowed, kind, api):
    leaves = {f"{prefix}replicatedJobs[].template.spec",
              f"{prefix}replicatedJobs[].template.metadata.labels",
              f"{prefix}replicatedJobs[].template.metadata.annotations"}
    check_fields(doc, api, kind, allowed, leaves,
                 {prefix + p: v for p, v in JOBSET_ENUMS.items()},
                 {prefix + p: v for p, v in ALPHA_GATED.items()})
    for r in spec["replicatedJobs"]:
        job = r["template"]["spec"]
        assert set(job) <= JOB_SPEC_FIELDS, (r["name"], sorted(set(job) - JOB_SPEC_FIELDS))
        assert set(r["template"].get("metadata", {})) <= JOB_TEMPLATE_METADATA, r["name"]
        assert set(job["template"].get("metadata", {})) <= JOB_TEMPLATE_METADATA, r["name"]


def check_jobset_webhook_rules(spec, jobset_name):
    """What JobSet's webhook (v0.12.0) rejects, as far as the manifest decides it."""
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert len(set(names)) == len(names), names
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs", []):
        assert target in names, f"successPolicy targets {target!r}, not a replicated job"
    rules = (spec.get("failurePolicy") or {}).get("rules", [])
    rule_names = [r["name"] for r in rules]
    assert len(set(rule_names)) == len(rule_names), rule_names
    for rule in rules:
        assert RULE_NAME.match(rule["name"]) and len(rule["name"]) <= 128, rule["name"]
        assert set(rule.get("onJobFailureReasons", [])) <= JOB_FAILURE_REASONS, rule
        assert set(rule.get("targetReplicatedJobs", [])) <= set(names), rule
    for r in spec["replicatedJobs"]:
        longest = f"{jobset_name}-{r['name']}-{r.get('replicas', 1) - 1}-{pod_count(r) - 1}-abcde"
        assert len(longest) <= 63 and DNS_1035.match(longest), f"pod name too long: {longest}"


def check_jobs(spec):
    """Each Job: Indexed, its pods recreated when they fail (and only then)."""
    for name, r in rjobs(spec).items():
        job, pod = r["template"]["spec"], pod_spec(r)
        assert job.get("completionMode") == "Indexed", name
        assert job.get("parallelism") == job.get("completions"), name
        assert job.get("backoffLimit", 6) >= 1, name
        if "podFailurePolicy" in job:   # Kubernetes' Job validation
            assert pod.get("restartPolicy") == "Never", (name, pod.get("restartPolicy"))
            assert job.get("podReplacementPolicy") == "Failed", name
            rules = job["podFailurePolicy"]["rules"]
            assert any(rule["action"] == "Ignore" and {"type": "DisruptionTarget", "status": "True"}
                       in rule.get("onPodConditions", []) for rule in rules), \
                f"{name}: an evicted or preempted pod should not use up backoffLimit"
        if name in TASK_CONTAINERS:
            # One Job of N pods: a task's index is the pod's completion index.
            assert r.get("replicas", 1) == 1, name
    policy = spec["failurePolicy"]
    assert policy.get("maxRestarts", 0) >= 1, "a failed Job should restart the JobSet"


def check_jobset_is_the_base_job(spec, coordinator_container="coordinator"):
    """The same job as deploy/ps.yaml, worker.yaml, coordinator-job.yaml."""
    b = base()
    assert startup_order(spec) == list(ROLES)
    success = spec["successPolicy"]
    assert success == {"operator": "All", "targetReplicatedJobs": ["coordinator"]}, success
    assert spec["network"]["enableDNSHostnames"] is True

    secret = b[("Secret", "pstrain-auth")]
    pvcs = {n for (k, n) in b if k == "PersistentVolumeClaim"}
    (policy,) = [d for (k, _), d in b.items() if k == "NetworkPolicy"]
    base_pods = {"ps": b[("StatefulSet", "ps")], "worker": b[("StatefulSet", "worker")],
                 "coordinator": b[("Job", "pstrain-coordinator")]}
    images = set()
    for name, r in rjobs(spec).items():
        pod, base_pod = pod_spec(r), base_pods[name]["spec"]["template"]["spec"]
        labels = r["template"]["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), name
        assert pod["securityContext"] == base_pod["securityContext"], name
        assert pod.get("automountServiceAccountToken") is False, name
        (c,) = pod["containers"]
        (base_c,) = base_pod["containers"]
        want = TASK_CONTAINERS.get(name, coordinator_container)
        assert c["name"] == want, (name, c["name"], want)
        images.add(c["image"])
        assert c["image"] == base_c["image"], (name, c["image"])
        assert c["securityContext"] == base_c["securityContext"], name
        assert c["resources"] == base_c["resources"], name
        env = env_of(c)
        ref = env["PSTRAIN_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}, (name, ref)
        assert "token" in secret["stringData"]
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, (name, m["name"])
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, name
            if "secret" in v:
                assert v["secret"]["secretName"] == secret["metadata"]["name"], name
        if name in TASK_CONTAINERS:
            want_ports = {"grpc": PORT, "data": DATA_PORT, "metrics": METRICS_PORT}
            assert ports == want_ports, (name, ports)
            cmd = c["command"]
            assert cmd[cmd.index("--data-port") + 1] == str(DATA_PORT), name
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c.get(probe) == base_c[probe], (name, probe)
                assert c[probe]["grpc"]["port"] == PORT, (name, probe)
        else:
            assert ports == {"metrics": METRICS_PORT}, ports
            assert c["command"][:2] == ["coordinator", "run"], c["command"]
            assert "examples/digits.py" in c["command"]
            assert any(m["mountPath"] == "/checkpoints" for m in c["volumeMounts"])
    assert len(images) == 1, f"one image for every role: {sorted(images)}"


def check_tf_config(spec, jobset_name):
    """TF_CONFIG lists the pods by their JobSet DNS names; each task finds itself in it."""
    configs = set()
    for name, r in rjobs(spec).items():
        (c,) = pod_spec(r)["containers"]
        env = env_of(c)
        order = [e["name"] for e in c["env"]]
        assert "TF_CONFIG_FILE" not in env, name   # it would win over TF_CONFIG
        field = env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == f"metadata.labels['{JOBSET_NAME_LABEL}']", (name, field)
        assert order.index("JOBSET_NAME") < order.index("TF_CONFIG"), \
            f"{name}: $(JOBSET_NAME) expands only in env entries after it"
        text = expand(env["TF_CONFIG"]["value"], {"JOBSET_NAME": jobset_name})
        configs.add(text)
        cluster, task = parse_tf_config(text)   # pstrain's own parser
        assert task is None, name                # `coordinator task` adds it; `run` is the chief
        for role in TASK_CONTAINERS:
            want = [f"{host}:{PORT}" for host in dns_names(spec, jobset_name, role)]
            assert list(getattr(cluster, role)) == want, (name, role, getattr(cluster, role), want)
        if name in TASK_CONTAINERS:
            cmd = c["command"]
            assert cmd[:4] == ["coordinator", "task", "--type", name], cmd
            assert cmd[cmd.index("--index") + 1] == "$(JOB_COMPLETION_INDEX)", cmd
            for index, host in enumerate(dns_names(spec, jobset_name, name)):
                # The completion index, and the hostname's number that `coordinator task`
                # falls back on, are both the task's place in TF_CONFIG...
                assert cli.ordinal(host) == index, host
                # ...where it finds the port it serves on.
                argv, _ = cli.task_command(text, name, index)
                assert argv[argv.index("--port") + 1] == str(PORT), argv
    assert len(configs) == 1, "every container should see the same cluster"


def check_jobset(doc):
    spec = doc["spec"]
    check_jobset_fields(spec, "", doc, JOBSET_SPEC_FIELDS, "JobSet", JOBSET_API)
    check_jobset_webhook_rules(spec, doc["metadata"]["name"])
    check_jobs(spec)
    check_jobset_is_the_base_job(spec)
    check_tf_config(spec, doc["metadata"]["name"])


def check_trainer(runtime, trainjob, jobset):
    spec = runtime["spec"]
    template = spec["template"]["spec"]
    check_jobset_fields(template, "template.spec.", runtime, RUNTIME_SPEC_FIELDS,
                        "ClusterTrainingRuntime", TRAINER_API)
    check_fields(trainjob, TRAINER_API, "TrainJob", TRAINJOB_SPEC_FIELDS,
                 {"trainer.env", "trainer.resourcesPerNode", "initializer", "runtimePatches"})
    assert "namespace" not in runtime["metadata"], "a ClusterTrainingRuntime is cluster-scoped"

    # The trainer role: the coordinator, one pod, its container named "node".
    trainer_jobs = [r for r in template["replicatedJobs"]
                    if r["template"].get("metadata", {}).get("labels", {})
                    .get(TRAINER_ANCESTOR_LABEL) == "trainer"]
    assert [r["name"] for r in trainer_jobs] == ["coordinator"], [r["name"] for r in trainer_jobs]
    (coord,) = trainer_jobs
    assert coord.get("replicas") == 1, "Trainer's webhook: replicas of its roles must be 1"
    assert [c["name"] for c in pod_spec(coord)["containers"]] == [TRAINER_CONTAINER]
    policy = spec["mlPolicy"]
    assert not MLPOLICY_FRAMEWORKS & set(policy), "pstrain is no torch/mpi/jax/xgboost/flux job"
    assert policy["numNodes"] == 1 == pod_count(coord), "one coordinator (the chief)"

    # The template is the JobSet of deploy/jobset, but for Trainer's names.
    normal = copy.deepcopy(template)
    c = rjobs(normal)["coordinator"]
    del c["template"]["metadata"]["labels"][TRAINER_ANCESTOR_LABEL]
    pod_spec(c)["containers"][0]["name"] = "coordinator"
    assert normal == jobset["spec"], "runtime.yaml's template and jobset.yaml's spec differ"

    # The TrainJob uses it, as one coordinator, with the runtime's image.
    ref = trainjob["spec"]["runtimeRef"]
    assert ref["name"] == runtime["metadata"]["name"], (ref, runtime["metadata"]["name"])
    assert ref.get("kind", "ClusterTrainingRuntime") == "ClusterTrainingRuntime", ref
    assert ref.get("apiGroup", "trainer.kubeflow.org") == "trainer.kubeflow.org", ref
    trainer = trainjob["spec"]["trainer"]
    assert trainer.get("numNodes", policy["numNodes"]) == 1, trainer
    assert "image" not in trainer, "it would change the coordinator's image only"
    cmd = trainer["command"]
    assert cmd[:2] == ["coordinator", "run"] and "examples/digits.py" in cmd, cmd

    # Under Trainer the JobSet is named after the TrainJob.
    check_jobset_webhook_rules(template, trainjob["metadata"]["name"])
    check_jobs(template)
    check_jobset_is_the_base_job(template, coordinator_container=TRAINER_CONTAINER)
    check_tf_config(template, trainjob["metadata"]["name"])


# -- tests ---------------------------------------------------------------------------------
def test_jobset_is_the_base_job_with_jobset_names():
    check_jobset(manifests()["jobset"])


def test_trainer_runtime_is_the_jobset_and_the_trainjob_uses_it():
    m = manifests()
    check_trainer(m["runtime"], m["trainjob"], m["jobset"])


def job_objects():
    m = manifests()
    specs = {"jobset": (m["jobset"]["metadata"]["name"], m["jobset"]["spec"]),
             "runtime": (m["trainjob"]["metadata"]["name"],
                         m["runtime"]["spec"]["template"]["spec"])}
    for where, (name, spec) in specs.items():
        for r in spec["replicatedJobs"]:
            yield f"{where}/{r['name']}", {
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": f"{name}-{r['name']}-0", **r["template"].get("metadata", {})},
                "spec": r["template"]["spec"]}


def validate_job(job):
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install -e '.[test]'): the Job "
               "templates cannot be checked against the Kubernetes schemas")
    try:
        kv.validate(job, K8S_VERSION, strict=True)   # strict: unknown fields are errors
    except kv.ValidationError as exc:
        raise AssertionError(f"{job['metadata']['name']}: {exc.message} at "
                             f"{'.'.join(map(str, exc.path))}") from None


@pytest.mark.parametrize("where,job", list(job_objects()), ids=[w for w, _ in job_objects()])
def test_job_templates_validate_against_the_kubernetes_schemas(where, job):
    validate_job(job)


# The mutations: (what, document, change). Each must make a check fail.
def _set(path, value):
    def change(doc):
        *parents, last = path
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value
    return change


def _rjob(doc, name):
    spec = doc["spec"]
    if doc["kind"] == "ClusterTrainingRuntime":
        spec = spec["template"]["spec"]
    return rjobs(spec)[name]


def _container(doc, name):
    return pod_spec(_rjob(doc, name))["containers"][0]


def _swap_order(doc):
    spec = doc["spec"]
    spec["replicatedJobs"][1:] = spec["replicatedJobs"][2:0:-1]


def _drop_depends_on(doc):
    del _rjob(doc, "coordinator")["dependsOn"]


def _env_order(doc):
    env = _container(doc, "ps")["env"]
    env.append(env.pop(0))   # JOBSET_NAME last


def _wrong_ps_address(doc):
    e = env_of(_container(doc, "worker"))["TF_CONFIG"]
    e["value"] = e["value"].replace("-ps-0-1.", "-ps-1-0.")


def _wrong_subdomain(doc):
    for role in ROLES:
        e = env_of(_container(doc, role))["TF_CONFIG"]
        e["value"] = e["value"].replace(".$(JOBSET_NAME):", ".pstrain-svc:")


def _names_written_out(doc):
    # TF_CONFIG with the JobSet's name written in, then the JobSet renamed.
    for role in ROLES:
        e = env_of(_container(doc, role))["TF_CONFIG"]
        e["value"] = e["value"].replace("$(JOBSET_NAME)", doc["metadata"]["name"])
    doc["metadata"]["name"] += "-v2"


def _third_ps(doc):
    _rjob(doc, "ps")["template"]["spec"].update(parallelism=3, completions=3)


def _other_image(doc):
    _container(doc, "worker")["image"] = "pstrain:other"


def _other_secret(doc):
    env_of(_container(doc, "coordinator"))["PSTRAIN_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"][
        "name"] = "pstrain-token"


def _data_port(doc):
    for p in _container(doc, "ps")["ports"]:
        if p["name"] == "data":
            p["containerPort"] = 2224


def _no_probe(doc):
    del _container(doc, "worker")["readinessProbe"]


def _typo(doc):
    doc["spec"]["failurePolicy"]["maxRestart"] = doc["spec"]["failurePolicy"].pop("maxRestarts")


def _startup_policy_too(doc):
    doc["spec"]["startupPolicy"] = {"startupPolicyOrder": "InOrder"}


def _restart_policy(doc):
    pod_spec(_rjob(doc, "ps"))["restartPolicy"] = "OnFailure"


def _fixed_index(doc):
    cmd = _container(doc, "worker")["command"]
    i = cmd.index("--index")
    cmd[i + 1] = "0"


def _rule_name(doc):
    doc["spec"]["failurePolicy"]["rules"][0]["name"] = "configuration-error"


def _gated_action(doc):
    doc["spec"]["failurePolicy"]["rules"][1]["action"] = "RestartJob"


def _job_field_typo(doc):
    _rjob(doc, "ps")["template"]["spec"]["backofLimit"] = 6


def _coordinator_container(doc):
    _container(doc, "coordinator")["name"] = "coordinator"


def _torch(doc):
    doc["spec"]["mlPolicy"]["torch"] = {}


def _runtime_drift(doc):
    _container(doc, "ps")["resources"]["limits"]["memory"] = "8Gi"


def _trainjob_image(doc):
    doc["spec"]["trainer"]["image"] = "pstrain:0.2.0"


MUTATIONS = [
    ("success targets the workers", "jobset",
     _set(["spec", "successPolicy", "targetReplicatedJobs"], ["worker"])),
    ("success when any job succeeds", "jobset", _set(["spec", "successPolicy", "operator"], "Any")),
    ("an operator JobSet does not have", "jobset",
     _set(["spec", "successPolicy", "operator"], "Every")),
    ("coordinator listed before the workers", "jobset", _swap_order),
    ("coordinator does not wait", "jobset", _drop_depends_on),
    ("startupPolicy InOrder beside dependsOn", "jobset", _startup_policy_too),
    ("an unknown JobSet field", "jobset", _typo),
    ("a failure rule name JobSet refuses", "jobset", _rule_name),
    ("an alpha-gated failure action", "jobset", _gated_action),
    ("podFailurePolicy with restartPolicy OnFailure", "jobset", _restart_policy),
    ("a fixed task index", "jobset", _fixed_index),
    ("JOBSET_NAME after TF_CONFIG", "jobset", _env_order),
    ("a ps address JobSet does not give", "jobset", _wrong_ps_address),
    ("a subdomain JobSet does not make", "jobset", _wrong_subdomain),
    ("three ps pods, two addresses", "jobset", _third_ps),
    ("another image for the workers", "jobset", _other_image),
    ("the token from another secret", "jobset", _other_secret),
    ("the data port moved", "jobset", _data_port),
    ("a probe missing", "jobset", _no_probe),
    ("TF_CONFIG names another JobSet", "jobset", _names_written_out),
    ("a name too long for the pod names", "jobset", _set(["metadata", "name"], "pstrain-x" * 6)),
    ("another runtime", "trainjob", _set(["spec", "runtimeRef", "name"], "pstrain-v2")),
    ("a namespaced runtime kind", "trainjob",
     _set(["spec", "runtimeRef", "kind"], "TrainingRuntime")),
    ("two coordinators", "trainjob", _set(["spec", "trainer", "numNodes"], 2)),
    ("an image for the coordinator alone", "trainjob", _trainjob_image),
    ("an unknown TrainJob field", "trainjob", _set(["spec", "trainer", "nodes"], 1)),
    ("the trainer container not named node", "runtime", _coordinator_container),
    ("a torch policy", "runtime", _torch),
    ("runtime and JobSet drift apart", "runtime", _runtime_drift),
    ("an unknown runtime field", "runtime", _set(["spec", "mlPolicy", "numNode"], 1)),
]


def run_checks(m):
    check_jobset(m["jobset"])
    check_trainer(m["runtime"], m["trainjob"], m["jobset"])


@pytest.mark.parametrize("what,doc,change", MUTATIONS, ids=[w for w, _, _ in MUTATIONS])
def test_each_check_can_fail(what, doc, change):
    m = manifests()
    run_checks(m)          # as shipped: passes
    change(m[doc])
    with pytest.raises(AssertionError):
        run_checks(m)


def test_the_job_schema_check_can_fail():
    m = manifests()
    _job_field_typo(m["jobset"])
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "pstrain-ps-0"},
           "spec": _rjob(m["jobset"], "ps")["template"]["spec"]}
    with pytest.raises(AssertionError, match="backofLimit"):
        validate_job(job)


# -- kustomize -----------------------------------------------------------------------------
def render(directory):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` cannot render deploy/jobset "
                    "and deploy/trainer (the other checks read the files directly)")
    out = subprocess.run(["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone",
                          directory], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def base_image():
    with open(os.path.join(DEPLOY, "kustomization.yaml")) as f:
        (img,) = yaml.safe_load(f)["images"]
    return f"{img['name']}:{img['newTag']}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("directory,kinds", [
    (JOBSET_DIR, ["JobSet", "NetworkPolicy", "PersistentVolumeClaim", "Secret"]),
    (TRAINER_DIR, ["ClusterTrainingRuntime", "NetworkPolicy", "PersistentVolumeClaim", "Secret",
                   "TrainJob"]),
], ids=["jobset", "trainer"])
def test_kustomize_renders(directory, kinds):
    docs = render(directory)
    assert sorted(d["kind"] for d in docs) == kinds
    b = base()
    for d in docs:   # the base's own Secret, PVC and NetworkPolicy, unchanged
        if (d["kind"], d["metadata"]["name"]) in b:
            assert d == b[(d["kind"], d["metadata"]["name"])], d["kind"]
    by_kind = {d["kind"]: d for d in docs}
    spec = by_kind["JobSet"]["spec"] if "JobSet" in by_kind else \
        by_kind["ClusterTrainingRuntime"]["spec"]["template"]["spec"]
    images = {c["image"] for r in spec["replicatedJobs"] for c in pod_spec(r)["containers"]}
    assert images == {base_image()}, images   # the base's image and tag, for every role
    # As rendered, the checks still hold (the image tag aside).
    for r in spec["replicatedJobs"]:
        for c in pod_spec(r)["containers"]:
            c["image"] = "pstrain"
    if "JobSet" in by_kind:
        check_jobset(by_kind["JobSet"])
    else:
        check_trainer(by_kind["ClusterTrainingRuntime"], by_kind["TrainJob"],
                      manifests()["jobset"])


def test_overlays_leave_out_the_statefulsets():
    for directory in (JOBSET_DIR, TRAINER_DIR):
        with open(os.path.join(directory, "kustomization.yaml")) as f:
            kust = yaml.safe_load(f)
        listed = kust["resources"]
        assert {"../secret.yaml", "../pvc.yaml", "../networkpolicy.yaml"} <= set(listed)
        assert not {"..", "../ps.yaml", "../worker.yaml", "../coordinator-job.yaml"} & set(listed)
        assert kust["images"] == [{"name": "pstrain", "newTag": base_image().split(":")[1]}]
        on_disk = {p for p in os.listdir(directory) if p.endswith(".yaml")} - {"kustomization.yaml"}
        assert on_disk == {p for p in listed if not p.startswith("../")}, directory
