"""A Redis Cluster for tests: real redis-server processes in cluster mode on free ports, the
slots split evenly over the masters, each master with its replicas (a node can be killed with -9,
failed over, or have a slot migrated away)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.harness.fleet import wait_for
from tests.harness.sentinels import DataNode

NUM_SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens this far above its port


def cluster_port() -> int:
    """A free port whose cluster bus port is free too (both below 65536)."""
    while True:
        port = random.randrange(20000, 65536 - BUS_OFFSET)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + BUS_OFFSET))
            return port
        except OSError:
            continue


class ClusterNodeServer(DataNode):
    """One node of a cluster (appendonly, fsync always; its nodes.conf in its directory)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.port = cluster_port()

    def start(self) -> None:
        self._start_with(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", "2000"])

    def client(self) -> redis.Redis:
        """A plain client of this node alone (it answers for its own slots only)."""
        return redis.Redis(port=self.port, protocol=2, socket_timeout=10)

    def node_id(self) -> str:
        return str(self.client().execute_command("CLUSTER", "MYID").decode())


class RedisClusterSet:
    """`masters` masters, each with `replicas` replicas, slots split evenly in port order."""

    def __init__(self, root: Path, masters: int = 1, replicas: int = 0) -> None:
        self.masters = [ClusterNodeServer(root / f"m{k}") for k in range(masters)]
        self.replicas = [ClusterNodeServer(root / f"r{k}") for k in range(masters * replicas)]
        self.per_master = replicas

    @property
    def nodes(self) -> list[ClusterNodeServer]:
        return self.masters + self.replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.masters)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        first = self.masters[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        share = NUM_SLOTS // len(self.masters)
        for k, master in enumerate(self.masters):
            last = NUM_SLOTS - 1 if k == len(self.masters) - 1 else (k + 1) * share - 1
            master.client().execute_command("CLUSTER", "ADDSLOTSRANGE", k * share, last)
        wait_for(self._all_known, timeout=60, interval=0.05, what="the nodes to meet")
        for k, replica in enumerate(self.replicas):
            master = self.masters[k // self.per_master]
            replica.client().execute_command("CLUSTER", "REPLICATE", master.node_id())
        wait_for(self.healthy, timeout=60, interval=0.05, what="cluster_state:ok")

    def _all_known(self) -> bool:
        return all(len(n.client().execute_command("CLUSTER", "NODES").splitlines())
                   == len(self.nodes) for n in self.nodes)

    def healthy(self) -> bool:
        """Every node says the cluster is ok, and every replica's link to its master is up."""
        for node in self.nodes:
            try:
                info = node.client().execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
            except redis.ConnectionError:
                return False
        return all(r.client().info("replication").get("master_link_status") == "up"
                   for r in self.replicas)

    def client(self) -> RedisCluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port)
                                           for n in self.masters], protocol=2, socket_timeout=10)

    def owner(self, key: str) -> ClusterNodeServer:
        """The master that holds `key`'s slot now."""
        slot = int(self.masters[0].client().execute_command("CLUSTER", "KEYSLOT", key))
        for node in self.nodes:
            for start, end, *holders in node.client().execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(holders[0][1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no node holds slot {slot}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
