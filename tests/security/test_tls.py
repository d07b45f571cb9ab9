"""TLS: redis-server on a TLS port only (--port 0), client certificates required, a CA and
certificates made by openssl in the test; a worker process and a Client complete jobs through
rediss:// URLs (certificate paths as ssl_* query arguments, which redis-py's from_url passes on,
so no genq code knows about TLS)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.async_client import AsyncClient
from tests.harness.fleet import WorkerProcess
from tests.harness.oracle import Oracle
from tests.harness.secure_redis import ADMIN_PASSWORD, OPENSSL, Certs, SecureRedis

GREEDY = {"temperature": 0, "max_tokens": 4}


def test_a_worker_and_a_client_complete_jobs_over_tls(
        tls_fleet: tuple[SecureRedis, WorkerProcess], offline: Oracle) -> None:
    server, worker = tls_fleet
    url = server.url_for("genq-producer")
    assert url.startswith(f"rediss://genq-producer:producer-secret@127.0.0.1:{server.port}/0?")
    assert worker.proc.args[worker.proc.args.index("--redis") + 1].startswith("rediss://")
    prompts = ["the quick brown fox", "over the lazy dog"]
    with Client(url) as client:
        jobs = [client.submit(p, GREEDY, model="tiny") for p in prompts]
        streamed = list(jobs[0].stream(timeout=60))
        results = [job.result(timeout=60) for job in jobs]
    expected = offline(prompts, GREEDY)
    assert [[(o["token_ids"], o["text"], o["finish_reason"]) for o in r["outputs"]]
            for r in results] == expected
    assert [t for e in streamed if e["type"] == "tokens" for t in e["token_ids"]] == \
        expected[0][0][0]
    conn = server.client()
    assert conn.config_get("port") == {"port": "0"}  # no plain-text listener at all
    assert conn.config_get("tls-auth-clients") == {"tls-auth-clients": "yes"}


def test_the_async_client_completes_a_job_over_tls(
        tls_fleet: tuple[SecureRedis, WorkerProcess], offline: Oracle) -> None:
    """redis.asyncio (AsyncClient, and the gateway's pools) takes the same rediss:// URL."""
    server, _ = tls_fleet

    async def run() -> dict[str, Any]:
        async with AsyncClient(server.url_for("genq-producer")) as client:
            job = await client.submit("jumps over", GREEDY, model="tiny")
            return await job.result(timeout=60)

    result = asyncio.run(run())
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in result["outputs"]] == \
        offline(["jumps over"], GREEDY)[0]


def tls_connection(server: SecureRedis, certs: Certs, **overrides: object) -> redis.Redis:
    settings: dict[str, object] = dict(
        port=server.port, password=ADMIN_PASSWORD, protocol=2, retry=None, socket_timeout=5,
        ssl=True, ssl_ca_certs=str(certs.ca), ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key))
    settings.update(overrides)
    return redis.Redis(**{k: v for k, v in settings.items() if v is not None})  # type: ignore


def refused(conn: redis.Redis) -> redis.ConnectionError:
    """The connection error of a PING (not a wrong password: AuthenticationError is a kind of
    ConnectionError in redis-py)."""
    with pytest.raises(redis.ConnectionError) as err:
        conn.ping()
    assert not isinstance(err.value, redis.AuthenticationError)
    return err.value


def test_the_same_connection_with_tls_and_a_client_certificate_answers(
        tls_fleet: tuple[SecureRedis, WorkerProcess], certs: Certs) -> None:
    server, _ = tls_fleet
    assert tls_connection(server, certs).ping() is True


def test_plain_tcp_is_refused(tls_fleet: tuple[SecureRedis, WorkerProcess],
                              certs: Certs) -> None:
    server, _ = tls_fleet
    refused(tls_connection(server, certs, ssl=None, ssl_ca_certs=None, ssl_certfile=None,
                           ssl_keyfile=None))


def test_a_client_without_a_certificate_is_refused(
        tls_fleet: tuple[SecureRedis, WorkerProcess], certs: Certs) -> None:
    server, _ = tls_fleet
    refused(tls_connection(server, certs, ssl_certfile=None, ssl_keyfile=None))


def test_a_server_not_signed_by_the_trusted_ca_is_refused(
        tls_fleet: tuple[SecureRedis, WorkerProcess], certs: Certs, tmp_path: Path) -> None:
    """The client checks the server: with another CA as its trust root, the handshake fails
    (an impostor on the network gets neither the password nor the prompts)."""
    server, _ = tls_fleet
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=some-other-ca", "-keyout", str(tmp_path / "other.key"),
                    "-out", str(tmp_path / "other.crt")], check=True, capture_output=True)
    conn = redis.Redis(port=server.port, password=ADMIN_PASSWORD, protocol=2, retry=None,
                       socket_timeout=5, ssl=True, ssl_ca_certs=str(tmp_path / "other.crt"),
                       ssl_certfile=str(certs.client_cert), ssl_keyfile=str(certs.client_key))
    with pytest.raises(redis.ConnectionError) as err:
        conn.ping()
    assert "certificate verify failed" in str(err.value)
