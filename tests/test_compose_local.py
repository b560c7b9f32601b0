"""docker-compose.local.yml and deploy/local: the registry-free images `make compose-check` runs.

Docker is not needed: the files are parsed. `make compose-check` builds and runs them for real.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICES = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
LOCAL = yaml.safe_load((ROOT / "docker-compose.local.yml").read_text())["services"]
LOCAL_DOCKERFILE = ROOT / "deploy" / "local" / "Dockerfile"
# No Debian package to build them from: the check leaves these services out (docs/operations.md).
NOT_BUILT_LOCALLY = {"grafana"}


def test_the_override_names_only_services_of_the_published_file() -> None:
    assert set(LOCAL) <= set(SERVICES)


def test_every_registry_image_has_a_local_one_except_those_debian_lacks() -> None:
    pulled = {name for name, service in SERVICES.items() if "build" not in service}
    replaced = {name for name, service in LOCAL.items() if "image" in service}
    assert pulled - replaced == NOT_BUILT_LOCALLY
    for name in replaced:
        assert LOCAL[name]["image"].startswith("kvsplice-local/"), name


def test_the_sidecars_build_on_the_local_python_image() -> None:
    built = {name for name, service in SERVICES.items() if "build" in service}
    for name in ("kvsplice", "kvsplice-clustered"):
        assert name in built
        assert "kvsplice-local/python" in LOCAL[name]["build"]["args"]["PYTHON_IMAGE"]


def test_local_builds_name_stages_of_deploy_local() -> None:
    stages = {
        line.split()[-1]
        for line in LOCAL_DOCKERFILE.read_text().splitlines()
        if line.startswith("FROM ") and " AS " in line
    }
    assert {"python", "valkey", "prometheus"} <= stages
    for name, service in LOCAL.items():
        build = service.get("build")
        if build and "context" in build:
            assert (ROOT / build["context"] / "Dockerfile").samefile(LOCAL_DOCKERFILE), name
            assert build["target"] in stages, name


def test_no_dockerfile_fetches_a_frontend_from_a_registry() -> None:
    for dockerfile in (ROOT / "Dockerfile", LOCAL_DOCKERFILE):
        first = dockerfile.read_text().splitlines()[0]
        assert not first.replace(" ", "").lower().startswith("#syntax="), dockerfile


def test_published_ports_are_configurable_and_stay_on_loopback() -> None:
    ports = {port for service in SERVICES.values() for port in service.get("ports", [])}
    for variable in ("KVSPLICE_HOST_GRPC_PORT", "KVSPLICE_HOST_ADMIN_PORT", "PROMETHEUS_HOST_PORT"):
        assert any(variable in port for port in ports), variable
    assert all(str(port).startswith("127.0.0.1:") for port in ports)


def test_the_compose_file_has_no_key_bookworms_compose_rejects() -> None:
    assert "name" not in yaml.safe_load((ROOT / "docker-compose.yml").read_text())
