"""``mindie-host deployer`` (ms_server) and ``mindie-host msctl``: their parsers and how they run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from .msctl import add_msctl_parser, run_msctl

COMMANDS = ("deployer", "msctl")


def add_deployer_parsers(sub: Any) -> None:
    """Register ``deployer`` and ``msctl``."""
    d = sub.add_parser("deployer", help="run the MS Deployer (ms_server, spec §8.3.2): deploy servers over REST")
    d.add_argument("config", help="ms_server.json (mode at most 0640 unless MINDIE_CHECK_INPUTFILES_PERMISSION=0)")
    d.add_argument(
        "--target",
        choices=["local", "kubernetes"],
        default="local",
        help="where servers run: local processes (default) or a Kubernetes cluster",
    )
    d.add_argument(
        "--server-config",
        help="the servers' config.json (default: built-in defaults); read again at every create and update",
    )
    d.add_argument(
        "--workdir",
        default=None,
        help="local target: configs and logs of every server (default ./mindie-deployer)",
    )
    d.add_argument(
        "--service-ip",
        default=None,
        help="local target: the address service_port listens on (default 127.0.0.1)",
    )
    d.add_argument("--image", default=None, help="kubernetes target: the servers' image (default mindie-host:latest)")
    add_msctl_parser(sub)


def run_deployer(args: argparse.Namespace) -> int:
    """``mindie-host deployer``: check everything, then serve until SIGINT/SIGTERM."""
    from .app import serve_deployer, setup_deployer_logging
    from .config import load_deployer_config
    from .target import read_server_config

    config = load_deployer_config(args.config, target=args.target)
    read_server_config(args.server_config)  # fail now, not at the first request
    setup_deployer_logging(config)
    log = logging.getLogger("mindie_host.ms.deployer")
    for warning in config.warnings:
        log.warning("ms_server.json: %s", warning)
    if args.target == "kubernetes":
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            raise ValueError("--target kubernetes needs the kubernetes package: pip install kubernetes") from None
        from .kube import DEFAULT_IMAGE, KubeTarget, api_client

        for flag, value in (("--workdir", args.workdir), ("--service-ip", args.service_ip)):
            if value is not None:
                raise ValueError(f"{flag} is for the local target")

        target: Any = KubeTarget(
            api_client(config), args.server_config, config.mindie_tls, image=args.image or DEFAULT_IMAGE
        )
    else:
        from .local import LocalTarget

        if args.image:
            raise ValueError("--image is for the kubernetes target")
        target = LocalTarget(
            args.workdir or "mindie-deployer",
            args.server_config,
            config.mindie_tls,
            service_ip=args.service_ip or "127.0.0.1",
        )
    asyncio.run(serve_deployer(config, target))
    return 0


def run_deployer_command(args: argparse.Namespace) -> int:
    """Either command; a configuration error prints one line and returns 2 (msctl: 1)."""
    from ..schema import ConfigError
    from .target import TargetError

    if args.cmd == "msctl":
        return run_msctl(args)
    try:
        return run_deployer(args)
    except (ConfigError, TargetError, ValueError, OSError, RuntimeError) as exc:
        print(f"mindie-host deployer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
