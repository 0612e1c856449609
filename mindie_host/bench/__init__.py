"""``mindie-host bench``: the MindIE Benchmark for mindie-host (client and engine mode).

See docs/benchmark.md. Entry point: :func:`mindie_host.bench.cli.main`.
"""

from __future__ import annotations
