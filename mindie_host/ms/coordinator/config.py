"""``ms_coordinator.json`` (spec §4.3): every key, its range, and the overrides.

Overrides, strongest first: the positional ``predict_ip predict_port manage_ip manage_port``
arguments, then ``MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ`` and
``MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ`` (checked against the same ranges as the keys), then the
file, whose path comes from ``--config`` or ``MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``.

Scheduling (``digs_scheduler_config``): the spec pairs ``single_node`` with
``default_scheduler`` + ``cache_affinity``. mindie-host also accepts ``round_robin`` and
``load_balance`` as the algorithm of ``default_scheduler`` in ``single_node``. ``pd_separate``
(PD disaggregation, :mod:`.pd`) requires the spec's pairing, ``digs_scheduler`` +
``load_balance``; any other scheduler or algorithm is refused at startup.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..logs import LogInfo, read_log_info
from ..schema import ConfigError, Section, read_json_file
from ..tls import TLSLink, read_link, tls_base

ENV_PATH = "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"
ENV_SINGLE_NODE_MAX_REQ = "MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ"
ENV_MAX_REQ = "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ"
ALGORITHMS = ("cache_affinity", "round_robin", "load_balance")
REORDERING = {1: "FCFS", 2: "SJF", 3: "LJF"}
TLS_LINKS = ("controller_server", "request_server", "mindie_client", "mindie_mangment")

_TLS_OFF = {f"{link}_tls_enable": False for link in TLS_LINKS}

DEFAULTS: dict[str, Any] = {
    "http_config": {
        "predict_ip": "127.0.0.1", "predict_port": "1025", "manage_ip": "127.0.0.1", "manage_port": "1026",
        "server_thread_num": 1, "client_thread_num": 1, "http_timeout_seconds": 10, "keep_alive_seconds": 180,
        "server_name": "MindIE-MS", "user_agent": "Coordinator/1.0",
    },
    "request_limit": {"single_node_max_requests": 1000, "max_requests": 10000, "body_limit": 10},
    "metrics_config": {"enable": False, "trigger_size": 100},
    "prometheus_metrics_config": {"reuse_time": 3},
    "exception_config": {"max_retry": 5, "schedule_timeout": 60, "first_token_timeout": 60, "infer_timeout": 300,
                         "tokenizer_timeout": 300},
    "log_info": {"log_level": "INFO", "to_file": False, "to_stdout": True,
                 "run_log_path": "./logs/ms_coordinator_run_log.txt",
                 "operation_log_path": "./logs/ms_coordinator_operation_log.txt",
                 "max_log_str_size": 4096, "max_log_file_size": 20, "max_log_file_num": 10},
    "digs_scheduler_config": {
        "deploy_mode": "single_node", "scheduler_type": "default_scheduler", "algorithm_type": "cache_affinity",
        "cache_size": "100", "slots_thresh": "0.05", "block_thresh": "0.05", "max_schedule_count": "10000",
        "reordering_type": "1", "max_res_num": "5000",
    },
    "tls_config": _TLS_OFF,
}


def default_coordinator_dict() -> dict[str, Any]:
    """A complete ``ms_coordinator.json`` for a single-node cluster with TLS off."""
    return copy.deepcopy(DEFAULTS)


@dataclass(frozen=True)
class CoordinatorConfig:
    """The checked ``ms_coordinator.json``."""

    predict_ip: str
    predict_port: int
    manage_ip: str
    manage_port: int
    server_thread_num: int
    client_thread_num: int
    http_timeout_seconds: int
    keep_alive_seconds: int
    server_name: str
    user_agent: str
    single_node_max_requests: int
    max_requests: int
    body_limit_mb: int
    metrics_enable: bool
    metrics_trigger_size: int
    reuse_time: int
    max_retry: int
    schedule_timeout: int
    first_token_timeout: int
    infer_timeout: int
    tokenizer_timeout: int
    log: LogInfo
    deploy_mode: str
    scheduler_type: str
    algorithm_type: str
    cache_size: int
    slots_thresh: float
    block_thresh: float
    max_schedule_count: int
    reordering_type: str
    max_res_num: int
    tls: dict[str, TLSLink]
    source_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def body_limit_bytes(self) -> int:
        return self.body_limit_mb * 1024 * 1024


def _env_int(env: Mapping[str, str], name: str, lo: int, hi: int) -> int | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    if not text.strip().isdigit() or not lo <= int(text) <= hi:
        raise ConfigError(name, text, f"an integer in [{lo}, {hi}]")
    return int(text)


def coordinator_config_from_dict(data: Any, *, source_path: str | None = None,
                                 environ: Mapping[str, str] | None = None,
                                 positional: list[str] | None = None) -> CoordinatorConfig:
    """Check ``data`` (a parsed ``ms_coordinator.json``) and apply the overrides."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    root = Section(data, "", warnings)
    http = root.section("http_config")
    addr = {
        "predict_ip": http.ip("predict_ip"), "predict_port": http.str_int("predict_port", 1024, 65535),
        "manage_ip": http.ip("manage_ip"), "manage_port": http.str_int("manage_port", 1024, 65535),
    }
    if positional:
        if len(positional) != 4:
            raise ConfigError("arguments", positional, "none, or all four of: predict_ip predict_port manage_ip "
                              "manage_port")
        over = Section(dict(zip(("predict_ip", "predict_port", "manage_ip", "manage_port"), positional)),
                       "arguments", warnings)
        addr = {"predict_ip": over.ip("predict_ip"), "predict_port": over.str_int("predict_port", 1024, 65535),
                "manage_ip": over.ip("manage_ip"), "manage_port": over.str_int("manage_port", 1024, 65535)}
    if (addr["predict_ip"], addr["predict_port"]) == (addr["manage_ip"], addr["manage_port"]):
        raise ConfigError("http_config.manage_port", addr["manage_port"], "a port other than predict_port")
    http_values = {
        "server_thread_num": http.integer("server_thread_num", 1, 10000),
        "client_thread_num": http.integer("client_thread_num", 1, 10000),
        "http_timeout_seconds": http.integer("http_timeout_seconds", 0, 600),
        "keep_alive_seconds": http.integer("keep_alive_seconds", 0, 3600),
        "server_name": http.string("server_name", max_len=256),
        "user_agent": http.string("user_agent", max_len=256),
    }
    http.finish()
    limit = root.section("request_limit")
    single = limit.integer("single_node_max_requests", 1, 2000)
    total = limit.integer("max_requests", 1, 90000)
    body = limit.integer("body_limit", 1, 20)
    limit.finish()
    single = _env_int(env, ENV_SINGLE_NODE_MAX_REQ, 1, 2000) or single
    total = _env_int(env, ENV_MAX_REQ, 1, 90000) or total
    metrics = root.section("metrics_config")
    metrics_enable, trigger = metrics.boolean("enable"), metrics.integer("trigger_size", 1, 10000)
    metrics.finish()
    prom = root.section("prometheus_metrics_config")
    reuse = prom.integer("reuse_time", 1, 100)
    prom.finish()
    exc = root.section("exception_config")
    exc_values = {
        "max_retry": exc.integer("max_retry", 0, 10),
        "schedule_timeout": exc.integer("schedule_timeout", 0, 3600),
        "first_token_timeout": exc.integer("first_token_timeout", 0, 3600),
        "infer_timeout": exc.integer("infer_timeout", 0, 3600),
        "tokenizer_timeout": exc.integer("tokenizer_timeout", 0, 3600),
    }
    exc.finish()
    log = read_log_info(root.section("log_info"), min_str_size=128)
    digs = root.section("digs_scheduler_config")
    mode = digs.string("deploy_mode", choices=("pd_separate", "single_node"))
    scheduler = digs.string("scheduler_type", choices=("digs_scheduler", "default_scheduler"))
    algorithm = digs.string("algorithm_type", choices=ALGORITHMS)
    if mode == "pd_separate":
        if scheduler != "digs_scheduler":
            raise ConfigError("digs_scheduler_config.scheduler_type", scheduler,
                              "'digs_scheduler' when deploy_mode is 'pd_separate'")
        if algorithm != "load_balance":
            raise ConfigError("digs_scheduler_config.algorithm_type", algorithm,
                              "'load_balance' when deploy_mode is 'pd_separate' (scheduler_type 'digs_scheduler')")
    elif scheduler != "default_scheduler":
        raise ConfigError("digs_scheduler_config.scheduler_type", scheduler,
                          "'default_scheduler' when deploy_mode is 'single_node'")
    sched_values = {
        "cache_size": digs.str_int("cache_size", 1, 10000),
        "slots_thresh": digs.str_float("slots_thresh", 0.0, 1.0),
        "block_thresh": digs.str_float("block_thresh", 0.0, 1.0),
        "max_schedule_count": digs.str_int("max_schedule_count", 1, 90000),
        "reordering_type": REORDERING[digs.str_int("reordering_type", 1, 3)],
        "max_res_num": digs.str_int("max_res_num", 1, 10000),
    }
    digs.finish()
    tls_section = root.section("tls_config")
    base = tls_base(source_path)
    tls = {link: read_link(tls_section, link, base) for link in TLS_LINKS}
    tls_section.finish()
    root.finish()
    return CoordinatorConfig(
        **addr, **http_values, single_node_max_requests=single, max_requests=total, body_limit_mb=body,
        metrics_enable=metrics_enable, metrics_trigger_size=trigger, reuse_time=reuse, **exc_values, log=log,
        deploy_mode=mode, scheduler_type=scheduler, algorithm_type=algorithm, **sched_values, tls=tls,
        source_path=source_path, warnings=warnings,
    )


def load_coordinator_config(path: str | None = None, *, environ: Mapping[str, str] | None = None,
                            positional: list[str] | None = None) -> CoordinatorConfig:
    """Read ``path`` (or ``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``) and check it."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_PATH)
    if not path:
        raise ConfigError(ENV_PATH, None, f"an ms_coordinator.json path: pass --config or set {ENV_PATH}")
    return coordinator_config_from_dict(read_json_file(path), source_path=path, environ=env, positional=positional)
