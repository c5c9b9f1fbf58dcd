"""Deployment files checked offline: the Dockerfile lints, the Kubernetes manifests render with kustomize
and validate against the API schemas, the objects point at each other correctly, every NANOSERVE_*
setting they pass is one the server knows, and the compose file parses with every mounted file present.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from nanoserve.server.settings import Settings
from tests.conftest import IN_CI, require_tool

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu"}
COMPOSE = ROOT / "deploy" / "compose.yaml"
# `nanoserve serve`'s default drain timeout, used when a manifest does not set one.
DEFAULT_DRAIN = Settings.model_fields["drain_timeout"].default


def venv_tool(name: str) -> str:
    """A console script installed in this venv (dev extra), or on PATH; skip/fail like require_tool."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    if shutil.which(name):
        return require_tool(name)
    message = f"{name!r} not installed (pip install -e '.[dev]')"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(variant, the YAML `kubectl kustomize` renders for it)."""
    kubectl = require_tool("kubectl", "renders the kustomizations")
    result = run([kubectl, "kustomize", str(VARIANTS[request.param])])
    assert result.returncode == 0, result.stderr
    return request.param, result.stdout


def by_kind(text: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), f"one object of each kind expected, got {kinds}"
    return {d["kind"]: d for d in docs}


def test_dockerfile_passes_hadolint() -> None:
    result = run([venv_tool("hadolint"), "--failure-threshold", "info", "Dockerfile"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_kustomization_validates_strictly(rendered: tuple[str, str]) -> None:
    _, text = rendered
    result = run([venv_tool("kubernetes-validate"), "--strict", "-"], stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every object was checked, not skipped for a missing schema.
    objects = len([d for d in yaml.safe_load_all(text) if d])
    assert result.stdout.count("passed for resource") + result.stderr.count("passed for resource") == objects


def test_objects_reference_each_other(rendered: tuple[str, str]) -> None:
    _, text = rendered
    objs = by_kind(text)
    assert set(objs) == {
        "ConfigMap", "Service", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"
    }
    deploy = objs["Deployment"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    # Service and PDB select exactly this Deployment's pods (an empty PDB selector takes every pod).
    assert objs["Service"]["spec"]["selector"] == selector
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    target = objs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deploy["metadata"]["name"])
    # The HPA owns the replica count; PDB + minReplicas leave one replica serving during a drain.
    assert "replicas" not in deploy["spec"]
    assert objs["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    refs = [e["configMapRef"]["name"] for e in container["envFrom"]]
    assert refs == [objs["ConfigMap"]["metadata"]["name"]]
    port_names = {p["name"] for p in container["ports"]}
    assert objs["Service"]["spec"]["ports"][0]["targetPort"] in port_names


def test_pod_is_hardened_and_probed(rendered: tuple[str, str]) -> None:
    _, text = rendered
    objs = by_kind(text)
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The read-only root needs a writable /tmp (HOME, TMPDIR and caches point there in the image).
    tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert tmp and any(v["name"] == tmp[0]["name"] and "emptyDir" in v for v in pod["volumes"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "startupProbe" in container
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    # The API key comes from a Secret, never from the ConfigMap.
    keys = [e for e in container["env"] if e["name"] == "NANOSERVE_API_KEYS"]
    assert keys and "secretKeyRef" in keys[0]["valueFrom"]
    assert not any("API_KEY" in k for k in objs["ConfigMap"]["data"])


def test_grace_period_outlasts_drain(rendered: tuple[str, str]) -> None:
    _, text = rendered
    objs = by_kind(text)
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    drain = float(objs["ConfigMap"]["data"].get("NANOSERVE_DRAIN_TIMEOUT", DEFAULT_DRAIN))
    delay = pod["containers"][0].get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > drain + delay


def test_configmap_settings_are_real_and_valid(rendered: tuple[str, str]) -> None:
    """The server ignores unknown NANOSERVE_* variables, so a typo here would be silently lost."""
    variant, text = rendered
    data = by_kind(text)["ConfigMap"]["data"]
    assert_known_settings(data, where=f"ConfigMap ({variant})")
    if variant == "gpu":
        assert data["NANOSERVE_DEVICE"].startswith("cuda")
        container = by_kind(text)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"].get("nvidia.com/gpu") == "1"


def assert_known_settings(env: dict[str, str], where: str) -> None:
    fields = {f"NANOSERVE_{name.upper()}" for name in Settings.model_fields}
    unknown = sorted(k for k in env if k.startswith("NANOSERVE_") and k not in fields)
    assert not unknown, f"{where} sets variables nanoserve does not read: {unknown}"
    # Read exactly as `nanoserve serve` reads them: from the environment.
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("NANOSERVE_")]:
            mp.delenv(key)
        for key, value in env.items():
            if key.startswith("NANOSERVE_") and value != "":  # empty in compose = the default
                mp.setenv(key, value)
        try:
            Settings()
        except ValidationError as e:
            pytest.fail(f"{where}: invalid settings: {e}")


def test_compose_file_parses_and_mounts_exist() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"nanoserve", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        # Bridge networks use private address ranges; everything shares the host's loopback.
        assert service.get("network_mode") == "host", name
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (COMPOSE.parent / source).exists(), f"{name} mounts missing {source}"
    # The mounted configs are the ones the metrics issue ships.
    prometheus_mounts = [v.split(":")[1] for v in services["prometheus"]["volumes"]]
    assert "/etc/prometheus" in prometheus_mounts
    assert (ROOT / "deploy" / "prometheus" / "prometheus.yml").is_file()
    assert any((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    env = {k: str(v) for k, v in services["nanoserve"]["environment"].items()}
    # ${VAR:-default} interpolations are resolved by compose; validate the literal ones.
    assert_known_settings({k: v for k, v in env.items() if "${" not in v}, where="compose nanoserve")
    assert services["nanoserve"]["read_only"] is True


def test_compose_config_is_accepted_by_podman_compose() -> None:
    tool = venv_tool("podman-compose")
    require_tool("podman", "podman-compose calls it")
    env_file = ROOT / "deploy" / "podman" / "containers.conf"
    result = subprocess.run(
        [tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120,
        env={"CONTAINERS_CONF": str(env_file), "PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    normalised = yaml.safe_load(result.stdout)
    assert normalised["services"]["prometheus"]["extra_hosts"] == ["nanoserve:127.0.0.1"]
