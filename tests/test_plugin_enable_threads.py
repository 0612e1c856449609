"""`mindie-host serve` enables plugins from two threads at once (model loading and HTTP start-up)."""

from __future__ import annotations

import threading
import time

import pytest

from mindie_host.config import config_from_dict
from mindie_host.plugins import PluginHost
from mindie_host.testing import server_config


def test_enabling_the_same_plugins_from_many_threads_registers_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    register = PluginHost.register

    def slow_register(self: PluginHost, plugin: object, name: str) -> None:
        time.sleep(0.01)  # widen the window between "is it registered?" and registering it
        register(self, plugin, name)

    monkeypatch.setattr(PluginHost, "register", slow_register)
    cfg = config_from_dict(server_config(None, model={"plugin_params": '{"plugin_type":"prefix_cache,splitfuse"}'},
                                         schedule={"enablePrefixCache": True, "templateType": "Mix",
                                                   "enableSplit": True}))
    for _ in range(3):
        host = PluginHost()
        start = threading.Barrier(8)
        errors: list[BaseException] = []

        def enable(host: PluginHost, start: threading.Barrier, errors: list[BaseException]) -> None:
            start.wait()
            try:
                host.enable_from_config(cfg)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=enable, args=(host, start, errors)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert host.enabled.count("prefix_cache") == 1 and host.enabled.count("splitfuse") == 1
