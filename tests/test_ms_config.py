"""MindIE MS: config files, rank tables, refresh bodies, routing tables and metrics aggregation (no processes)."""

from __future__ import annotations

import json

import pytest

from mindie_host.config import ConfigError
from mindie_host.ms.controller.config import controller_config_from_dict, default_controller_dict
from mindie_host.ms.controller.ranktable import parse_topology
from mindie_host.ms.coordinator.config import (
    coordinator_config_from_dict,
    default_coordinator_dict,
    load_coordinator_config,
)
from mindie_host.ms.coordinator.instances import (
    DEPARTED_KEEP,
    Instance,
    InstanceTable,
    RefreshError,
    instance_id,
    parse_refresh,
)
from mindie_host.ms.coordinator.limits import Refused, Scheduler
from mindie_host.ms.coordinator.metrics import aggregate, render_families
from mindie_host.ms.coordinator.routing import RequestInfo, Router, conversation_keys


def coordinator(**sections):
    data = default_coordinator_dict()
    for key, value in sections.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


# -- ms_coordinator.json ---------------------------------------------------------------------------------------
def test_coordinator_defaults_and_string_numbers():
    cfg = coordinator_config_from_dict(default_coordinator_dict(), environ={})
    assert (cfg.predict_port, cfg.manage_port, cfg.max_requests, cfg.single_node_max_requests) == (1025, 1026, 10000,
                                                                                                   1000)
    assert cfg.algorithm_type == "cache_affinity" and cfg.cache_size == 100 and cfg.slots_thresh == 0.05
    assert cfg.reordering_type == "FCFS" and cfg.body_limit_bytes == 10 * 1024 * 1024
    assert not any(link.enabled for link in cfg.tls.values())


@pytest.mark.parametrize(("sections", "key", "allowed"), [
    ({"http_config": {"predict_port": "80"}}, "http_config.predict_port", "[1024, 65535]"),
    ({"http_config": {"manage_ip": "localhost"}}, "http_config.manage_ip", "IPv4"),
    ({"http_config": {"http_timeout_seconds": 601}}, "http_config.http_timeout_seconds", "[0, 600]"),
    ({"request_limit": {"max_requests": 90001}}, "request_limit.max_requests", "[1, 90000]"),
    ({"request_limit": {"single_node_max_requests": 0}}, "request_limit.single_node_max_requests", "[1, 2000]"),
    ({"request_limit": {"body_limit": 21}}, "request_limit.body_limit", "[1, 20]"),
    ({"prometheus_metrics_config": {"reuse_time": 0}}, "prometheus_metrics_config.reuse_time", "[1, 100]"),
    ({"exception_config": {"max_retry": 11}}, "exception_config.max_retry", "[0, 10]"),
    ({"exception_config": {"infer_timeout": True}}, "exception_config.infer_timeout", "[0, 3600]"),
    ({"log_info": {"max_log_str_size": 127}}, "log_info.max_log_str_size", "[128, 4096]"),
    ({"log_info": {"log_level": "TRACE"}}, "log_info.log_level", "'DEBUG'"),
    ({"digs_scheduler_config": {"cache_size": "0"}}, "digs_scheduler_config.cache_size", "[1, 10000]"),
    ({"digs_scheduler_config": {"slots_thresh": "1.5"}}, "digs_scheduler_config.slots_thresh", "[0.0, 1.0]"),
    ({"digs_scheduler_config": {"reordering_type": "4"}}, "digs_scheduler_config.reordering_type", "[1, 3]"),
    ({"digs_scheduler_config": {"algorithm_type": "random"}}, "digs_scheduler_config.algorithm_type",
     "'load_balance'"),
    ({"digs_scheduler_config": {"deploy_mode": "pd_separate"}}, "digs_scheduler_config.scheduler_type",
     "'digs_scheduler'"),
    ({"digs_scheduler_config": {"scheduler_type": "digs_scheduler"}}, "digs_scheduler_config.scheduler_type",
     "'default_scheduler'"),
    ({"tls_config": {"request_server_tls_enable": "yes"}}, "tls_config.request_server_tls_enable", "true or false"),
    ({"tls_config": {"request_server_tls_enable": True}}, "tls_config.request_server_tls_items", "required"),
])
def test_coordinator_errors_name_the_key(sections, key, allowed):
    with pytest.raises(ConfigError) as info:
        coordinator_config_from_dict(coordinator(**sections), environ={})
    assert info.value.key == key and allowed in str(info.value)


def test_coordinator_every_key_is_required():
    data = default_coordinator_dict()
    del data["exception_config"]["first_token_timeout"]
    with pytest.raises(ConfigError, match="exception_config.first_token_timeout: .*required"):
        coordinator_config_from_dict(data, environ={})
    data = default_coordinator_dict()
    data["http_config"]["extra"] = 1
    assert "http_config.extra: unknown key, ignored" in coordinator_config_from_dict(data, environ={}).warnings


def test_coordinator_environment_and_positional_overrides(tmp_path):
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(default_coordinator_dict()))
    env = {"MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH": str(path), "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ": "50",
           "MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ": "7"}
    cfg = load_coordinator_config(environ=env, positional=["127.0.0.2", "2025", "127.0.0.3", "2026"])
    assert (cfg.max_requests, cfg.single_node_max_requests) == (50, 7)
    assert (cfg.predict_ip, cfg.predict_port, cfg.manage_ip, cfg.manage_port) == ("127.0.0.2", 2025, "127.0.0.3", 2026)
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(environ={**env, "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ": "0"})
    assert info.value.key == "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ"
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(environ=env, positional=["127.0.0.1", "99999", "127.0.0.1", "1026"])
    assert info.value.key == "arguments.predict_port"
    with pytest.raises(ConfigError, match="MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"):
        load_coordinator_config(environ={})


def test_tls_items_are_checked_and_used(tmp_path):
    data = coordinator(tls_config={"mindie_client_tls_enable": True, "mindie_client_tls_items": {
        "ca_cert": "missing-ca.pem", "tls_cert": "cert.pem", "tls_key": "key.pem", "tls_passwd": "",
        "kmcKsfMaster": "", "kmcKsfStandby": "", "tls_crl": ""}})
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(data))
    cfg = coordinator_config_from_dict(data, source_path=str(path), environ={})
    link = cfg.tls["mindie_client"]
    assert link.enabled and link.scheme == "https"
    with pytest.raises(RuntimeError, match="missing-ca.pem"):
        link.client_context()


# -- ms_controller.json and the rank table ---------------------------------------------------------------------
def test_controller_config_and_overrides():
    cfg = controller_config_from_dict(default_controller_dict(), environ={"POD_IP": "127.0.0.9",
                                                                          "GLOBAL_RANK_TABLE_FILE_PATH": "/x.json"})
    assert cfg.http_ip == "127.0.0.9" and cfg.rank_table_path == "/x.json" and cfg.sync_seconds == 1
    bad = default_controller_dict()
    bad["deploy_mode"] = "pd_separate"
    assert controller_config_from_dict(bad, environ={}).deploy_mode == "pd_separate"
    for key, value, allowed in (("cluster_synchronization_seconds", 0, "[1, 65535]"),
                                ("default_p_rate", 3, "both 0"), ("mindie_server_port", 80, "[1024, 65535]")):
        bad = default_controller_dict()
        bad[key] = value
        with pytest.raises(ConfigError) as info:
            controller_config_from_dict(bad, environ={})
        assert allowed in str(info.value)
    with pytest.raises(ConfigError) as info:
        controller_config_from_dict(default_controller_dict(), environ={"MINDIE_MS_P_RATE": "16"})
    assert info.value.key == "MINDIE_MS_P_RATE"


def test_rank_table_and_plain_list():
    cfg = controller_config_from_dict(default_controller_dict(), environ={})
    table = {"version": "1.0", "status": "completed", "server_group_list": [
        {"group_id": "0", "server_count": "1", "server_list": [{"server_id": "a", "server_ip": "10.0.0.1"}]},
        {"group_id": "2", "server_count": "2", "server_list": [
            {"server_id": "b", "server_ip": "10.0.0.2", "device": [{"device_id": "0"}]},
            {"server_id": "c", "server_ip": "10.0.0.3", "port": 2025, "management_port": 2026, "metric_port": 2027}]},
    ]}
    topo = parse_topology(table, cfg)
    assert topo.coordinator == ("10.0.0.1", 1026) and topo.ready
    assert [(s.ip, s.port, s.management_port, s.metric_port) for s in topo.servers] == [
        ("10.0.0.2", 1025, 1026, 1027), ("10.0.0.3", 2025, 2026, 2027)]
    assert not parse_topology({**table, "status": "initializing"}, cfg).ready
    plain = parse_topology([{"ip": "127.0.0.1", "port": 3000}, "127.0.0.1:3001"], cfg)
    assert [s.port for s in plain.servers] == [3000, 3001] and plain.coordinator == ("127.0.0.1", 1026)
    with pytest.raises(ConfigError) as info:
        parse_topology([{"ip": "127.0.0.1"}, {"ip": "127.0.0.1"}], cfg)
    assert "distinct" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_topology({"server_group_list": [{"group_id": "7"}]}, cfg)
    assert info.value.key.endswith("group_id")


# -- refresh bodies --------------------------------------------------------------------------------------------
def refresh_entry(iid: int, port: int, **static) -> dict:
    return {"id": iid, "ip": "127.0.0.1", "port": port, "metric_port": port + 1, "model_name": "m",
            "static_info": {"group_id": 0, "max_seq_len": 512, "max_output_len": 100, "total_slots_num": 8,
                            "total_block_num": 100, "block_size": 16, **static},
            "dynamic_info": {"avail_slots_num": 8, "avail_block_num": 100}}


def test_refresh_bodies_are_checked():
    ids, described = parse_refresh({"ids": [1, 2], "instances": [refresh_entry(1, 2000), refresh_entry(2, 2002)]})
    assert ids == [1, 2] and described[2]["metric_port"] == 2003
    for body, field in (({"ids": "1"}, "ids"), ({"ids": [1], "instances": [refresh_entry(1, 80)]}, "port"),
                        ({"ids": [1], "instances": [refresh_entry(1, 2000, block_size=129)]}, "block_size"),
                        ({"ids": [1], "instances": [refresh_entry(1, 2000, max_output_len=512)]}, "max_output_len"),
                        ({"ids": [1], "instances": [refresh_entry(1, 2000, role=1)]}, "role"),
                        ({"ids": [], "instances": [refresh_entry(1, 2000)]}, "not listed")):
        with pytest.raises(RefreshError, match=field):
            parse_refresh(body)
    assert instance_id("127.0.0.1", 1025) == (0x7F000001 << 16) | 1025


# -- routing and queueing --------------------------------------------------------------------------------------
def table_of(n: int) -> InstanceTable:
    table = InstanceTable()
    entries = [refresh_entry(i, 2000 + 2 * i) for i in range(n)]
    table.apply_refresh(*parse_refresh({"ids": list(range(n)), "instances": entries}))
    return table


def test_conversation_keys_chain_turns():
    turn1 = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}
    own1, hist1 = conversation_keys(turn1)
    assert hist1 is None
    turn2 = {"model": "m", "messages": turn1["messages"] + [{"role": "assistant", "content": "b"},
                                                            {"role": "user", "content": "c"}]}
    own2, hist2 = conversation_keys(turn2)
    assert hist2 == own1 and own2 != own1
    assert conversation_keys({"prompt": "x"}) == (None, None)


def test_cache_affinity_falls_back_under_threshold_and_bounds_its_table():
    table = table_of(2)
    router = Router("cache_affinity", cache_size=2, slots_thresh=0.5, block_thresh=0.05)
    insts = table.available()
    msgs = [{"role": "user", "content": "q"}]
    own, _ = conversation_keys({"messages": msgs})
    first = router.pick(insts, RequestInfo("/v1/chat/completions", 1, own, None))
    router.chosen(first, RequestInfo("/v1/chat/completions", 1, own, None))
    turn2 = msgs + [{"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}]
    own2, hist2 = conversation_keys({"messages": turn2})
    for _ in range(3):
        assert router.pick(insts, RequestInfo("/v1/chat/completions", 1, own2, hist2)) is first
    first.dynamic["avail_slots_num"] = 1  # 1/8 free < slots_thresh 0.5: fall back
    other = router.pick(insts, RequestInfo("/v1/chat/completions", 1, own2, hist2))
    assert router.affinity_fallbacks == 1 and other is not None
    for n in range(5):
        router.chosen(insts[0], RequestInfo("/v1/chat/completions", 1, f"k{n}", None))
    assert len(router.affinity) == 2


def test_load_balance_picks_most_free():
    table = table_of(3)
    a, b, c = sorted(table.available(), key=lambda i: i.id)
    a.dynamic.update(avail_slots_num=2, avail_block_num=10)
    b.dynamic.update(avail_slots_num=8, avail_block_num=90)
    c.dynamic.update(avail_slots_num=8, avail_block_num=40)
    assert Router("load_balance").pick(table.available(), RequestInfo("/generate", 1)) is b
    b.active = 7
    assert Router("load_balance").pick(table.available(), RequestInfo("/generate", 1)) is c


@pytest.mark.parametrize(("order", "expected"), [("FCFS", [30, 10, 20]), ("SJF", [10, 20, 30]),
                                                  ("LJF", [30, 20, 10])])
def test_queue_order(order, expected):
    import asyncio

    async def run() -> list[int]:
        table = table_of(1)
        sched = Scheduler(table, Router("round_robin"), max_requests=10, single_node_max_requests=1,
                          reordering=order, schedule_timeout=5)
        inst = await sched.acquire(RequestInfo("/generate", 1))
        served: list[int] = []

        async def wait(size: int) -> None:
            got = await sched.acquire(RequestInfo("/generate", size))
            served.append(size)
            await asyncio.sleep(0)
            sched.release(got, RequestInfo("/generate", size))

        tasks = []
        for size in (30, 10, 20):
            tasks.append(asyncio.ensure_future(wait(size)))
            await asyncio.sleep(0)
        sched.release(inst, RequestInfo("/generate", 1))
        await asyncio.gather(*tasks)
        return served

    assert asyncio.run(run()) == expected


def test_scheduler_refusals():
    import asyncio

    async def run() -> None:
        table = table_of(1)
        sched = Scheduler(table, Router("round_robin"), max_requests=1, single_node_max_requests=1,
                          schedule_timeout=1)
        sched.admit()
        with pytest.raises(Refused, match="Too many requests") as info:
            sched.admit()
        assert info.value.status == 429
        inst = await sched.acquire(RequestInfo("/generate", 1))
        with pytest.raises(Refused, match="Request schedule timeout"):
            await sched.acquire(RequestInfo("/generate", 1))
        sched.release(inst, RequestInfo("/generate", 1))
        next(iter(table.items.values())).offline = True
        with pytest.raises(Refused, match="MindIE-MS Coordinator is not ready") as info:
            await sched.acquire(RequestInfo("/generate", 1))
        assert info.value.status == 503

    asyncio.run(run())


# -- metrics ---------------------------------------------------------------------------------------------------
SERVER_TEXT = """# HELP request_success_total Number of requests proceed successfully so far.
# TYPE request_success_total counter
request_success_total{{model_name="{m}"}} {n}
# HELP num_requests_running Number of requests currently running on NPU.
# TYPE num_requests_running gauge
num_requests_running{{model_name="{m}"}} {n}
# HELP npu_cache_usage_perc NPU KV-cache usage. 1 means 100 percent usage.
# TYPE npu_cache_usage_perc gauge
npu_cache_usage_perc{{model_name="{m}"}} {u}
# HELP time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE time_to_first_token_seconds histogram
time_to_first_token_seconds_count{{model_name="{m}"}} {n}
time_to_first_token_seconds_sum{{model_name="{m}"}} {s}
time_to_first_token_seconds_bucket{{model_name="{m}",le="0.1"}} {n}
time_to_first_token_seconds_bucket{{model_name="{m}",le="+Inf"}} {n}
"""


def test_metrics_aggregation_sums_counters_and_histograms():
    text = render_families(aggregate([SERVER_TEXT.format(m="a", n=3, u=0.5, s=0.25),
                                      SERVER_TEXT.format(m="b", n=4, u=0.25, s=0.5)]))
    assert 'request_success_total{model_name="a&b"} 7' in text
    assert 'num_requests_running{model_name="a&b"} 7' in text
    assert 'npu_cache_usage_perc{model_name="a&b"} 0.375' in text
    assert 'time_to_first_token_seconds_bucket{model_name="a&b",le="0.1"} 7' in text
    assert 'time_to_first_token_seconds_sum{model_name="a&b"} 0.75' in text
    assert text.index("time_to_first_token_seconds_count") < text.index("time_to_first_token_seconds_bucket")


def test_instance_failure_and_readmission():
    table = table_of(1)
    inst: Instance = next(iter(table.items.values()))
    inst.mark_failed("ConnectError")
    assert not table.available()
    entries = [refresh_entry(0, 2000)]
    table.apply_refresh(*parse_refresh({"ids": [0], "instances": entries}))
    assert not table.available()  # a refresh right after the failure may predate it
    inst.failed_at -= 5
    table.apply_refresh(*parse_refresh({"ids": [0], "instances": entries}))
    assert table.available() == [inst]


def test_an_instance_left_out_of_one_refresh_keeps_its_offline_mark_and_its_requests():
    """One missed status poll must not put a draining instance back in rotation, nor hide its running requests."""
    table = table_of(2)
    draining, busy = table.items[0], table.items[1]
    draining.offline, busy.active = True, 3
    only_none = {"ids": [], "instances": []}
    table.apply_refresh(*parse_refresh(only_none))
    assert table.items == {} and not table.available()
    assert 0 in table and table.get(0) is draining and table.get(1) is busy  # offline/online/tasks still find them
    entries = [refresh_entry(0, 2000), refresh_entry(1, 2002)]
    table.apply_refresh(*parse_refresh({"ids": [0, 1], "instances": entries}))
    assert table.items[0] is draining and draining.offline and table.available() == [busy] and busy.active == 3
    busy.active = 0  # idle and online: forgotten when it leaves
    table.apply_refresh(*parse_refresh(only_none))
    table.apply_refresh(*parse_refresh(only_none))
    assert 1 not in table and table.get(0) is draining
    draining.departed_at -= DEPARTED_KEEP  # idle, offline and away that long: an address that comes back is new
    table.apply_refresh(*parse_refresh(only_none))
    assert 0 not in table
    table.apply_refresh(*parse_refresh({"ids": [0], "instances": entries[:1]}))
    assert table.available() == [table.items[0]] and table.items[0] is not draining
