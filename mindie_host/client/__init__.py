"""MindIE Client: a Python client for mindie-host (and MindIE Server) over HTTP(S).

    from mindie_host.client import MindIEHTTPClient, Input, RequestedOutput

See docs/client.md for the method -> endpoint mapping.
"""

from __future__ import annotations

from .aio import AsyncioRequest, AsyncMindIEHTTPClient
from .http import MindIEHTTPClient
from .types import AsyncRequest, Input, MindIEClientException, RequestedOutput, Result

__all__ = [
    "AsyncMindIEHTTPClient",
    "AsyncRequest",
    "AsyncioRequest",
    "Input",
    "MindIEClientException",
    "MindIEHTTPClient",
    "RequestedOutput",
    "Result",
]
