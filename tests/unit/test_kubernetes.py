"""deploy/kubernetes against the compose stack it mirrors, with no cluster: every overlay and example
renders with plain `kubectl kustomize`, validates strictly against the API schemas of each supported
Kubernetes version, and keeps compose's config files, settings, commands, health checks, images,
secrets and hardening. Nothing is skipped: without kubectl (CI has it) these tests fail."""

from __future__ import annotations

import copy
import json
import shutil
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from llmstack import REPO_ROOT
from llmstack import kubernetes as k8s

DIRECTORIES = {f"overlays/{name}": name for name in k8s.OVERLAYS} | {
    f"examples/{name}": overlay for name, overlay in k8s.EXAMPLES.items()
}
DEPLOYED_SERVICES = sorted(set(k8s.compose_services(k8s.OVERLAYS["gpu"])) - set(k8s.NOT_DEPLOYED))

# What the pods set that compose does not, and why (anything else must equal compose's value).
KUBERNETES_ENV = {
    # Non-root vLLM: a home and Hugging Face cache it owns (compose: root's /root).
    "vllm": {"HOME", "USER", "HF_HOME"},
    # Kubernetes service discovery instead of a fixed worker list.
    "router": {"POD_NAMESPACE", "ROUTER_WORKER_URLS", "ROUTER_EXTRA_ARGS"},
    # The cluster's DNS and the namespace's domain for the routes' per-request lookups.
    "nginx": {"POD_NAMESPACE", "GATEWAY_RESOLVER", "GATEWAY_SERVICE_DOMAIN"},
}
# compose settings that come from a Secret in Kubernetes (they may hold a token).
SECRET_ENV = {"alertmanager": {"ALERT_WEBHOOK_URL"}}
# compose's tmpfs paths the pods keep elsewhere: vLLM's caches under its non-root HOME.
MOVED_TMPFS = {"/root/.cache": "/home/vllm", "/root/.triton": "/home/vllm", "/root/.config": "/home/vllm"}
# Probes that ask another path than compose's healthcheck: the router's readiness is compose's
# /readiness (false while no replica is in rotation), but restarting the router would not help that.
LIVENESS_PATHS = {"router": "/liveness"}
# Command-line flags the pods change: Prometheus reads prometheus/kubernetes.yml.
CHANGED_ARGS = {
    "prometheus": {"--config.file=/etc/prometheus/prometheus.yml": "--config.file=/etc/prometheus/kubernetes.yml"}
}
# Pods whose user differs from compose's, and why: compose runs vLLM as root without capabilities
# (the Hugging Face cache volume is root's); Pod Security "restricted" wants a non-root user.
USERS = {"vllm": 1000, "grafana": 472}


@cache
def rendered(directory: str) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed: CI renders deploy/kubernetes with `kubectl kustomize` (kubectl >= 1.27)")
    return k8s.render(k8s.KUBERNETES_DIR / directory)


def compose(directory: str) -> dict[str, dict[str, Any]]:
    return k8s.compose_services(k8s.OVERLAYS[DIRECTORIES[directory]])


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: w["spec"]["template"]["spec"] for name, w in k8s.workloads(objects).items()}


def container(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_specs(objects)[name]["containers"] if c["name"] == name]
    return found


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def mebibytes(quantity: str) -> float:
    units = {"g": 1024, "m": 1, "Gi": 1024, "Mi": 1}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return float(quantity[: -len(unit)]) * factor
    raise AssertionError(f"unexpected quantity {quantity}")


# --- Rendering and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_every_overlay_renders_and_validates_for_every_supported_version(directory):
    objects = rendered(directory)
    assert objects, directory
    assert k8s.validate(objects) == []
    skipped = {(o["apiVersion"], o["kind"]) for o in objects if k8s.is_crd_kind(o)}
    # The core overlays hold no CRD kind: every object in them is validated.
    if directory.startswith("overlays/"):
        assert skipped == set()


def test_the_validation_is_strict_and_knows_the_versions():
    deployment = copy.deepcopy(k8s.workloads(rendered("overlays/gpu"))["nginx"])
    assert k8s.validate([deployment]) == []
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystm"] = True
    deployment["spec"]["replicas"] = "one"
    errors = k8s.validate([deployment], versions=k8s.SUPPORTED_VERSIONS[:1])
    assert any("readOnlyRootFilesystm" in e for e in errors) and any("'one'" in e for e in errors), errors
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert k8s.validate([unknown], versions=k8s.SUPPORTED_VERSIONS[:1]) != []
    import kubernetes_validate.utils

    assert {f"{v}.0" for v in k8s.SUPPORTED_VERSIONS} <= set(kubernetes_validate.utils.all_versions())


def test_the_docs_name_the_supported_versions_and_what_was_never_run():
    docs = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for version in k8s.SUPPORTED_VERSIONS:
        assert version in docs
    assert "never run on a cluster" in docs


# --- Exposure and network policies --------------------------------------------------------------


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_only_the_gateway_is_exposed(directory):
    objects = rendered(directory)
    for service in of_kind(objects, "Service"):
        if service["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            assert service["metadata"]["name"] == k8s.EXPOSED_SERVICE
        assert not service["spec"].get("externalIPs")
    for ingress in of_kind(objects, "Ingress"):
        backends = [p["backend"]["service"]["name"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]]
        assert set(backends) == {k8s.EXPOSED_SERVICE}
    for route in of_kind(objects, "HTTPRoute"):
        assert {b["name"] for r in route["spec"]["rules"] for b in r["backendRefs"]} == {k8s.EXPOSED_SERVICE}
    gateway = next(s for s in of_kind(objects, "Service") if s["metadata"]["name"] == k8s.EXPOSED_SERVICE)
    assert {p["port"] for p in gateway["spec"]["ports"]} == {8080, 8443}
    for name, spec in pod_specs(objects).items():
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), name
        for c in spec["containers"]:
            assert all("hostPort" not in p for p in c.get("ports") or []), name


def allowed_sources(objects: list[dict[str, Any]]) -> dict[tuple[str, int], set[str]]:
    """(pod's app name, port) -> who may connect: app names in the namespace, or 'anywhere', or
    'namespace:<name>' for other namespaces."""
    apps = {spec_name: w["spec"]["template"]["metadata"]["labels"] for spec_name, w in k8s.workloads(objects).items()}

    def selected(selector: dict[str, Any]) -> set[str]:
        labels = selector.get("matchLabels") or {}
        found = {n for n, lab in apps.items() if all(lab.get(k) == v for k, v in labels.items())}
        for expression in selector.get("matchExpressions") or []:
            assert expression["operator"] == "In"
            found &= {n for n, lab in apps.items() if lab.get(expression["key"]) in expression["values"]}
        return found

    allowed: dict[tuple[str, int], set[str]] = {}
    for policy in of_kind(objects, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress") or []:
            sources: set[str] = set()
            for peer in rule.get("from") or [{}]:
                if not peer:
                    sources.add("anywhere")
                elif "namespaceSelector" in peer:
                    sources.add("namespace:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
                else:
                    sources |= selected(peer["podSelector"])
            for app in selected(policy["spec"]["podSelector"]):
                for port in rule["ports"]:
                    allowed.setdefault((app, port["port"]), set()).update(sources)
    return allowed


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_network_policies_let_only_the_gateway_reach_the_router_and_only_the_router_reach_vllm(directory):
    objects = rendered(directory)
    default_deny = [
        p for p in of_kind(objects, "NetworkPolicy") if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
    ]
    assert default_deny, "no default-deny ingress policy"
    allowed = allowed_sources(objects)
    monitoring = {"namespace:monitoring"} if directory == "examples/gpu-ingress-keda" else set()
    assert allowed[("nginx", 8080)] == allowed[("nginx", 8443)] == {"anywhere"}
    assert allowed[("nginx", 8081)] == {"gateway-exporter"}
    assert allowed[("router", 8000)] == {"nginx"} | monitoring
    assert allowed[("router", 29000)] == {"prometheus"} | monitoring
    assert allowed[("vllm", 8000)] == {"router", "prometheus"} | monitoring
    assert allowed[("grafana", 3000)] == {"nginx"}
    assert allowed[("alertmanager", 9093)] == {"prometheus"}
    assert {"nginx", "grafana"} <= allowed[("prometheus", 9090)]
    # Nothing but the gateway's API ports is open to anywhere.
    assert {key for key, sources in allowed.items() if "anywhere" in sources} == {("nginx", 8080), ("nginx", 8443)}


# --- Hardening, probes, resources ---------------------------------------------------------------


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_every_container_is_hardened_as_in_compose(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name, spec in pod_specs(objects).items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        compose_user = services[name].get("user")
        expected = USERS.get(name) or int(str(compose_user).split(":")[0])
        assert pod["runAsUser"] == expected and pod["runAsUser"] != 0, name
        for c in spec["containers"] + spec.get("initContainers", []):
            context = c["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert context["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert not context.get("privileged") and "runAsUser" not in context, (name, c["name"])
        # Only the pods that call the Kubernetes API get a token.
        if name in ("router", "prometheus"):
            assert spec["serviceAccountName"] == name, name
        else:
            assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec, name


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_compose_tmpfs_paths_are_writable_volumes(directory):
    objects = rendered(directory)
    for name in DEPLOYED_SERVICES:
        c = container(objects, name)
        volumes = {v["name"]: v for v in pod_specs(objects)[name]["volumes"]}
        writable = {m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes.get(m["name"], {})}
        for entry in compose(directory)[name].get("tmpfs") or []:
            path = entry.split(":")[0]
            assert MOVED_TMPFS.get(path, path) in writable, (name, path)


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_probes_equal_the_compose_health_checks(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        expected = k8s.probe_from_healthcheck(services[name]["healthcheck"])
        c = container(objects, name)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            path = expected.path if kind == "readinessProbe" else LIVENESS_PATHS.get(name, expected.path)
            failures = expected.startup_failures if kind == "startupProbe" else expected.failures
            assert probe["httpGet"] == {"path": path, "port": expected.port}, (name, kind)
            assert (probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]) == (
                expected.period,
                expected.timeout,
                failures,
            ), (name, kind)
            assert expected.port in {p["containerPort"] for p in c["ports"]}, name
    # Every long-running container has its probes (no container other than those above).
    for name, spec in pod_specs(objects).items():
        assert [c["name"] for c in spec["containers"]] == [name]


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_memory_limits_and_shared_memory_equal_compose(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        limit = container(objects, name)["resources"]["limits"]["memory"]
        assert mebibytes(limit) == mebibytes(services[name]["mem_limit"]), name
    volumes = {v["name"]: v for v in pod_specs(objects)["vllm"]["volumes"]}
    (shm,) = [m for m in container(objects, "vllm")["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert mebibytes(volumes[shm["name"]]["emptyDir"]["sizeLimit"]) == mebibytes(services["vllm"]["shm_size"])
    grace = k8s.seconds(services["vllm"]["stop_grace_period"])
    assert pod_specs(objects)["vllm"]["terminationGracePeriodSeconds"] == grace
    assert grace > int(services["vllm"]["environment"]["VLLM_SHUTDOWN_TIMEOUT"])


def test_the_gpu_overlay_requests_gpus_and_the_cpu_overlay_does_not():
    gpu = container(rendered("overlays/gpu"), "vllm")["resources"]["limits"]
    count = compose("overlays/gpu")["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert gpu["nvidia.com/gpu"] == int(count)
    for directory in ("overlays/cpu", "examples/cpu-gateway-api"):
        for spec in pod_specs(rendered(directory)).values():
            assert all("nvidia.com/gpu" not in (c.get("resources") or {}).get("limits", {}) for c in spec["containers"])


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_vllm_keeps_its_model_cache_and_may_be_disrupted_one_replica_at_a_time(directory):
    objects = rendered(directory)
    (budget,) = of_kind(objects, "PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "vllm"}}}
    statefulset = k8s.workloads(objects)["vllm"]
    mounts = {m["name"]: m["mountPath"] for m in container(objects, "vllm")["volumeMounts"]}
    environment = k8s.container_environment(objects, container(objects, "vllm"))
    assert mounts["hf-cache"] == environment["HF_HOME"]
    templates = [t["metadata"]["name"] for t in statefulset["spec"].get("volumeClaimTemplates", [])]
    # GPU: the model is downloaded into a PersistentVolumeClaim per replica; CPU: it is in the image.
    assert templates == (["hf-cache"] if DIRECTORIES[directory] == "gpu" else [])


# --- The same config, settings, commands, images and secrets as compose --------------------------


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_every_config_file_compose_mounts_is_in_a_configmap_byte_for_byte(directory):
    objects = rendered(directory)
    services = compose(directory)
    assert set(k8s.workloads(objects)) == set(DEPLOYED_SERVICES)
    checked = 0
    for name in DEPLOYED_SERVICES:
        files = k8s.container_files(objects, k8s.workloads(objects)[name], container(objects, name))
        for source, target in k8s.config_mounts(services[name]):
            for path in k8s.repo_files(source):
                inside = str(PurePosixPath(target) / path.relative_to(source)) if path != source else target
                assert inside in files, f"{name}: {path} is not at {inside} (compose mounts it there)"
                assert files[inside] == (REPO_ROOT / path).read_bytes().decode(), (
                    f"{name}: {inside} differs from {path}"
                )
                checked += 1
    assert checked >= 20


def test_the_config_mounts_come_from_compose_files_not_a_list():
    mounts = {name: k8s.config_mounts(s) for name, s in k8s.compose_services(k8s.OVERLAYS["cpu"]).items()}
    assert (Path("nginx/templates"), "/etc/nginx/templates") in mounts["nginx"]
    # A source that is a setting (the user's models folder) is data, not the stack's config.
    assert all("models" not in str(source) for source, _ in mounts["vllm"])


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_settings_equal_compose_defaults(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        c = container(objects, name)
        expected = k8s.compose_environment(services[name])
        for key in SECRET_ENV.get(name, set()):
            expected.pop(key)
            (item,) = [e for e in c["env"] if e["name"] == key]
            assert "secretKeyRef" in item["valueFrom"]
        from_configmaps = k8s.container_environment(objects, {"envFrom": c.get("envFrom")})
        assert from_configmaps == expected, name
        overrides = {e["name"] for e in c.get("env") or []} - SECRET_ENV.get(name, set())
        assert overrides == KUBERNETES_ENV.get(name, set()), name


def test_kubernetes_only_settings_are_what_the_cluster_needs():
    objects = rendered("overlays/gpu")
    router = container(objects, "router")
    environment = k8s.container_environment(objects, router)
    assert environment["ROUTER_WORKER_URLS"] == ""
    assert environment["ROUTER_EXTRA_ARGS"].split() == [
        "--service-discovery",
        "--selector",
        "app.kubernetes.io/name=vllm",
        "--service-discovery-port",
        "8000",
        "--service-discovery-namespace",
        "$(POD_NAMESPACE)",
    ]
    vllm_labels = k8s.workloads(objects)["vllm"]["spec"]["template"]["metadata"]["labels"]
    assert vllm_labels["app.kubernetes.io/name"] == "vllm"
    # The router lists and watches pods with its own service account.
    (binding,) = [b for b in of_kind(objects, "RoleBinding") if b["metadata"]["name"] == "router"]
    (role,) = [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    account = pod_specs(objects)["router"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "llm-stack"}]
    assert {o["metadata"].get("namespace") for o in objects} == {"llm-stack"}
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    nginx = k8s.container_environment(objects, container(objects, "nginx"))
    assert nginx["GATEWAY_SERVICE_DOMAIN"] == ".$(POD_NAMESPACE).svc.cluster.local"
    # Both are set in every nginx template that uses them, here and in compose.
    templates = "".join(p.read_text() for p in (REPO_ROOT / "nginx" / "templates").rglob("*.template"))
    assert "${GATEWAY_RESOLVER}" in templates and "${GATEWAY_SERVICE_DOMAIN}" in templates


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_commands_equal_compose(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        c = container(objects, name)
        entrypoint = k8s.compose_words(services[name].get("entrypoint"))
        command = k8s.compose_words(services[name].get("command"))
        command = [CHANGED_ARGS.get(name, {}).get(word, word) for word in command]
        assert c.get("command", []) == entrypoint, name
        assert c.get("args", []) == command, name


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_images_are_compose_images_with_the_versions_of_versions_env(directory):
    objects = rendered(directory)
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        assert container(objects, name)["image"] == services[name]["image"], name
    if DIRECTORIES[directory] == "gpu":
        from llmstack.versions import read_versions

        versions = read_versions()
        assert container(objects, "vllm")["image"] == f"vllm/vllm-openai:v{versions['VLLM_VERSION']}"
        assert container(objects, "router")["image"] == f"vllm/vllm-router:v{versions['VLLM_ROUTER_VERSION']}"


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_no_secret_is_in_the_manifests_and_compose_secrets_are_mounted_from_secrets(directory):
    objects = rendered(directory)
    assert of_kind(objects, "Secret") == []
    text = json.dumps(objects)
    assert "BEGIN" not in text and "PRIVATE KEY" not in text
    services = compose(directory)
    for name in DEPLOYED_SERVICES:
        volumes = {v["name"]: v for v in pod_specs(objects)[name]["volumes"]}
        mounted: set[str] = set()
        for mount in container(objects, name)["volumeMounts"]:
            if mount["mountPath"] != "/run/secrets":
                continue
            for source in volumes[mount["name"]]["projected"]["sources"]:
                mounted |= {item["path"] for item in source["secret"]["items"]}
        assert mounted == set(services[name].get("secrets") or []), name


def test_prometheus_kubernetes_config_is_prometheus_yml_but_for_the_vllm_targets():
    compose_config = yaml.safe_load((REPO_ROOT / "prometheus" / "prometheus.yml").read_text())
    kubernetes_config = yaml.safe_load((REPO_ROOT / "prometheus" / "kubernetes.yml").read_text())
    compose_jobs = compose_config.pop("scrape_configs")
    kubernetes_jobs = kubernetes_config.pop("scrape_configs")
    assert kubernetes_config == compose_config
    assert [j["job_name"] for j in kubernetes_jobs] == [j["job_name"] for j in compose_jobs]
    differing = [j["job_name"] for j, c in zip(kubernetes_jobs, compose_jobs, strict=True) if j != c]
    assert differing == ["vllm"]
    (vllm,) = [j for j in kubernetes_jobs if j["job_name"] == "vllm"]
    assert vllm["kubernetes_sd_configs"][0]["role"] == "pod"
    # The targets the other jobs name are Services of the same names.
    services = {s["metadata"]["name"]: s for s in of_kind(rendered("overlays/gpu"), "Service")}
    for job in compose_jobs:
        for static in job.get("static_configs") or []:
            for target in static["targets"]:
                host, port = target.split(":")
                if host != "localhost":
                    assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, target
    for target in compose_config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]:
        assert target.split(":")[0] in services


def test_the_compose_helpers_read_durations_health_checks_and_nested_defaults():
    assert [k8s.seconds(d) for d in ("5s", "30m", "1m30s", "500ms")] == [5, 1800, 90, 0.5]
    with pytest.raises(k8s.StackError):
        k8s.seconds("5 seconds")
    check = {"test": ["CMD", "wget", "-q", "http://127.0.0.1:9093/-/ready"], "interval": "5s", "timeout": "3s"}
    probe = k8s.probe_from_healthcheck({**check, "retries": 5, "start_period": "10s"})
    assert probe == k8s.Probe(path="/-/ready", port=9093, period=5, timeout=3, failures=5, startup_failures=7)
    # A default holding braces (Grafana's $$__env{...}) is read whole, as compose reads it.
    grafana = k8s.compose_environment(compose("overlays/gpu")["grafana"])
    assert grafana["GF_SERVER_ROOT_URL"] == "http://localhost:$__env{GATEWAY_PORT}/grafana/"
