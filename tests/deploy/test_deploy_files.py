"""deploy/: the compose file, the Prometheus scrape config, Grafana provisioning and the
Kubernetes manifests hang together (no Docker or cluster here: structure and schemas)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_compose_services_are_complete() -> None:
    services = _compose()["services"]
    assert {"redis", "jaeger", "prometheus", "grafana", "router-a", "worker-0"} <= set(services)
    for name, svc in services.items():
        assert isinstance(svc, dict), name
        assert ("image" in svc) != ("build" in svc), f"{name}: exactly one of image/build"
        if "build" in svc:
            context = (DEPLOY / svc["build"]["context"]).resolve()
            assert (context / svc["build"]["dockerfile"]).is_file(), name
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for port in svc.get("ports", []):
            host, _, container = str(port).partition(":")
            assert host.isdigit() and container.isdigit(), f"{name}: port {port!r}"
        for volume in svc.get("volumes", []):
            source, target, *mode = volume.split(":")
            assert source.startswith("./"), f"{name}: bind mounts are relative to deploy/"
            assert (DEPLOY / source).exists(), f"{name}: {source} is not in deploy/"
            assert target.startswith("/") and mode in ([], ["ro"]), volume
        command = svc.get("command", [])
        assert isinstance(command, list) and all(isinstance(a, str) for a in command), name


def test_prometheus_scrapes_every_router_and_worker_on_its_metrics_port() -> None:
    services = _compose()["services"]
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    expected = set()
    for name, svc in services.items():
        command = svc.get("command", [])
        port = _flag(command, "--metrics-port")
        if name.startswith(("router", "worker")):
            assert port is not None, f"{name} serves no /metrics"
            expected.add(f"{name}:{port}")
    assert targets == expected


def test_grafana_is_provisioned_with_the_datasource_the_dashboard_uses() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "kvroute.yml").read_text())
    (provider,) = providers["providers"]
    dashboard_dir = provider["options"]["path"]
    assert mounts["./grafana/kvroute.json"].startswith(dashboard_dir + "/")
    dashboard = json.loads((DEPLOY / "grafana" / "kvroute.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}


MANIFESTS = sorted((DEPLOY / "k8s").rglob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kubernetes_manifests_are_valid(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_tenant_salt_secret_is_optional_and_shipped_as_an_example() -> None:
    refs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    for env in c.get("env", []):
                        ref = env.get("valueFrom", {}).get("secretKeyRef")
                        if ref:
                            refs.append(ref)
    assert refs, "the router reads its tenant salt secret from a Secret"
    for ref in refs:
        assert ref["optional"] is True, f"Secret {ref['name']} must be optional"
    example = yaml.safe_load((DEPLOY / "k8s" / "examples" / "tenant-salt-secret.yaml").read_text())
    assert example["kind"] == "Secret"
    assert {r["name"] for r in refs} == {example["metadata"]["name"]}
    assert set(example["stringData"]) == {r["key"] for r in refs}


def test_k8s_pods_expose_the_metrics_port_they_serve() -> None:
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            if doc["metadata"]["name"] == "kvroute-redis":
                continue
            template = doc["spec"]["template"]
            (container,) = template["spec"]["containers"]
            args = dict(a.split("=", 1) for a in container["args"] if "=" in a)
            port = int(args["--metrics-port"])
            assert {"name": "metrics", "containerPort": port} in container["ports"]
            annotations = template["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(port)


def test_the_router_image_ships_its_compiled_kernels() -> None:
    """The router runs as an unprivileged user without a home: numba's kernels are compiled
    at build time into a cache that user owns (else every start compiles them again)."""
    text = (DEPLOY / "router.Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    env = next(line for line in lines if line.startswith("ENV NUMBA_CACHE_DIR="))
    cache = env.split("=", 1)[1]
    user = next(line for line in lines if line.startswith("USER "))
    warm = text.index("warm_up()")
    assert "enable_compiled()" in text
    assert text.index(env) < warm < text.index(user)
    assert f'chown -R {user.split()[1]} "$NUMBA_CACHE_DIR"' in text and cache.startswith("/")


def test_router_replicas_are_told_how_many_they_are_and_sync_through_redis() -> None:
    """Each router's --replicas matches the replicas deployed, --replica-sync has the Redis it
    needs, the workers keep their 1 s load reports (the picks travel through the sync; faster
    reports cost TTFT p99: decision 0023), and the real parsers accept every flag."""
    from router.cli import router as router_cli
    from worker import cli as worker_cli

    services = _compose()["services"]
    routers = [s for name, s in services.items() if name.startswith("router-")]
    for svc in routers:
        args = router_cli.build_parser().parse_args(svc["command"])
        assert args.replicas == len(routers) and args.replica_sync and args.redis_url
        assert router_cli.config_from_args(args).registry.replica_sync
    for name, svc in services.items():
        if name.startswith("worker-"):
            assert worker_cli.build_parser().parse_args(svc["command"]).load_interval_s == 1.0
    (router,) = [
        d
        for d in yaml.safe_load_all((DEPLOY / "k8s" / "router.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = router_cli.build_parser().parse_args(container["args"])
    assert args.replicas == router["spec"]["replicas"] and args.replica_sync and args.redis_url
    (worker,) = [
        d
        for d in yaml.safe_load_all((DEPLOY / "k8s" / "worker.yaml").read_text())
        if d and d["kind"] in ("Deployment", "StatefulSet")
    ]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert worker_cli.build_parser().parse_args(container["args"]).load_interval_s == 1.0


def test_every_metric_the_dashboard_plots_is_documented() -> None:
    """Each kvroute_* series a Grafana panel queries is in docs/METRICS.md (a histogram's
    _bucket/_sum/_count by its base name): a renamed or removed metric fails here, not as an
    empty panel."""
    import re

    dashboard = json.loads((DEPLOY / "grafana" / "kvroute.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"kvroute_[a-z0-9_]+", target["expr"])
    }
    docs = (DEPLOY.parent / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"`(kvroute_[a-z0-9_]+)[`{]", docs))
    assert len(queried) > 40 and "kvroute_router_replica_events_total" in queried
    missing = {
        n
        for n in queried
        if n not in documented and re.sub(r"_(bucket|sum|count)$", "", n) not in documented
    }
    assert not missing, sorted(missing)
