"""Every enumerated value of every config.json key (each choice, each boolean) is honoured or refused at startup.

The values are read from the schema, so a value added to a key's choices without a place here fails the walk. Each
value has one of:

* a test elsewhere that shows its effect (:data:`SHOWN_BY`: the test must exist, and its file must name the key
  and the value);
* a check here that the value reaches what it drives (:data:`APPLIED`: the log level, the platform, the torch dtype,
  the tokenizer, the sampling default, prompt truncation);
* a startup refusal, alone or beside another key's value (:data:`REFUSED`, with the combinations: a value that needs
  a plugin or another key);
* for the two keys whose only allowed value is informational (:data:`~mindie_host.config.support.NO_EFFECT_KEYS`),
  nothing to do.

Keys that the spec gives a meaning only in a mode that is off (PD's, multi-node's) are reported at startup when set
(tests/test_config_keys.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from mindie_host.backends.platform import CudaPlatform, Platform, select_platform
from mindie_host.backends.torch.backend import resolve_dtype
from mindie_host.config import Config, ConfigError, ModelConfig, config_from_dict, default_config_dict
from mindie_host.config.support import NO_EFFECT_KEYS
from mindie_host.engine.request import RequestError
from mindie_host.host import Host
from mindie_host.plugins import PluginError
from mindie_host.runtime.assemble import model_tokenizer
from mindie_host.server.params import build_sampling
from mindie_host.testing import load_host
from mindie_host.tokenizer import byte_level_tokenizer

ROOT = Path(__file__).resolve().parents[1]
S, M, D = "BackendConfig.ScheduleConfig", "BackendConfig.ModelDeployConfig.ModelConfig", "BackendConfig.ModelDeployConfig"


def enumerated_values() -> list[tuple[str, Any]]:
    """(dotted key, value) for every value of every key with a finite set of values (``ModelConfig`` keys without
    an index)."""
    out: list[tuple[str, Any]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            meta = f.metadata
            section = meta.get("section") or meta.get("section_list")
            if section is not None:
                walk(section, f"{prefix}{f.name}.")
                continue
            rule = meta.get("rule")
            if rule is None:
                continue
            values: list[Any] = []
            if rule.kind == "bool":
                values = [False, True]
            elif rule.kind == "str" and rule.choices:
                values = list(rule.choices)
            elif rule.kind == "int" and rule.special and rule.lo is None:  # int_one_of
                values = list(rule.special)
            if values and rule.nullable:
                values.insert(0, None)
            out.extend((prefix + f.name, v) for v in values)

    walk(Config, "")
    return out


#: (key, value) -> the test that shows the value's effect ("file::function")
SHOWN_BY: dict[tuple[str, Any], str] = {
    ("ServerConfig.allowAllZeroIpListening", False): "tests/test_tls.py::test_all_zero_address_needs_explicit_permission",
    ("ServerConfig.allowAllZeroIpListening", True): "tests/test_tls.py::test_all_zero_address_needs_explicit_permission",
    ("ServerConfig.httpsEnabled", False): "tests/test_tls.py::test_https_off_means_no_tls",
    ("ServerConfig.httpsEnabled", True): "tests/test_tls.py::test_client_with_a_certificate_is_served",
    ("ServerConfig.fullTextEnabled", False): "tests/test_openai.py::test_full_text_enabled",
    ("ServerConfig.fullTextEnabled", True): "tests/test_openai.py::test_full_text_enabled",
    ("ServerConfig.inferMode", "standard"): "tests/test_pd.py::test_identical_to_a_mixed_instance",
    ("ServerConfig.inferMode", "dmi"): "tests/test_pd.py::test_identical_to_a_mixed_instance",
    ("ServerConfig.interCommTLSEnabled", False): "tests/test_pd.py::test_identical_to_a_mixed_instance",
    ("ServerConfig.engineProcess", True):
        "tests/test_engine_process.py::test_sigkill_under_load_restarts_the_engine_and_spent_budget_fails_liveness",
    ("ServerConfig.engineProcess", False): "tests/test_standard_mock.py::test_probes_and_model_listing",
    (f"{M}.modelInstanceType", "Standard"):
        "tests/test_standard_mock.py::test_every_protocol_answers_the_placeholder_directly_and_through_the_coordinator",
    (f"{M}.modelInstanceType", "StandardMock"):
        "tests/test_standard_mock.py::test_every_protocol_answers_the_placeholder_directly_and_through_the_coordinator",
    (f"{M}.kvCacheDtype", "int8"): "tests/test_quantization.py::test_int8_kv_cache_bytes_and_round_trip",
    (f"{M}.quantization", "auto"): "tests/test_quantization.py::test_quantized_checkpoints_serve_and_agree",
    (f"{M}.quantization", "none"): "tests/test_quantization.py::test_none_serves_a_checkpoint_dequantized",
    (f"{M}.quantization", "w8a16"): "tests/test_quantization.py::test_schemes_agree_with_fp32",
    (f"{M}.quantization", "w8a8"): "tests/test_quantization.py::test_schemes_agree_with_fp32",
    (f"{M}.compile", False):
        "tests/test_compiled_decode.py::test_the_step_compiles_in_the_background_and_gives_the_eager_tokens",
    (f"{M}.compile", True):
        "tests/test_compiled_decode.py::test_the_step_compiles_in_the_background_and_gives_the_eager_tokens",
    **{(f"{M}.expertParallel", v):
       "plugins/models/tests/test_expert_parallel.py::test_two_expert_parallel_ranks_equal_one" for v in (False, True)},
    (f"{S}.templateType", "Standard"): "plugins/splitfuse/tests/test_splitfuse_server.py::test_outputs_identical_to_standard",
    (f"{S}.templateType", "Mix"): "plugins/splitfuse/tests/test_splitfuse_server.py::test_outputs_identical_to_standard",
    **{(f"{S}.prefillPolicyType", v): "tests/test_policy.py::test_decode_policies_follow_a_hand_worked_schedule"
       for v in (0, 1, 3)},
    (f"{S}.prefillPolicyType", 2): "tests/test_policy.py::test_order_policies",
    **{(f"{S}.decodePolicyType", v): "tests/test_policy.py::test_decode_policies_follow_a_hand_worked_schedule"
       for v in (0, 1, 3)},
    (f"{S}.decodePolicyType", 2): "tests/test_engine.py::test_priority_policy_orders_admission",
    (f"{S}.policyType", 0): "tests/test_policy.py::test_skip_join_mlfq_follows_a_hand_worked_schedule",
    (f"{S}.policyType", 4): "tests/test_policy.py::test_order_policies",
    (f"{S}.policyType", 5): "tests/test_policy.py::test_order_policies",
    (f"{S}.policyType", 6): "tests/test_policy.py::test_skip_join_mlfq_follows_a_hand_worked_schedule",
    (f"{S}.supportSelectBatch", False): "tests/test_policy.py::test_support_select_batch_follows_a_hand_worked_schedule",
    (f"{S}.supportSelectBatch", True): "tests/test_policy.py::test_support_select_batch_follows_a_hand_worked_schedule",
    (f"{S}.enablePrefixCache", False):
        "plugins/prefix_cache/tests/test_prefix_cache_server.py::test_outputs_identical_with_cache_on_under_eviction_and_preemption",
    (f"{S}.enablePrefixCache", True):
        "plugins/prefix_cache/tests/test_prefix_cache_server.py::test_outputs_identical_with_cache_on_under_eviction_and_preemption",
    (f"{S}.enableSplit", False): "plugins/splitfuse/tests/test_splitfuse_server.py::test_mix_without_split_mixes_whole_prompts",
    (f"{S}.enableSplit", True): "plugins/splitfuse/tests/test_splitfuse_server.py::test_outputs_identical_to_standard",
    **{(f"{S}.splitType", v):
       "plugins/splitfuse/tests/test_splitfuse_planner.py::test_split_type_splits_only_prompts_longer_than_two_chunks"
       for v in (False, True)},
    **{(f"{S}.splitStartType", v):
       "plugins/splitfuse/tests/test_splitfuse_planner.py::test_split_start_type_false_keeps_splitting_once_started"
       for v in (False, True)},
    ("BackendConfig.multiNodesInferEnabled", False): "tests/test_multi_node.py::test_two_nodes_form_a_world_of_two",
    ("BackendConfig.multiNodesInferEnabled", True): "tests/test_multi_node.py::test_two_nodes_form_a_world_of_two",
    ("BackendConfig.interNodeTLSEnabled", False): "tests/test_multi_node.py::test_two_nodes_form_a_world_of_two",
}

#: startup refusals: (the keys set, a fragment of the error); one key alone, or a value beside another key's
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({f"{S}.policyType": 7}, "policyType: got 7 (SJF-MLFQ)"),
    ({"ServerConfig.inferMode": "dmi"}, "interCommTLSEnabled: got true with ServerConfig.inferMode 'dmi'"),
    ({"ServerConfig.interCommTLSEnabled": True, "ServerConfig.inferMode": "dmi"}, "interCommTLSEnabled: got true"),
    ({"BackendConfig.interNodeTLSEnabled": True, "BackendConfig.multiNodesInferEnabled": True},
     "interNodeTLSEnabled: got true with multiNodesInferEnabled"),
    # values that need a plugin
    ({f"{S}.templateType": "Mix"}, "templateType: got 'Mix' without the splitfuse plugin"),
    ({f"{S}.enablePrefixCache": True}, "enablePrefixCache: got true without the prefix_cache plugin"),
    ({f"{S}.enableSplit": True}, "enableSplit: got true with templateType 'Standard'"),
    ({f"{S}.splitType": True}, "splitType: got true with templateType 'Standard'"),
    ({f"{S}.splitStartType": True}, "splitStartType: got true with templateType 'Standard'"),
    ({f"{S}.templateType": "Standard", f"{M}.plugin_params": '{"plugin_type": "splitfuse"}'},
     "templateType is 'Standard' but ModelConfig.plugin_params enables 'splitfuse'"),
    ({f"{M}.plugin_params": '{"plugin_type": "prefix_cache"}'}, "enablePrefixCache is false but"),
    # values that another key's value rules out
    ({f"{M}.kvCacheDtype": "int8", "ServerConfig.inferMode": "dmi", "ServerConfig.interCommTLSEnabled": False},
     "kvCacheDtype: got 'int8' with ServerConfig.inferMode 'dmi'"),
]


def config_with(changes: dict[str, Any]) -> Config:
    data = default_config_dict()
    for key, value in changes.items():
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            node = node[part][0] if part == "ModelConfig" else node[part]
        node[parts[-1]] = value
    return config_from_dict(data)


# -- values checked here against what they drive ---------------------------------------------------------
def check_log_level(value: str) -> None:
    want = {"verbose": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
            "warn": logging.WARNING, "error": logging.ERROR}[value.lower()]
    assert config_with({"LogConfig.logLevel": value}).LogConfig.python_level == want
    # the server applies it at start and on a hot update: tests/test_log_env.py::test_log_level_hot_update_on_a_running_server


def check_device(value: str) -> None:
    if value in ("auto", "cpu") or (value == "cuda" and CudaPlatform.is_available()):
        want = CudaPlatform if value == "cuda" or (value == "auto" and CudaPlatform.is_available()) else Platform
        assert type(select_platform(value)) is want
    else:  # cuda without a GPU, npu (the atb backend's): startup stops naming the device
        with pytest.raises(RuntimeError, match=f"device {value!r}"):
            select_platform(value)


def check_dtype(value: str) -> None:
    platform = Platform()
    want = platform.default_dtype() if value == "auto" else getattr(torch, value)
    assert resolve_dtype(value, platform) == want  # dtype, and kvCacheDtype (int8 aside), map through it


def check_kv_dtype(value: str) -> None:
    if value != "int8":  # int8: SHOWN_BY
        check_dtype(value)


def check_do_sample(value: bool | None) -> None:
    """ModelConfig.do_sample: the default of a request that says nothing about sampling."""
    host = Host(config_with({f"{M}.do_sample": value, f"{M}.temperature": 0.7}))
    assert build_sampling(host, {}).do_sample is bool(value)
    assert build_sampling(host, {}, do_sample=not value).do_sample is (not value)  # the request's own word wins


def check_truncation(value: bool) -> None:
    host = Host(config_with({f"{D}.truncation": value, f"{D}.maxInputTokenLen": 8}))
    host.tokenizer = byte_level_tokenizer()
    ids = list(range(10, 30))
    ask = dict(protocol="openai", body={}, prompt_token_ids=ids, sampling=build_sampling(host, {}))
    if value:
        assert host.new_request(**ask).prompt_token_ids == ids[-8:]  # type: ignore[arg-type]
    else:
        with pytest.raises(RequestError, match="20 tokens; the limit is 8"):
            host.new_request(**ask)  # type: ignore[arg-type]


def check_trust_remote_code(value: bool, tokenizer_dir: Path) -> None:
    model = ModelConfig(modelWeightPath=str(tokenizer_dir), trustRemoteCode=value)
    if value:
        assert type(model_tokenizer(model)).__name__ == "MarkedTokenizer"  # its own code ran
    else:
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            model_tokenizer(model)


APPLIED: dict[str, Callable[..., None]] = {
    "LogConfig.logLevel": check_log_level,
    f"{M}.device": check_device,
    f"{M}.dtype": check_dtype,
    f"{M}.kvCacheDtype": check_kv_dtype,
    f"{M}.do_sample": check_do_sample,
    f"{D}.truncation": check_truncation,
    f"{M}.trustRemoteCode": check_trust_remote_code,
}


@pytest.fixture(scope="module")
def remote_code_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory whose tokenizer class is code in the directory."""
    d = tmp_path_factory.mktemp("remote-code-tokenizer")
    byte_level_tokenizer().save_pretrained(d)
    (d / "tokenization_marked.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass MarkedTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]}, tokenizer_class="MarkedTokenizer")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


def refused(key: str, value: Any) -> bool:
    """Whether startup refuses ``value``, alone or beside another key's (e.g. interCommTLSEnabled true in dmi: outside
    dmi the spec gives the key no meaning, and a non-default value is reported at startup)."""
    return any(changes.get(key, ...) == value for changes, _ in REFUSED)


def default_of(key: str) -> Any:
    node: Any = Config()
    for part in key.split("."):
        node = getattr(node, part)
        node = node[0] if part == "ModelConfig" else node
    return node


def test_every_enumerated_value_is_honoured_or_refused() -> None:
    values = enumerated_values()
    assert len(values) > 60  # the walk reaches the sections and ModelConfig
    missing = [(key, value) for key, value in values
               if (key, value) not in SHOWN_BY and key not in APPLIED and key not in NO_EFFECT_KEYS
               and not refused(key, value)]
    assert not missing, f"values with no test of their effect and no refusal: {missing}"
    assert set(SHOWN_BY) <= set(values), set(SHOWN_BY) - set(values)


@pytest.mark.parametrize(("key", "value"), sorted(SHOWN_BY, key=repr), ids=lambda x: str(x))
def test_the_test_that_shows_a_value_exists_and_names_it(key: str, value: Any) -> None:
    path, name = SHOWN_BY[(key, value)].split("::")
    text = (ROOT / path).read_text()
    assert re.search(rf"^(async )?def {name}\(", text, re.M), f"{path} has no test {name}"
    assert key.rsplit(".", 1)[-1] in text, f"{path} does not name {key}"
    if not isinstance(value, bool) and value != default_of(key):  # a default is what the other values change
        assert repr(value) in text or json.dumps(value) in text or f"={value}" in text, f"{path} never sets {value!r}"


@pytest.mark.parametrize(("changes", "fragment"), REFUSED, ids=[json.dumps(c) for c, _ in REFUSED])
def test_refused_values_stop_startup(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises((PluginError, ConfigError), match=re.escape(fragment)):
        load_host(Host(config_with(changes)))


def test_applied_values_reach_what_they_drive(remote_code_tokenizer: Path) -> None:
    for key, value in enumerated_values():
        check = APPLIED.get(key)
        if check is check_trust_remote_code:
            check(value, remote_code_tokenizer)
        elif check is not None:
            check(value)
