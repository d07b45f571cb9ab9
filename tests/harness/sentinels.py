"""A replicated Redis for failover tests: a primary, one replica and three sentinels, each a real
redis-server process on a free port (a node can be killed with -9 and started again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from tests.harness.fleet import REDIS_SERVER, RedisServer, free_port, wait_for

SERVICE = "genq"


class DataNode(RedisServer):
    """A redis-server (appendonly, fsync always) that may start as a replica of `primary`."""

    def __init__(self, directory: Path, replica_of: int | None = None) -> None:
        super().__init__(directory)
        self.replica_of = replica_of

    def start(self) -> None:
        extra = [] if self.replica_of is None else ["--replicaof", "127.0.0.1",
                                                    str(self.replica_of)]
        self._start_with(extra)

    def _start_with(self, extra: list[str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--logfile", str(self.dir / "redis.log"), "--repl-diskless-sync-delay", "0",
             *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._pings, timeout=20, interval=0.02, what=f"redis-server on {self.port}")

    def _pings(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.ConnectionError:
            return False


class SentinelSet:
    """primary + replica + 3 sentinels (quorum 2, down after 1 s)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes = [DataNode(root / "a")]
        self.nodes.append(DataNode(root / "b", replica_of=self.nodes[0].port))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        wait_for(lambda: self.nodes[1].client().info("replication").get("master_link_status")
                 == "up", timeout=30, what="the replica's link to its primary")
        for i, port in enumerate(self.sentinel_ports):
            conf = self.root / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.nodes[0].port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n")
            self.sentinels.append(subprocess.Popen(
                [REDIS_SERVER, str(conf), "--sentinel", "--logfile",
                 str(self.root / f"sentinel-{i}.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # Every sentinel sees the replica and the two other sentinels: a failover can be agreed.
        wait_for(self._sentinels_ready, timeout=60, interval=0.1, what="the sentinels")

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], socket_timeout=5, decode_responses=True)

    def _sentinels_ready(self) -> bool:
        try:
            return all(len(self.sentinel(i).sentinel_sentinels(SERVICE)) == 2
                       and len(self.sentinel(i).sentinel_slaves(SERVICE)) == 1
                       for i in range(3))
        except redis.ConnectionError:
            return False

    def primary_port(self) -> int:
        _host, port = self.sentinel().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def node_on(self, port: int) -> DataNode:
        return next(n for n in self.nodes if n.port == port)

    def primary(self) -> redis.Redis:
        """A direct connection to the node the sentinels name primary now."""
        return self.node_on(self.primary_port()).client()

    def wait_primary_other_than(self, port: int, timeout: float = 60.0) -> int:
        """Until the sentinels name another primary, and it takes writes."""
        def moved() -> int:
            now = self.primary_port()
            if now == port:
                return 0
            try:
                role = self.node_on(now).client().execute_command("ROLE")
            except redis.ConnectionError:
                return 0
            return now if role[0] == b"master" else 0
        return wait_for(moved, timeout=timeout, interval=0.1, what="a new primary")

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in self.nodes:
            node.kill()
