"""compose.yaml is a valid Compose file that wires redis, N workers and the gateway together."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT.parent / "shared" / "compose-spec.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
REDIS_URL = "redis://redis:6379/0"


def parse_duration(text: str) -> float:
    """A Compose duration ("45s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def command_args(command: list[str]) -> list[str]:
    """The argument list of an exec-form command, or of the `sh -c` script, split on spaces."""
    if command[:2] == ["sh", "-c"]:
        return command[2].replace("$$", "$").split()
    return command


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def test_compose_file_validates_against_the_compose_spec_schema(compose: dict) -> None:
    # A missing schema is a broken checkout, not a reason to skip.
    assert SCHEMA.is_file(), f"{SCHEMA} is missing (../shared/compose-spec.json)"
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=str)
    assert [e.message for e in errors] == []


def test_the_fleet_is_redis_workers_a_gateway_and_prometheus(services: dict) -> None:
    assert sorted(services) == ["gateway", "prometheus", "redis", "worker"]


def test_redis_persists_every_second_and_never_evicts_jobs(services: dict) -> None:
    redis = services["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    assert flag(cmd, "--appendonly") == "yes"
    assert flag(cmd, "--appendfsync") == "everysec"
    assert flag(cmd, "--maxmemory-policy") == "noeviction"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_worker_and_gateway_wait_for_a_healthy_redis_at_the_same_url(services: dict) -> None:
    url = urlsplit(REDIS_URL)
    assert url.hostname in services  # the service name is the host name on the compose network
    assert any(p.endswith(f":{url.port}") for p in services[url.hostname]["ports"])
    for name in ("worker", "gateway"):
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["worker"]["environment"]["GENQ_REDIS_URL"] == REDIS_URL
    assert flag(services["gateway"]["command"], "--redis") == REDIS_URL


def test_worker_command_serves_the_demo_model_on_cuda_with_a_drain_timeout(services: dict) -> None:
    worker = services["worker"]
    env = worker["environment"]
    args = command_args(worker["command"])
    assert args[:3] == ["exec", "genq", "worker"]
    assert flag(args, "--redis") == '"$GENQ_REDIS_URL"'
    assert flag(args, "--model") == '"$GENQ_MODEL"'
    assert flag(args, "--device") == '"$GENQ_DEVICE"'
    assert flag(args, "--drain-timeout") == '"$GENQ_DRAIN_TIMEOUT"'
    assert flag(args, "--name") == '"${GENQ_WORKER_NAME:-$(hostname)}"'
    assert flag(args, "--metrics-port") == '"$GENQ_METRICS_PORT"'
    assert (env["GENQ_MODEL"], env["GENQ_DEVICE"], env["GENQ_DRAIN_TIMEOUT"],
            env["GENQ_METRICS_PORT"]) == ("/models/genq-tiny-stdlib", "cuda", "30", "9400")


def test_worker_grace_period_outlasts_its_drain(services: dict) -> None:
    worker = services["worker"]
    drain = float(worker["environment"]["GENQ_DRAIN_TIMEOUT"])
    assert parse_duration(worker["stop_grace_period"]) == 45.0
    assert parse_duration(worker["stop_grace_period"]) > drain
    assert worker["stop_signal"] == "SIGTERM"
    assert worker["init"] is True  # tini passes SIGTERM on to the worker


def test_worker_reserves_a_gpu_and_can_be_scaled(services: dict) -> None:
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # `--scale worker=N` needs replicas that do not collide on a container name or a host port.
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker


def test_gateway_listens_on_all_interfaces_and_publishes_8000(services: dict) -> None:
    gateway = services["gateway"]
    assert gateway["command"] == ["genq", "gateway", "--redis", REDIS_URL,
                                  "--host", "0.0.0.0", "--port", "8000"]
    assert gateway["ports"] == ["8000:8000"]
    assert "8000/v1/models" in " ".join(gateway["healthcheck"]["test"])


def test_worker_and_gateway_share_one_image_built_from_the_dockerfile(services: dict) -> None:
    assert services["worker"]["build"] == services["gateway"]["build"] == "."
    assert services["worker"]["image"] == services["gateway"]["image"] == "genq:latest"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.splitlines().count("FROM python:3.11-slim") == 1
    assert (ROOT / "models" / "genq-tiny-stdlib" / "config.json").is_file()
    assert "/models/genq-tiny-stdlib" in dockerfile


def test_worker_exposes_its_metrics_port_on_the_compose_network_only(services: dict) -> None:
    from worker.main import build_parser

    worker = services["worker"]
    port = worker["environment"]["GENQ_METRICS_PORT"]
    assert worker["expose"] == [port]  # reachable by prometheus, never published on the host
    # The metrics server binds every interface by default, so other containers can reach it.
    assert build_parser().parse_args(["--model", "m"]).metrics_host == "0.0.0.0"


@pytest.fixture(scope="module")
def prometheus_config() -> dict:
    assert PROMETHEUS_CONFIG.is_file(), f"{PROMETHEUS_CONFIG} is missing"
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def test_prometheus_mounts_the_scrape_config_it_is_told_to_read(services: dict) -> None:
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:v3.")
    [config_flag] = [a for a in prometheus["command"] if a.startswith("--config.file=")]
    target = config_flag.split("=", 1)[1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounts[target] == "./deploy/prometheus.yml"
    assert (ROOT / mounts[target]).resolve() == PROMETHEUS_CONFIG
    assert prometheus["volumes"][0].endswith(":ro")
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]
    assert prometheus["depends_on"] == ["worker"]


def test_prometheus_scrapes_every_worker_replica_on_the_metrics_port(
        services: dict, prometheus_config: dict) -> None:
    port = int(services["worker"]["environment"]["GENQ_METRICS_PORT"])
    [job] = prometheus_config["scrape_configs"]
    assert job["job_name"] == "genq-worker"
    assert job["metrics_path"] == "/metrics"  # the path worker/metrics.py serves
    assert "static_configs" not in job
    # DNS service discovery on the compose service name: one A record per `--scale` replica.
    [sd] = job["dns_sd_configs"]
    assert sd["names"] == ["worker"] and "worker" in services
    assert (sd["type"], sd["port"]) == ("A", port)
    assert parse_duration(sd["refresh_interval"]) == 10.0
    assert parse_duration(prometheus_config["global"]["scrape_interval"]) == 5.0


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    checks = (["docker", "info"], ["docker", "compose", "version"])
    return all(subprocess.run(c, capture_output=True, timeout=30).returncode == 0 for c in checks)


def test_docker_compose_config_accepts_the_file() -> None:
    if not _docker_compose_available():
        pytest.skip("no reachable Docker engine with the compose plugin (docker info failed)")
    out = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)["services"]
    assert sorted(resolved) == ["gateway", "prometheus", "redis", "worker"]
    assert resolved["redis"]["command"][0] == "redis-server"
