"""k8s/: every overlay renders with kustomize, validates strictly against the Kubernetes schemas, and says
what kvfleet's processes really do (entry points, flags, probe endpoints, drain timing, secrets)."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from deploy_checks import OVERLAYS, REPO, check_command, containers, find, flag_values, one, render

from shared.settings import ENV_PREFIX, Settings

pytestmark = pytest.mark.deploy

K8S_VERSIONS = ("1.30.0", "1.34.0")  # oldest supported line we target, and a recent one
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}  # CRDs: tests/deploy/test_keda.py checks them
SECRET_KEYS = {"redis-password", "api-keys"}
# KVFLEET_* variables the manifests set that shared/settings.py does not read yet (asked of the worker
# engineer: the health server must bind KVFLEET_METRICS_HOST, default 127.0.0.1).
PENDING_SETTINGS = {"KVFLEET_METRICS_HOST"}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_resource_passes_strict_schema_validation(overlay, version):
    resources = render(overlay)
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= {
        r["kind"] for r in resources}
    for r in resources:
        if r["kind"] in KEDA_KINDS:
            continue
        try:
            kubernetes_validate.validate(r, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{overlay}: {r['kind']}/{r['metadata']['name']} invalid for {version}: "
                                 f"{e.message} at {list(e.path)}") from None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_kvfleet_namespace(overlay):
    for r in render(overlay):
        if r["kind"] != "Namespace":
            assert r["metadata"].get("namespace") == "kvfleet", f"{r['kind']}/{r['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_real_entry_points_with_real_flags(overlay):
    kinds = {}
    for owner, c in containers(render(overlay)):
        if owner["metadata"]["name"] == "kvfleet-redis":  # a shell writes the password's config file first
            assert c["command"][:2] == ["sh", "-c"] and "exec redis-server " in c["command"][2]
            assert c["args"][:2] == ["--appendonly", "yes"]
            continue
        assert "command" not in c, "keep the image's tini entrypoint: set args only"
        kinds[owner["metadata"]["name"]] = check_command(c["args"])
    assert kinds == {"kvfleet-gateway": "gateway", "kvfleet-worker": "worker", "kvfleet-celery": "celery"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_the_real_endpoints_on_the_served_ports(overlay):
    resources = render(overlay)
    gw = one(resources, "Deployment", "kvfleet-gateway")["spec"]["template"]["spec"]["containers"][0]
    wk = one(resources, "Deployment", "kvfleet-worker")["spec"]["template"]["spec"]["containers"][0]
    for c, port_flag, ready, live in ((gw, "--port", "/health", "/livez"), (wk, "--metrics-port", "/readyz", "/livez")):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        served = int(flag_values(c["args"])[port_flag])
        for probe, path in (("readinessProbe", ready), ("livenessProbe", live), ("startupProbe", live)):
            get = c[probe]["httpGet"]
            assert get["path"] == path, f"{c['name']} {probe}"
            assert ports[get["port"]] == served, f"{c['name']} {probe} probes a port the process does not serve"
    assert {e["name"]: e["value"] for e in wk["env"] if "value" in e}["KVFLEET_METRICS_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_plus_drain(overlay):
    resources = render(overlay)
    for name in ("kvfleet-worker", "kvfleet-gateway"):
        spec = one(resources, "Deployment", name)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        prestop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert prestop[0] == "sleep"
        drain = float(flag_values(c["args"]).get("--drain-timeout", 0))
        assert spec["terminationGracePeriodSeconds"] >= int(prestop[1]) + drain + 5, name
    worker = one(resources, "Deployment", "kvfleet-worker")["spec"]["template"]["spec"]["containers"][0]
    assert float(flag_values(worker["args"])["--drain-timeout"]) == 30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_resolve_and_settings_exist(overlay):
    resources = render(overlay)
    configmap = one(resources, "ConfigMap", "kvfleet-config")["data"]
    fields = {ENV_PREFIX + f.upper() for f in Settings.__dataclass_fields__}
    for owner, c in containers(resources):
        known = set()
        for src in c.get("envFrom", []):
            assert src["configMapRef"]["name"] == "kvfleet-config"
            known |= set(configmap)
        for e in c.get("env", []):
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in known, f"{owner['metadata']['name']}: {e['name']} uses $({ref}) before it is set"
            known.add(e["name"])
        for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
            assert ref in known, f"{owner['metadata']['name']}: args use $({ref}), which is not set"
        for name in known:
            if name.startswith(ENV_PREFIX):
                assert name in fields | PENDING_SETTINGS, f"{name} is not a shared.settings.Settings field"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_hold_redis_password_and_api_keys(overlay):
    resources = render(overlay)
    used = set()
    for _owner, c in containers(resources):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "kvfleet-secrets"
                used.add(ref["key"])
    assert used == SECRET_KEYS
    secrets = find(resources, "Secret")
    if overlay == "cpu-dev":  # throw-away values generated by the overlay
        assert set(one(resources, "Secret", "kvfleet-secrets")["data"]) == SECRET_KEYS
    else:  # production: created out of band (README "Deploy"), never committed
        assert secrets == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_requests_and_gpu_limits(overlay):
    resources = render(overlay)
    for owner, c in containers(resources):
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), owner["metadata"]["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert owner["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    worker = one(resources, "Deployment", "kvfleet-worker")["spec"]["template"]["spec"]["containers"][0]
    flags = flag_values(worker["args"])
    device, ranks = flags["--device"], int(flags.get("--tensor-parallel-size", 1))
    if overlay.startswith("gpu"):  # one GPU per tensor-parallel rank, all in the worker's pod
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == ranks and device == "cuda"
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == ranks
        assert worker["image"].startswith("kvfleet-worker-gpu:")
        if ranks > 1:  # the ranks' processes share tensors through /dev/shm (64 MiB in a pod by default)
            mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
            volumes = {v["name"]: v for v in one(resources, "Deployment", "kvfleet-worker")["spec"]["template"]
                       ["spec"]["volumes"]}
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    else:
        assert "nvidia.com/gpu" not in worker["resources"].get("limits", {}) and device == "cpu"
        assert worker["image"].startswith("kvfleet-worker-cpu:")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_pdbs_select_real_pods(overlay):
    resources = render(overlay)
    pods = [(r["spec"]["template"]["metadata"]["labels"], r["spec"]["template"]["spec"]["containers"])
            for r in resources if r["kind"] in ("Deployment", "StatefulSet")]

    def matching(selector):
        return [cs for labels, cs in pods if selector.items() <= labels.items()]

    for svc in find(resources, "Service"):
        (cs,) = matching(svc["spec"]["selector"])
        port_names = {p["name"] for c in cs for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names, svc["metadata"]["name"]
    for pdb in find(resources, "PodDisruptionBudget"):
        assert len(matching(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]
    assert one(resources, "Service", "kvfleet-gateway")["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_exposes_only_the_gateway(overlay):
    resources = render(overlay)
    policies = {p["metadata"]["name"]: p["spec"] for p in find(resources, "NetworkPolicy")}
    deny = policies["kvfleet-default-deny"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    open_to_all = [n for n, p in policies.items() for rule in p.get("ingress", []) if "from" not in rule]
    assert open_to_all == ["kvfleet-gateway"]
    assert [r["ports"] for r in policies["kvfleet-gateway"]["ingress"]] == [[{"port": 8000, "protocol": "TCP"}]]
    for name in ("kvfleet-worker", "kvfleet-celery"):
        for rule in policies[name]["egress"]:
            (peer,) = rule["to"]
            ports = {p["port"] for p in rule["ports"]}
            if "namespaceSelector" not in peer:
                assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
                assert ports == {6379}
            else:
                ns = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                assert (ns, ports) in [("kube-system", {53}), ("observability", {4317, 4318})], (name, ns, ports)
    worker_in = policies["kvfleet-worker"]["ingress"]
    assert [r["ports"] for r in worker_in] == [[{"port": 9100, "protocol": "TCP"}]]
    assert policies["kvfleet-redis"]["egress"] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset_persists_with_aof(overlay):
    resources = render(overlay)
    sts = one(resources, "StatefulSet", "kvfleet-redis")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--appendfsync" in args
    data_dir = args[args.index("--dir") + 1]
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": data_dir} in c["volumeMounts"]
    image = c["image"]
    assert image.startswith("redis:7."), "KEDA's lag trigger (scale to zero) needs Redis >= 7"
    # The URL the kvfleet processes use points at this Service.
    for owner, k in containers(resources):
        urls = [e["value"] for e in k.get("env", []) if e["name"] == "KVFLEET_REDIS_URL"]
        if owner["metadata"]["name"] != "kvfleet-redis":
            assert urls == ["redis://:$(REDIS_PASSWORD)@kvfleet-redis:6379/0"]


def test_hpa_metrics_are_what_prometheus_adapter_serves():
    resources = render("gpu-hpa")
    hpa = one(resources, "HorizontalPodAutoscaler", "kvfleet-worker")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvfleet-worker"}
    assert hpa["minReplicas"] >= 1
    assert "replicas" not in one(resources, "Deployment", "kvfleet-worker")["spec"], "the HPA owns replicas"
    values = yaml.safe_load((REPO / "k8s/components/hpa-prometheus/prometheus-adapter-values.yaml").read_text())
    served = set()
    for rule in values["rules"]["custom"]:
        series = rule["seriesQuery"].split("{")[0]
        pattern, rename = rule["name"]["matches"], rule["name"]["as"]
        served.add(re.sub(pattern, rename.replace("${1}", r"\1"), series))
    used = {m["pods"]["metric"]["name"] for m in hpa["metrics"]}
    assert used == served == {"vllm_num_requests_waiting", "vllm_kv_cache_usage_perc"}
    assert not find(resources, "ScaledObject")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_memory_is_capped_without_eviction_below_its_limit(overlay):
    c = one(render(overlay), "StatefulSet", "kvfleet-redis")["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction", "eviction would drop queued requests"
    cap = args[args.index("--maxmemory") + 1]
    assert re.fullmatch(r"\d+gb", cap)
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(cap[:-2]) * 1000**3 < int(limit[:-2]) * 1024**3, "room for the AOF fork"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_admits_only_the_fleet_and_keda(overlay):
    policy = one(render(overlay), "NetworkPolicy", "kvfleet-redis")["spec"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    pods = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rule["from"] if "podSelector" in p}
    namespaces = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"]
                  if "namespaceSelector" in p]
    assert pods == {"gateway", "worker", "celery"} and namespaces == ["keda"]
    assert all("podSelector" in p or "namespaceSelector" in p for p in rule["from"]), "no rule open to all"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_opens_only_metrics_to_the_keyless_scraper(overlay):
    resources = render(overlay)
    gateway = one(resources, "Deployment", "kvfleet-gateway")
    c = gateway["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVFLEET_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "kvfleet-secrets", "key": "api-keys"}
    assert env["KVFLEET_METRICS_OPEN"]["value"] == "1"
    assert gateway["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
