"""``ms_controller.json`` (spec §4.2): every key, its range, and the environment overrides.

``GLOBAL_RANK_TABLE_FILE_PATH`` overrides ``global_rank_table_file_path``, ``POD_IP`` the HTTP
server's ``ip``, ``MINDIE_MS_P_RATE``/``MINDIE_MS_D_RATE`` the P/D rates, and
``MINDIE_MS_CONTROLLER_CONFIG_FILE_PATH`` names the file when ``--config`` is not given.

``deploy_mode`` ``pd_separate`` (PD disaggregation) uses the role keys: ``default_p_rate`` /
``default_d_rate`` (or, both 0, ``digs_request_summary_input_length`` / ``_output_length``) for the
P:D split (:func:`~.roles.decide_roles`; with ``is_heterogeneous`` each server's rank-table
``hardware_type`` decides instead), ``init_role_attempt_times``, ``check_role_attempt_times``
and ``check_role_wait_seconds`` for pushing roles (:mod:`.roles`). The other digs keys (model and
machine files, SLOs, ``digs_pp``) are checked but not used.
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

ENV_PATH = "MINDIE_MS_CONTROLLER_CONFIG_FILE_PATH"
ENV_RANK_TABLE = "GLOBAL_RANK_TABLE_FILE_PATH"
TLS_LINKS = ("request_coordinator", "request_server", "http_server")
U16 = 65535

DEFAULTS: dict[str, Any] = {
    "deploy_mode": "single_node",
    "process_manager": {"to_file": True, "file_path": "./logs/controller_process_status.json"},
    "cluster_status": {"to_file": True, "file_path": "./logs/cluster_status_output.json"},
    "global_rank_table_file_path": "./conf/global_rank_table_file.json",
    "cluster_synchronization_seconds": 1, "rank_table_detecting_seconds": 60,
    "disappeared_server_waiting_seconds": 120, "default_p_rate": 0, "default_d_rate": 0, "is_heterogeneous": False,
    "server_online_attempt_times": 60, "server_online_wait_seconds": 5, "init_role_attempt_times": 2,
    "check_role_attempt_times": 60, "check_role_wait_seconds": 5,
    "mindie_server_control_port": 1026, "mindie_server_port": 1025, "mindie_ms_coordinator_port": 1026,
    "mindie_server_metric_port": 1027, "http_timeout_seconds": 20, "http_retries": 3,
    "role_decision_methods": "digs", "digs_request_summary_input_length": 3000,
    "digs_request_summary_output_length": 200, "digs_model_config_path": "./conf/model_config/llama2-70B.json",
    "digs_machine_config_path": "./conf/machine_config/800IA2.json", "digs_prefill_slo": 1000,
    "digs_decode_slo": 50, "model_type": "llama2-70B", "transfer_type": "D2DTransfer", "digs_pp": 1,
    "http_server": {"ip": "127.0.0.1", "port": 1026},
    "tls_config": {f"{link}_tls_enable": False for link in TLS_LINKS},
    "log_info": {"log_level": "INFO", "to_file": False, "to_stdout": True,
                 "run_log_path": "./logs/ms_controller_run_log.txt",
                 "operation_log_path": "./logs/ms_controller_operation_log.txt",
                 "max_log_str_size": 4096, "max_log_file_size": 20, "max_log_file_num": 10},
}


def default_controller_dict() -> dict[str, Any]:
    """A complete ``ms_controller.json`` for single_node with TLS off."""
    return copy.deepcopy(DEFAULTS)


@dataclass(frozen=True)
class ControllerConfig:
    """The checked ``ms_controller.json``."""

    deploy_mode: str
    process_manager_to_file: bool
    process_manager_path: str
    cluster_status_to_file: bool
    cluster_status_path: str
    rank_table_path: str
    sync_seconds: int
    rank_table_detecting_seconds: int
    disappeared_server_waiting_seconds: int
    server_online_attempt_times: int
    server_online_wait_seconds: int
    server_control_port: int
    server_port: int
    coordinator_port: int
    server_metric_port: int
    http_timeout_seconds: int
    http_retries: int
    http_ip: str
    http_port: int
    tls: dict[str, TLSLink]
    log: LogInfo
    p_rate: int = 0
    d_rate: int = 0
    init_role_attempt_times: int = 2
    check_role_attempt_times: int = 60
    check_role_wait_seconds: int = 5
    digs_input_length: int = 3000
    digs_output_length: int = 200
    is_heterogeneous: bool = False
    source_path: str | None = None
    warnings: list[str] = field(default_factory=list)


def controller_config_from_dict(data: Any, *, source_path: str | None = None,
                                environ: Mapping[str, str] | None = None) -> ControllerConfig:
    """Check ``data`` (a parsed ``ms_controller.json``) and apply the environment overrides."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    root = Section(data, "", warnings)
    mode = root.string("deploy_mode", choices=("pd_separate", "single_node"))
    pm = root.section("process_manager")
    pm_values = (pm.boolean("to_file"), pm.string("file_path"))
    pm.finish()
    cs = root.section("cluster_status")
    cs_values = (cs.boolean("to_file"), cs.string("file_path"))
    cs.finish()
    rank_table = root.string("global_rank_table_file_path")
    rank_table = env.get(ENV_RANK_TABLE) or rank_table
    ints = {
        "sync_seconds": root.integer("cluster_synchronization_seconds", 1, U16),
        "rank_table_detecting_seconds": root.integer("rank_table_detecting_seconds", 1, U16),
        "disappeared_server_waiting_seconds": root.integer("disappeared_server_waiting_seconds", 0, U16),
        "server_online_attempt_times": root.integer("server_online_attempt_times", 1, U16),
        "server_online_wait_seconds": root.integer("server_online_wait_seconds", 1, U16),
        "server_control_port": root.integer("mindie_server_control_port", 1024, U16),
        "server_port": root.integer("mindie_server_port", 1024, U16),
        "coordinator_port": root.integer("mindie_ms_coordinator_port", 1024, U16),
        "server_metric_port": root.integer("mindie_server_metric_port", 1024, U16),
        "http_timeout_seconds": root.integer("http_timeout_seconds", 1, 600),
        "http_retries": root.integer("http_retries", 0, 10),
    }
    p_rate = root.integer("default_p_rate", 0, 15)
    d_rate = root.integer("default_d_rate", 0, 15)
    for name, var in (("default_p_rate", "MINDIE_MS_P_RATE"), ("default_d_rate", "MINDIE_MS_D_RATE")):
        text = env.get(var)
        if text:
            if not text.isdigit() or not 0 <= int(text) <= 15:
                raise ConfigError(var, text, "an integer in [0, 15]")
            p_rate, d_rate = (int(text), d_rate) if name == "default_p_rate" else (p_rate, int(text))
    if (p_rate == 0) != (d_rate == 0) or p_rate + d_rate > 16:
        raise ConfigError("default_p_rate/default_d_rate", f"{p_rate}/{d_rate}",
                          "both 0 (automatic), or both non-zero with default_p_rate + default_d_rate <= 16")
    heterogeneous = root.boolean("is_heterogeneous")
    roles = {name: root.integer(name, 1, U16)
             for name in ("init_role_attempt_times", "check_role_attempt_times", "check_role_wait_seconds")}
    root.string("role_decision_methods", choices=("digs",))
    digs_in = root.integer("digs_request_summary_input_length", 1, 2**31 - 1)
    digs_out = root.integer("digs_request_summary_output_length", 1, 2**31 - 1)
    for name in ("digs_model_config_path", "digs_machine_config_path", "model_type", "transfer_type"):
        root.string(name)
    root.integer("digs_prefill_slo", 1, 2**31 - 1)
    root.integer("digs_decode_slo", 1, 2**31 - 1)
    root.integer("digs_pp", 1, 1024)
    http = root.section("http_server")
    http_ip = http.ip("ip")
    http_port = http.integer("port", 1024, U16)
    http.finish()
    if env.get("POD_IP"):
        http_ip = Section({"POD_IP": env["POD_IP"]}, "", warnings).ip("POD_IP")
    tls_section = root.section("tls_config")
    base = tls_base(source_path)
    tls = {link: read_link(tls_section, link, base) for link in TLS_LINKS}
    tls_section.finish()
    log = read_log_info(root.section("log_info"), min_str_size=1)
    root.finish()
    return ControllerConfig(
        deploy_mode=mode, process_manager_to_file=pm_values[0], process_manager_path=pm_values[1],
        cluster_status_to_file=cs_values[0], cluster_status_path=cs_values[1], rank_table_path=rank_table,
        **ints, http_ip=http_ip, http_port=http_port, tls=tls, log=log, p_rate=p_rate, d_rate=d_rate, **roles,
        digs_input_length=digs_in, digs_output_length=digs_out, is_heterogeneous=heterogeneous,
        source_path=source_path, warnings=warnings,
    )


def load_controller_config(path: str | None = None, *, environ: Mapping[str, str] | None = None) -> ControllerConfig:
    """Read ``path`` (or ``$MINDIE_MS_CONTROLLER_CONFIG_FILE_PATH``) and check it."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_PATH)
    if not path:
        raise ConfigError(ENV_PATH, None, f"an ms_controller.json path: pass --config or set {ENV_PATH}")
    return controller_config_from_dict(read_json_file(path), source_path=path, environ=env)
