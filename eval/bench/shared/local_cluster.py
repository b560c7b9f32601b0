"""A loopback Redis Cluster (redis-server + redis-cli) for tests and the cluster bench.

Starts N masters with R replicas each on consecutive ports (cluster bus = port + 10000,
so ports stay <= 55535), and kills, pauses (SIGSTOP) or resumes nodes. Owns only the
processes it started and their directories; what runs against the cluster is the caller's.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

logger = logging.getLogger(__name__)

MAX_PORT = 55535  # the cluster bus listens on port + 10000


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spawn_redis(port: int, directory: Path, *flags: str) -> subprocess.Popen:
    """A private redis-server on 127.0.0.1:`port` that persists nothing (its files, if any, in
    `directory`), with `flags` added; quiet. The caller kills it."""
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    command += ["--save", "", "--appendonly", "no", "--dir", str(directory), *flags]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def redis_client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)


def wait_ping(port: int, timeout_s: float) -> None:
    """Until the redis-server on `port` answers PING; its `ConnectionError` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with redis_client(port) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def free_port_run(count: int, low: int = 21000, high: int = 45000) -> int:
    """The first port of `count` consecutive free ports whose bus ports are free too."""
    start = low + (os.getpid() * 37) % (high - low)
    for base in list(range(start, high, count)) + list(range(low, start, count)):
        ports = range(base, base + count)
        if all(_port_free(p) and _port_free(p + 10000) for p in ports):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high})")


@dataclass
class LocalCluster:
    """`start()` → a healthy cluster at `url`; `close()` kills every node."""

    workdir: Path
    num_masters: int = 3
    replicas_per_master: int = 1
    node_timeout_ms: int = 1000
    base_port: int = 0  # 0: pick free ports
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def ports(self) -> list[int]:
        count = self.num_masters * (1 + self.replicas_per_master)
        return list(range(self.base_port, self.base_port + count))

    @property
    def url(self) -> str:
        """Every node as a seed (any one reachable suffices)."""
        return "redis://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float) -> LocalCluster:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed")
        if not self.base_port:
            self.base_port = free_port_run(self.num_masters * (1 + self.replicas_per_master))
        if self.ports[-1] > MAX_PORT:
            raise ValueError(f"port {self.ports[-1]} > {MAX_PORT}: its bus port would not exist")
        for port in self.ports:
            self._spawn(port)
        for port in self.ports:
            wait_ping(port, timeout_s)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        replicas = ["--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, *replicas],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
        )
        self.wait_healthy(timeout_s)
        return self

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(timeout=10)
        self.processes.clear()

    def masters(self) -> list[int]:
        """Ports of the live masters, as the cluster sees them now."""
        return sorted(port for port, role in self._roles().items() if role == "master")

    def replica_of(self, master_port: int) -> int:
        for line in self._nodes_lines():
            parts = line.split()
            if "slave" in parts[2] and parts[3] == self._node_id(master_port):
                return int(parts[1].split(":")[1].split("@")[0])
        raise LookupError(f"no replica of {master_port}")

    def wait_promoted(self, dead_port: int, timeout_s: float = 30.0) -> float:
        """Seconds until a replica took over `dead_port`'s slots (3 live masters again)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            masters = self.masters()
            took_over = dead_port not in masters and len(masters) == self.num_masters
            if took_over and all(self._state_ok(port) for port in self._live_ports()):
                return time.monotonic() - started
            time.sleep(0.05)
        raise TimeoutError(f"no replica promoted for {dead_port} within {timeout_s} s")

    def kill(self, port: int) -> None:
        self.processes[port].kill()
        self.processes[port].wait(timeout=10)

    def pause(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGCONT)

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Start a killed node again (it rejoins with its nodes.conf, as a replica)."""
        self._spawn(port)
        wait_ping(port, timeout_s)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok, all slots are served and every
        replica's link to its master is up (a replica that never synced cannot fail over)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ports = self._live_ports()
            if all(self._state_ok(port) for port in ports) and all(map(self._synced, ports)):
                return
            time.sleep(0.1)
        raise TimeoutError(f"cluster not healthy within {timeout_s} s")

    def _live_ports(self) -> list[int]:
        return [port for port, proc in self.processes.items() if proc.poll() is None]

    def _spawn(self, port: int) -> None:
        directory = self.workdir / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        flags += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        # Other masters keep serving their slots while one is down (failover window).
        flags += ["--cluster-require-full-coverage", "no"]
        self.processes[port] = spawn_redis(port, directory, *flags)

    def _state_ok(self, port: int) -> bool:
        try:
            with redis_client(port) as client:
                info = client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        if isinstance(info, dict):  # redis-py parses the reply
            info = "\n".join(f"{key}:{value}" for key, value in info.items())
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_ok:16384" in text

    def _synced(self, port: int) -> bool:
        try:
            with redis_client(port) as client:
                info = client.info("replication")
        except redis.RedisError:
            return False
        return info.get("role") != "slave" or info.get("master_link_status") == "up"

    def _nodes_lines(self) -> list[str]:
        for port in self._live_ports():
            try:
                with redis_client(port) as client:
                    raw = client.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            return [line for line in text.splitlines() if line.strip()]
        raise RuntimeError("no live node answers CLUSTER NODES")

    def _roles(self) -> dict[int, str]:
        roles = {}
        for line in self._nodes_lines():
            parts = line.split()
            port = int(parts[1].split(":")[1].split("@")[0])
            if "fail" in parts[2]:
                continue
            roles[port] = "master" if "master" in parts[2] else "replica"
        return roles

    def _node_id(self, port: int) -> str:
        for line in self._nodes_lines():
            parts = line.split()
            if int(parts[1].split(":")[1].split("@")[0]) == port:
                return parts[0]
        raise LookupError(f"no node on port {port}")
