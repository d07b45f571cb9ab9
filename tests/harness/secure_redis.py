"""A redis-server with ACL users (and optionally TLS only), the genq ACL lines, and test
certificates made with the openssl CLI.

The ACL lines here are the ones docs/security.md documents: the tests run a real worker,
producer and gateway through them, so a command genq starts to need shows up as a failing test
(and as an entry in ACL LOG), not as a surprise in production.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from tests.harness.fleet import REDIS_SERVER, free_port

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
ADMIN_PASSWORD = "admin-secret"  # the default user's password in these tests
PASSWORDS = {"genq-worker": "worker-secret", "genq-producer": "producer-secret",
             "genq-gateway": "gateway-secret"}

# What each genq role needs, for the default prefix "genq" (replace it if --prefix differs).
# A selector "(...)" grants its commands on its keys only: EVALSHA declares its keys read-write,
# so producers get the job streams and idempotency keys read-write inside a selector whose only
# commands are the submit script's, and XREAD stays limited to reply streams (a producer cannot
# read other applications' prompts from a job stream).
# Workers: consume the job stream (XREADGROUP, fenced XACK/XDEL and XCLAIM in Lua), write reply
# streams, dead letters and their heartbeat (and their name in the registry), read cancel flags
# and their model's cancel channel (a shard channel).
# Producers (Client, AsyncClient, the Celery bridge): enqueue through the idempotent submit
# script, read reply streams, set cancel flags and publish cancels (SPUBLISH).
# The gateway: a producer that also lists live workers (the registry's sets and heartbeats) and
# reads queue depths, and
# keeps the Batch API's batches, file objects and leases (BATCH_SELECTOR).
_SUBMIT = "(~genq:jobs:* ~genq:idem:* +evalsha +xadd +set +expire)"
# Client.results' last-entry script; EXISTS: whether an unread result expired (reply_expired)
RESULTS_SELECTOR = "(~genq:reply:* +evalsha +xrevrange +exists)"
# a job's ended mark (producer.results); a sharded model's shard count (producer/shards.py)
ENDED_SELECTOR = "(%R~genq:idem:* %R~genq:shards:* +get +mget)"
BATCH_SELECTOR = ("(~genq:batch* ~genq:file:* +hset +hget +hmget +hexists +hsetnx +zadd "
                  "+zrevrange +zrem +sadd +srem +smembers +get +set +del +exists +expire)")
ACL_RULES: dict[str, tuple[str, ...]] = {
    "genq-worker": (
        "resetkeys", "~genq:jobs:*", "~genq:reply:*", "~genq:dead:*", "~genq:worker:*",
        "~genq:fence:*", "~genq:shards:*", "%R~genq:cancel:*", "~genq:idem:*", "resetchannels",
        "&genq:cancel:*", "-@all",
        "+xreadgroup", "+xack", "+xdel", "+xadd", "+xclaim", "+xpending", "+xinfo|consumers",
        "+xgroup|create", "+xgroup|delconsumer", "+evalsha", "+script|load", "+script|exists",
        "+set", "+get", "+incr", "+exists", "+expire", "+del", "+sadd", "+srem", "+ssubscribe"),
    "genq-producer": (
        "resetkeys", "%R~genq:reply:*", "%W~genq:cancel:*", "resetchannels", "&genq:cancel:*",
        "-@all", "+xread", "+set", "+spublish", "+script|load", "+script|exists", _SUBMIT,
        RESULTS_SELECTOR, ENDED_SELECTOR),
    "genq-gateway": (
        "resetkeys", "%R~genq:reply:*", "%W~genq:cancel:*", "%R~genq:worker:*", "resetchannels",
        "&genq:cancel:*", "-@all", "+xread", "+set", "+spublish", "+script|load",
        "+script|exists", "+smembers", "+mget", _SUBMIT, RESULTS_SELECTOR, ENDED_SELECTOR,
        "(%R~genq:jobs:* +xinfo|groups +xlen)", BATCH_SELECTOR),
}


def acl_line(user: str) -> str:
    """The `user ...` line for an ACL file (or, without 'user', the args of ACL SETUSER)."""
    return " ".join(("user", user, "on", f">{PASSWORDS[user]}", *ACL_RULES[user]))


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by
    the CA (RSA 2048, one day)."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=genq-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=genq-test-{name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        (directory / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
    return Certs(ca=directory / "ca.crt", server_cert=directory / "server.crt",
                 server_key=directory / "server.key", client_cert=directory / "client.crt",
                 client_key=directory / "client.key")


class SecureRedis:
    """redis-server whose default user needs a password, with the genq users loaded from an ACL
    file made of acl_line()s; with `certs`, it listens on TLS only (--port 0 --tls-port, client
    certificates required). Quacks like tests.harness.fleet.RedisServer (url, client)."""

    def __init__(self, directory: Path, certs: Certs | None = None) -> None:
        self.dir = directory
        self.certs = certs
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    # -------------------------------------------------------------- connecting

    def url_for(self, user: str | None = None, password: str | None = None) -> str:
        """A URL as a worker/producer/gateway gets it (--redis / Client(url))."""
        auth = ""
        if user is not None:
            auth = f"{quote(user, safe='')}:{quote(password or PASSWORDS[user], safe='')}@"
        if self.certs is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        c = self.certs
        query = (f"ssl_ca_certs={quote(str(c.ca))}&ssl_certfile={quote(str(c.client_cert))}"
                 f"&ssl_keyfile={quote(str(c.client_key))}")
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    @property
    def url(self) -> str:
        return self.url_for("default", ADMIN_PASSWORD)

    def client(self) -> redis.Redis:
        """An admin connection (the default user)."""
        return redis.Redis.from_url(self.url, protocol=2, socket_timeout=10)

    def as_user(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url_for(user), protocol=2, socket_timeout=10)

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "yes", "--appendfsync", "everysec",
                "--logfile", str(self.dir / "redis.log"), "--aclfile", str(self.acl_file())]
        if self.certs is None:
            args += ["--port", str(self.port)]
        else:
            c = self.certs
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                     str(c.server_cert), "--tls-key-file", str(c.server_key),
                     "--tls-ca-cert-file", str(c.ca), "--tls-auth-clients", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    log = self.dir / "redis.log"
                    raise RuntimeError("redis-server did not start:\n" + (
                        log.read_text() if log.exists() else "")) from None
                time.sleep(0.02)
        self.client().execute_command("ACL", "LOG", "RESET")

    def acl_file(self) -> Path:
        """The users file the server loads: the default (admin) user with a password, then the
        genq users exactly as docs/security.md's lines."""
        path = self.dir / "users.acl"
        lines = [f"user default on >{ADMIN_PASSWORD} ~* &* +@all"]
        path.write_text("\n".join(lines + [acl_line(user) for user in ACL_RULES]) + "\n")
        return path

    def acl_log(self) -> list[dict[str, object]]:
        entries = self.client().execute_command("ACL", "LOG")
        return [dict(zip(e[::2], e[1::2], strict=True)) if isinstance(e, list) else e
                for e in entries]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None
