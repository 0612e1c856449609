"""The ``mindie-host quantize`` subcommand (argument parsing and the report it prints)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_quantize_parser(sub: Any) -> None:
    """Register ``quantize`` on the top-level subparsers."""
    q = sub.add_parser("quantize", help="write a w8a16 or w8a8 checkpoint in MindIE's (msModelSlim) format")
    q.add_argument("--model", required=True, help="HF model directory or .gguf file (floating point)")
    q.add_argument("--scheme", required=True, help="w8a16 (int8 weights) or w8a8 (int8 weights and activations)")
    q.add_argument("--out", required=True, help="output directory (created; must be empty)")
    q.add_argument("--calib-file", help="UTF-8 text to calibrate on (default: a short text shipped in the package)")
    q.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens to use at most (default 2048)")
    q.add_argument("--alpha", type=float, default=0.5,
                   help="w8a8 smoothing strength in [0, 1]: how much of the activations' range moves into the weights")
    q.add_argument("--no-smooth", action="store_true",
                   help="w8a8: skip smoothing (needed to serve LoRA adapters of the original model on the result)")
    q.add_argument("--static", action="store_true",
                   help="w8a8: write static per-tensor activation quantizers (msModelSlim W8A8) instead of per-token")
    q.add_argument("--float-layer", action="append", default=[], metavar="NAME",
                   help="keep this layer in floating point, e.g. model.layers.0.mlp.down_proj (repeatable)")


def cmd_quantize(args: argparse.Namespace) -> int:
    """Run ``mindie-host quantize``; errors print one line and return 2."""
    from ..models.weights import ModelLoadError
    from .quantize import QUANTIZE_SCHEMES, quantize_model
    from .schemes import QuantizationError

    if args.scheme not in QUANTIZE_SCHEMES:
        print(f"mindie-host: --scheme {args.scheme!r} is not supported; supported: {', '.join(QUANTIZE_SCHEMES)}",
              file=sys.stderr)
        return 2
    if not 0.0 <= args.alpha <= 1.0:
        print(f"mindie-host: --alpha {args.alpha} is out of range; allowed: 0 to 1", file=sys.stderr)
        return 2
    text = None
    if args.calib_file:
        try:
            text = Path(args.calib_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"mindie-host: --calib-file {args.calib_file!r}: {exc}", file=sys.stderr)
            return 2
    try:
        report = quantize_model(args.model, args.scheme, args.out, calib_text=text, alpha=args.alpha,
                                smooth=not args.no_smooth, static=args.static, float_layers=tuple(args.float_layer),
                                max_calib_tokens=args.calib_tokens)
    except (QuantizationError, ModelLoadError, FileNotFoundError) as exc:
        print(f"mindie-host: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report.out}: {report.scheme}, {report.quantized_layers} int8 layers, "
          f"calibrated on {report.calibration_tokens} tokens, {report.bytes_written / 1e6:.1f} MB")
    return 0
