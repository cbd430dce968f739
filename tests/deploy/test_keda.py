"""KEDA autoscaling (k8s/components/keda, scale-to-zero). No KEDA CRD schema ships offline, so the
ScaledObject and TriggerAuthentication are checked against the fields of keda.sh/v1alpha1 written out
below (KEDA 2.x API reference), strictly, and against what kvfleet's Redis streams really are."""

from __future__ import annotations

import os

import jsonschema
import pytest
from deploy_checks import REPO, find, one, render

from shared import keys

pytestmark = pytest.mark.deploy

_INT = {"type": "integer", "minimum": 0}
_META = {"type": "object", "additionalProperties": False,
         "required": ["name"], "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                              "labels": {"type": "object"}, "annotations": {"type": "object"}}}
SCALED_OBJECT = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _META,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": _INT, "cooldownPeriod": _INT, "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT, "minReplicaCount": _INT, "maxReplicaCount": _INT,
                "fallback": {"type": "object"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}}},
                    "scalingModifiers": {"type": "object"}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "authenticationRef": {"type": "object", "additionalProperties": False,
                                              "required": ["name"],
                                              "properties": {"name": {"type": "string"},
                                                             "kind": {"enum": ["TriggerAuthentication",
                                                                               "ClusterTriggerAuthentication"]}}},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"}}}},
            }},
    },
}
TRIGGER_AUTHENTICATION = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "TriggerAuthentication"}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "secretTargetRef": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["parameter", "name", "key"],
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}},
            "env": {"type": "array"}, "podIdentity": {"type": "object"}}},
    },
}
# The redis-streams scaler's metadata keys (KEDA docs, "Redis Streams" scaler) and auth parameters.
REDIS_STREAMS_METADATA = {
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "usernameFromEnv",
    "passwordFromEnv", "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "activationStreamLength", "databaseIndex", "enableTLS", "unsafeSsl",
}
REDIS_AUTH_PARAMETERS = {"username", "password", "tls", "ca", "cert", "key"}


def _keda_resources(resources):
    return one(resources, "ScaledObject", "kvfleet-worker"), one(resources, "TriggerAuthentication", "kvfleet-redis")


def test_keda_resources_match_the_crd_fields():
    scaled, auth = _keda_resources(render("gpu"))
    jsonschema.validate(scaled, SCALED_OBJECT)
    jsonschema.validate(auth, TRIGGER_AUTHENTICATION)
    with pytest.raises(jsonschema.ValidationError):  # the schema is strict: a typo does not pass
        jsonschema.validate({**scaled, "spec": {**scaled["spec"], "minReplicas": 0}}, SCALED_OBJECT)


def test_scaledobject_scales_the_workers_on_the_shared_stream():
    resources = render("gpu")
    scaled, auth = _keda_resources(resources)
    spec = scaled["spec"]
    worker = one(resources, "Deployment", "kvfleet-worker")
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": worker["metadata"]["name"]}
    assert "replicas" not in worker["spec"], "KEDA owns the worker count"
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    redis_svc = one(resources, "Service", "kvfleet-redis")
    address = f"{redis_svc['metadata']['name']}.{redis_svc['metadata']['namespace']}.svc.cluster.local:6379"
    modes = set()
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert set(meta) <= REDIS_STREAMS_METADATA, set(meta) - REDIS_STREAMS_METADATA
        assert meta["address"] == address, "KEDA runs in its own namespace: use the Service's full name"
        assert meta["stream"] == keys.req_any() and meta["consumerGroup"] == keys.GROUP
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
        modes |= set(meta) & {"lagCount", "pendingEntriesCount", "streamLength"}
        for count in ("lagCount", "pendingEntriesCount", "activationLagCount"):
            if count in meta:
                assert int(meta[count]) >= 0
    # lagCount is the only mode that can wake a Deployment from zero replicas.
    assert modes == {"lagCount", "pendingEntriesCount"}
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] in REDIS_AUTH_PARAMETERS
    assert (ref["parameter"], ref["name"], ref["key"]) == ("password", "kvfleet-secrets", "redis-password")
    # KEDA's operator must reach Redis through the NetworkPolicy.
    redis_policy = one(resources, "NetworkPolicy", "kvfleet-redis")["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in redis_policy


def test_scale_to_zero_component(tmp_path):
    k8s = os.path.relpath(REPO / "k8s", tmp_path)  # kustomize takes relative paths only
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: kvfleet\n"
        f"resources:\n  - {k8s}/base\ncomponents:\n  - {k8s}/components/gpu-worker\n"
        f"  - {k8s}/components/keda\n  - {k8s}/components/scale-to-zero\n")
    resources = render(tmp_path)
    scaled, _ = _keda_resources(resources)
    jsonschema.validate(scaled, SCALED_OBJECT)
    assert scaled["spec"]["minReplicaCount"] == 0
    lag = next(t["metadata"] for t in scaled["spec"]["triggers"] if "lagCount" in t["metadata"])
    assert lag["activationLagCount"] == "0", "one queued request must wake the first worker"
    gw = one(resources, "Deployment", "kvfleet-gateway")["spec"]["template"]["spec"]["containers"][0]
    # With no worker alive the gateway must stay in its Service and queue instead of answering 503.
    assert gw["readinessProbe"]["httpGet"]["path"] == "/livez"
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert env["KVFLEET_QUEUE_WHEN_NO_WORKERS"] == "1"
    from shared.settings import Settings
    assert Settings.from_env({"KVFLEET_QUEUE_WHEN_NO_WORKERS": "1"}).queue_when_no_workers is True
    assert not find(resources, "HorizontalPodAutoscaler")
