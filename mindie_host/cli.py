"""The ``mindie-host`` command: serve, config, plugins, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .config import (
    ENV_CONFIG_PATH,
    Config,
    ConfigError,
    config_from_dict,
    default_config_dict,
    load_config,
    validate_config_file,
)
from .config.support import no_effect, unsupported
from .file_modes import write_file
from .log_env import LogEnvError
from .ms.cli import MS_COMMANDS, add_ms_parsers, run_ms_command
from .plugins import (
    PluginError,
    PluginHost,
    describe_builtins,
    describe_installed,
    enabled_plugin_names,
    installed_plugins,
)
from .quant.cli import add_quantize_parser, cmd_quantize
from .tools.certs import add_certs_parser
from .tools.config_upgrade import add_upgrade_parser, cmd_upgrade
from .tools.probe import add_probe_parser


def config_path(args: argparse.Namespace) -> str | None:
    """The config file to serve from: ``--config``, else ``MIES_CONFIG_JSON_PATH``, else none (defaults)."""
    return args.config or os.environ.get(ENV_CONFIG_PATH) or None


def build_config(args: argparse.Namespace) -> Config:
    """A config from ``--config`` / ``MIES_CONFIG_JSON_PATH`` (or defaults), with command-line overrides applied."""
    data: dict[str, Any]
    cfg_path = config_path(args)
    if cfg_path:
        data = load_config(cfg_path).to_dict()
    else:
        data = default_config_dict()
    server = data["ServerConfig"]
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    if args.model:
        path = Path(args.model).expanduser()
        model["modelWeightPath"] = str(path)
        if not cfg_path or args.model_name:
            model["modelName"] = args.model_name or (path.stem.split(".Q")[0] if path.suffix == ".gguf" else path.name)
    elif args.model_name:
        model["modelName"] = args.model_name
    for key, value in (("ipAddress", args.host), ("port", args.port), ("managementPort", args.management_port),
                       ("metricsPort", args.metrics_port)):
        if value is not None:
            server[key] = value
    if args.host and not (cfg_path and "managementIpAddress" in json.loads(Path(cfg_path).read_text()).get(
            "ServerConfig", {})):
        server["managementIpAddress"] = args.host
    for key in ("dtype", "device", "backend"):
        value = getattr(args, key)
        if value is not None:
            model["backendType" if key == "backend" else key] = value
    if args.plugins:
        model["plugin_params"] = json.dumps({"plugin_type": args.plugins})
    return config_from_dict(data, source_path=cfg_path)


def cmd_serve(args: argparse.Namespace) -> int:
    from .host import Host
    from .logs import LoadProgress, setup_logging
    from .runtime import load_host
    from .server.runner import serve_with_engine_on_main_thread

    try:
        config = build_config(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"mindie-host: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.LogConfig, to_stderr=True)
    for warning in config.warnings:
        logging.getLogger("mindie_host.config").warning(warning)
    if config.BackendConfig.multiNodesInferEnabled:  # a node without rank 0 runs only its ranks
        from .distributed.rank_table import RankTableError, load_plan
        from .runtime.rank_node import serve_rank_node

        try:
            plan = load_plan(config.BackendConfig.multiNodesInferPort)
        except RankTableError as exc:
            print(f"mindie-host: {exc}", file=sys.stderr)
            return 2
        if not plan.is_master:
            return serve_rank_node(config, plan)
    host = Host(config)
    progress = LoadProgress()
    try:
        serve_with_engine_on_main_thread(host, lambda: load_host(host, progress))
    except (PluginError, ConfigError, FileNotFoundError, RuntimeError) as exc:
        print(f"mindie-host: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.config_cmd == "upgrade":
        return cmd_upgrade(args)
    if args.config_cmd == "init":
        text = json.dumps(default_config_dict(), indent=4) + "\n"
        if args.output == "-":
            sys.stdout.write(text)
        else:
            out = Path(args.output)
            if out.exists() and not args.force:
                print(f"mindie-host: {out} exists (use --force to overwrite)", file=sys.stderr)
                return 1
            write_file(out, text, 0o640)  # no group write, nothing for others: what the permission check wants
            print(f"wrote {out}")
        return 0
    problems = validate_config_file(args.file)
    errors = [p for p in problems if p.startswith("error")]
    for p in problems:
        print(p)
    if not errors:
        try:
            cfg = load_config(args.file)
            for note in no_effect(cfg):
                print(f"warning: {note}")
            errors += [f"error: {e}" for e in unsupported(cfg)]
            for e in unsupported(cfg):
                print(f"error: {e}")
            plugin_host = PluginHost()
            plugin_host.enable_from_config(cfg)
            plugin_errors = plugin_host.validate(cfg)
        except (ConfigError, PluginError) as exc:
            plugin_errors = [str(exc)]
        for e in plugin_errors:
            print(f"error: {e}")
        errors += plugin_errors
    if not errors:
        print(f"{args.file}: valid")
    return 1 if errors else 0


def cmd_plugins(args: argparse.Namespace) -> int:
    """List the builtin and installed plugins: package, version, enabled, hooks and ``Plugins.<name>`` parameters."""
    enabled: list[str] = []
    if args.config:
        enabled = enabled_plugin_names(load_config(args.config))
    rows = [("builtin", "mindie-host", __version__, True, describe_builtins())]
    for p in installed_plugins():
        rows.append((p.name, p.distribution, p.version, p.name in enabled, describe_installed(p.name)))
    missing = [n for n in enabled if n not in {p.name for p in installed_plugins()}]
    if args.json:
        print(json.dumps([
            {"name": name, "package": package, "version": version, "enabled": on, "hooks": d.hooks,
             "params": {k: {"type": t, "default": None if default is ... else default, "required": default is ...}
                        for k, (t, default) in d.params.items()},
             **({"error": d.error} if d.error else {})}
            for name, package, version, on, d in rows
        ], default=str))
        return 1 if missing else 0
    width = max(len(r[0]) for r in rows) + 2
    pw = max(len(r[1]) for r in rows) + 2
    print(f"{'NAME':<{width}}{'PACKAGE':<{pw}}{'VERSION':<10}ENABLED")
    for name, package, version, on, d in rows:
        print(f"{name:<{width}}{package:<{pw}}{version:<10}{'yes' if on else 'no'}")
        if d.error:
            print(f"    ({d.error})")
        if d.hooks:
            print("    hooks:  " + ", ".join(h.removeprefix("mindie_host_") for h in d.hooks))
        for key, (kind, default) in d.params.items():
            print(f"    param:  Plugins.{name}.{key} ({kind}, {'required' if default is ... else f'default {default!r}'})")
    for name in missing:
        print(f"{name:<{width}}{'(not installed)':<{pw}}{'-':<10}yes  <- install it")
    return 1 if missing else 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        from .bench.cli import main as bench_main
    except ImportError as exc:
        print(f"mindie-host bench is unavailable: {exc}", file=sys.stderr)
        return 2
    return int(bench_main(rest) or 0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindie-host", description="Plugin-based LLM serving with MindIE's protocols.")
    p.add_argument("--version", action="version", version=f"mindie-host {__version__}")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="serve a model (default: SmolLM2-135M-Instruct)")
    s.add_argument("--config", help="MindIE-format config.json (default: $MIES_CONFIG_JSON_PATH, else built-in defaults)")
    s.add_argument("--model", help="HF model directory or .gguf file")
    s.add_argument("--model-name", help="name clients use in `model` (default: from the path)")
    s.add_argument("--host", help="business-plane IP (also management unless the config sets it)")
    s.add_argument("--port", type=int, help="business port (default 1025)")
    s.add_argument("--management-port", type=int)
    s.add_argument("--metrics-port", type=int)
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"])
    s.add_argument("--backend", help="backendType (torch, ms, atb)")
    s.add_argument("--plugins", help="comma-separated plugin names to enable, e.g. prefix_cache,splitfuse")
    c = sub.add_parser("config", help="write or check a config.json")
    csub = c.add_subparsers(dest="config_cmd", required=True)
    init = csub.add_parser("init", help="write the default config")
    init.add_argument("output", nargs="?", default="config.json")
    init.add_argument("--force", action="store_true")
    val = csub.add_parser("validate", help="check a config file")
    val.add_argument("file")
    add_upgrade_parser(csub)
    pl = sub.add_parser("plugins", help="list installed and enabled plugins")
    pl.add_argument("--config", help="config.json whose enabled plugins to show")
    pl.add_argument("--json", action="store_true")
    sub.add_parser("bench", help="benchmark a server or the engine (see `mindie-host bench --help`)", add_help=False)
    add_quantize_parser(sub)
    add_ms_parsers(sub)
    add_certs_parser(sub)
    add_probe_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argparse.Namespace(), argv[1:])
    args = parser().parse_args(argv or ["serve"])
    if args.cmd in (None, "serve"):
        if args.cmd is None:
            args = parser().parse_args(["serve"])
        return cmd_serve(args)
    try:
        if args.cmd == "config":
            return cmd_config(args)
        if args.cmd == "plugins":
            return cmd_plugins(args)
        if args.cmd == "quantize":
            return cmd_quantize(args)
        if args.cmd in MS_COMMANDS:
            return run_ms_command(args)
        if hasattr(args, "run"):  # the operator tools (mindie_host/tools) register themselves this way
            return int(args.run(args))
    except (ConfigError, PluginError, LogEnvError) as exc:
        print(f"mindie-host: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
