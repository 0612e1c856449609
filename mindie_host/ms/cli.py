"""The ``coordinator``, ``controller`` and ``cluster`` subcommands of ``mindie-host``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

MS_COMMANDS = ("coordinator", "controller", "cluster", "deployer", "msctl")


def add_ms_parsers(sub: Any) -> None:
    """Register the MS subcommands on the main parser's subparsers."""
    co = sub.add_parser("coordinator", help="run the MS Coordinator (spec §4.3)")
    co.add_argument("--config", help="ms_coordinator.json (default: $MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH)")
    co.add_argument("overrides", nargs="*", metavar="ADDR",
                    help="predict_ip predict_port manage_ip manage_port (all four, overriding the file)")
    ct = sub.add_parser("controller", help="run the MS Controller (spec §4.2)")
    ct.add_argument("--config", help="ms_controller.json (default: $MINDIE_MS_CONTROLLER_CONFIG_FILE_PATH)")
    cl = sub.add_parser("cluster", help="a controller, a coordinator and N servers on this machine")
    cl.add_argument("--servers", type=int, default=2, help="number of servers (default 2)")
    cl.add_argument("--server-config", help="config.json the servers start from (ports are replaced)")
    cl.add_argument("--port", type=int, default=1025, help="the coordinator's user port (default 1025)")
    cl.add_argument("--workdir", default="mindie-cluster", help="configs and logs go here (default ./mindie-cluster)")
    cl.add_argument("--algorithm", default="cache_affinity", choices=["cache_affinity", "round_robin", "load_balance"])
    from .deployer.cli import add_deployer_parsers

    add_deployer_parsers(sub)


def run_ms_command(args: argparse.Namespace) -> int:
    """Run one MS subcommand; configuration errors print one line and return 2."""
    from .schema import ConfigError

    if args.cmd in ("deployer", "msctl"):
        from .deployer.cli import run_deployer_command

        return run_deployer_command(args)
    try:
        if args.cmd == "coordinator":
            from .coordinator.app import run_coordinator
            from .coordinator.config import load_coordinator_config

            run_coordinator(load_coordinator_config(args.config, positional=args.overrides or None))
        elif args.cmd == "controller":
            from .controller.app import run_controller
            from .controller.config import load_controller_config

            run_controller(load_controller_config(args.config))
        else:
            from ..config import load_config
            from .cluster import run_cluster

            if args.servers < 1:
                raise ConfigError("--servers", args.servers, "an integer >= 1")
            base = load_config(args.server_config).to_dict() if args.server_config else None
            return run_cluster(args.servers, args.workdir, args.port, base, args.algorithm)
    except (ConfigError, RuntimeError, OSError) as exc:
        print(f"mindie-host {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
