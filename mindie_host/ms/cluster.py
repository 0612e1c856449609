"""``mindie-host cluster --servers N``: a controller, a coordinator and N servers on one machine.

Everything runs as child processes of this one, each with its config file and log under the
work directory (``--workdir``, default ``./mindie-cluster``):

* ``server-K.json`` / ``logs/server-K.log``: the servers, on free loopback ports, from the
  default config or ``--server-config``;
* ``global_rank_table.json``: the rank table naming them (with the mindie-host port extension);
* ``ms_controller.json`` / ``ms_coordinator.json`` and their logs.

The coordinator's user port is ``--port`` (default 1025). Ctrl-C (or SIGTERM) stops every
process: each gets SIGTERM, and SIGKILL if it is still there after ``--grace`` seconds.
:class:`Cluster` does the same for tests and benchmarks.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import httpx

from ..config import default_config_dict
from ..distributed.cores import core_share
from ..file_modes import write_file
from ..testing import free_port
from .controller.config import default_controller_dict
from .coordinator.config import default_coordinator_dict
from .coordinator.instances import instance_id


def _die_with_parent() -> None:
    """In the child (Linux): get SIGTERM when the cluster's own process dies, so no server outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ClusterError(RuntimeError):
    """A process of the cluster did not start."""


def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


class Cluster:
    """N servers, a controller and a coordinator as child processes."""

    def __init__(self, workdir: str | Path, servers: int = 2, *, server_config: dict[str, Any] | None = None,
                 predict_port: int | None = None, manage_port: int | None = None,
                 coordinator: dict[str, Any] | None = None, controller: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> None:
        if servers < 1:
            raise ValueError("a cluster needs at least one server")
        self.workdir = Path(workdir).resolve()
        self.count = servers
        self.base_server = copy.deepcopy(server_config) if server_config else default_config_dict()
        self.predict_port = predict_port or free_port()
        self.manage_port = manage_port or free_port()
        self.controller_port = free_port()
        self.coordinator_overrides = coordinator or {}
        self.controller_overrides = controller or {}
        self.env = {**os.environ, **(env or {})}
        self.servers: list[dict[str, Any]] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    # -- configs --------------------------------------------------------------------------------
    def write_configs(self) -> None:
        """Write every config file and the rank table under the work directory."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.servers = []
        for _ in range(self.count):
            self.add_server()
        self.write_rank_table()
        ctl = default_controller_dict()
        _deep_update(ctl, {
            "process_manager": {"file_path": str(self.workdir / "logs/controller_process_status.json")},
            "cluster_status": {"file_path": str(self.workdir / "logs/cluster_status_output.json")},
            "global_rank_table_file_path": str(self.workdir / "global_rank_table.json"),
            "rank_table_detecting_seconds": 5, "server_online_attempt_times": 600, "server_online_wait_seconds": 1,
            "http_timeout_seconds": 5, "http_retries": 0, "mindie_ms_coordinator_port": self.manage_port,
            "http_server": {"ip": "127.0.0.1", "port": self.controller_port},
        })
        _deep_update(ctl, self.controller_overrides)
        write_file(self.workdir / "ms_controller.json", json.dumps(ctl, indent=2))
        coord = default_coordinator_dict()
        _deep_update(coord, {"http_config": {"predict_port": str(self.predict_port),
                                             "manage_port": str(self.manage_port)}})
        _deep_update(coord, self.coordinator_overrides)
        write_file(self.workdir / "ms_coordinator.json", json.dumps(coord, indent=2))

    def add_server(self, config: dict[str, Any] | None = None) -> int:
        """Write ``server-K.json`` for one more server (``config``, else the base config) on free ports; returns K."""
        k = len(self.servers)
        cfg = copy.deepcopy(config if config is not None else self.base_server)
        s = cfg["ServerConfig"]
        s.update({"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": free_port(),
                  "managementPort": free_port(), "metricsPort": free_port()})
        if s.get("inferMode") == "dmi":  # PD: each server's inter-instance port, all on one machine
            s["interCommPort"] = free_port()
        path = self.workdir / f"server-{k}.json"
        write_file(path, json.dumps(cfg, indent=2))
        self.servers.append({"config": str(path), "ip": "127.0.0.1", "port": s["port"],
                             "management_port": s["managementPort"], "metric_port": s["metricsPort"],
                             "scheme": "https" if s.get("httpsEnabled") else "http"})
        return k

    def write_rank_table(self, members: Iterable[int] | None = None) -> None:
        """Write the rank table listing servers ``members`` (default: all), replacing the file in one step."""
        listed = [self.servers[k] for k in (range(len(self.servers)) if members is None else members)]
        rank_table = {
            "version": "1.0", "status": "completed",
            "server_group_list": [
                {"group_id": "0", "server_count": "1",
                 "server_list": [{"server_id": "127.0.0.1", "server_ip": "127.0.0.1", "port": self.manage_port}]},
                {"group_id": "1", "server_count": "1",
                 "server_list": [{"server_id": "127.0.0.1", "server_ip": "127.0.0.1"}]},
                {"group_id": "2", "server_count": str(len(listed)), "server_list": [
                    {"server_id": "127.0.0.1", "server_ip": "127.0.0.1", "device": [], "port": srv["port"],
                     "management_port": srv["management_port"], "metric_port": srv["metric_port"]}
                    for srv in listed]},
            ],
        }
        write_file(self.workdir / "global_rank_table.json", json.dumps(rank_table, indent=2))  # atomic, 0640

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env or self.env, cwd=self.workdir,
                                            start_new_session=True, preexec_fn=_die_with_parent)

    def server_threads(self) -> int | None:
        """Compute threads of each server: this machine's cores shared evenly among the servers (at least one),
        or None where the environment sets ``OMP_NUM_THREADS`` itself (it is kept).

        Every server's engine would otherwise take a thread per core, and on a machine with fewer cores than that
        their OpenMP threads spin against each other at every parallel region's end: the test suite's cluster ran
        its requests 5-11x slower that way on 2 cores."""
        return None if "OMP_NUM_THREADS" in self.env else core_share(len(self.servers) or self.count)

    def start_server(self, k: int) -> None:
        """Start (or restart) server ``k``, with its share of the cores (:meth:`server_threads`)."""
        threads = self.server_threads()
        env = self.env if threads is None else {**self.env, "OMP_NUM_THREADS": str(threads)}
        self._spawn(f"server-{k}", ["serve", "--config", self.servers[k]["config"]], env)

    def start(self, timeout: float = 300.0, wait: bool = True) -> Cluster:
        """Write the configs, start every process and wait until the coordinator routes to all servers."""
        self.write_configs()
        for k in range(self.count):
            self.start_server(k)
        self._spawn("controller", ["controller", "--config", str(self.workdir / "ms_controller.json")])
        self._spawn("coordinator", ["coordinator", "--config", str(self.workdir / "ms_coordinator.json")])
        if wait:
            try:
                self.wait_instances(self.count, timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_instances(self, count: int, timeout: float = 300.0) -> None:
        """Wait until the coordinator has ``count`` instances in rotation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name in ("controller", "coordinator"):
                    raise ClusterError(f"{name} exited with {proc.returncode}; see {self.workdir}/logs/{name}.log")
            if len(self.live_ids()) >= count:
                return
            time.sleep(0.2)
        raise ClusterError(f"the coordinator did not get {count} instances within {timeout:g} s; logs in "
                           f"{self.workdir}/logs")

    def live_ids(self) -> list[int]:
        """Ids the coordinator currently routes to (empty when it does not answer)."""
        try:
            info = httpx.get(f"{self.manage_url}/v1/coordinator_info", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return []
        return [e["id"] for e in info.get("schedule_info", [])]

    def server_id(self, k: int) -> int:
        return instance_id(self.servers[k]["ip"], self.servers[k]["port"])

    def server_url(self, k: int) -> str:
        srv = self.servers[k]
        return f"{srv['scheme']}://{srv['ip']}:{srv['port']}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.predict_port}"

    @property
    def manage_url(self) -> str:
        return f"http://127.0.0.1:{self.manage_port}"

    @property
    def controller_url(self) -> str:
        return f"http://127.0.0.1:{self.controller_port}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one process (``server-K``, ``controller`` or ``coordinator``)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait()

    def stop_process(self, name: str, grace: float) -> None:
        """SIGTERM one process (a server drains), and SIGKILL it if it is still there after ``grace`` seconds."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every process, then SIGKILL what is left after ``grace`` seconds."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_cluster(servers: int, workdir: str, port: int, server_config: dict[str, Any] | None,
                algorithm: str) -> int:
    """The ``cluster`` command: start, print the addresses, wait for Ctrl-C, stop."""
    cluster = Cluster(workdir, servers, server_config=server_config, predict_port=port,
                      coordinator={"digs_scheduler_config": {"algorithm_type": algorithm}})
    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Ctrl-C as well as SIGTERM, even when started with SIGINT ignored (a background job of a shell script)
    previous = signal.signal(signal.SIGTERM, on_signal)
    previous_int = signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"starting {servers} server(s), a controller and a coordinator; logs in {cluster.workdir}/logs",
              file=sys.stderr)
        cluster.start()
        print(f"ready: send requests to {cluster.url} (management {cluster.manage_url}, controller "
              f"{cluster.controller_url}); Ctrl-C stops everything", file=sys.stderr)
        while True:
            for name, proc in cluster.procs.items():
                if proc.poll() is not None and name in ("controller", "coordinator"):
                    raise ClusterError(f"{name} exited with {proc.returncode}; see {cluster.workdir}/logs/{name}.log")
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping the cluster", file=sys.stderr)
        return 0
    except ClusterError as exc:
        print(f"mindie-host cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
