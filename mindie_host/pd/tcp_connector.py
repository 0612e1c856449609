"""The builtin KV connector: D pulls a handed-off sequence's blocks from P over a TCP connection.

Why TCP and not ``torch.distributed`` send/recv: P and D instances come and go (the controller
assigns roles, a D may die mid-load), and any P may serve any D. A process group has a fixed
membership, collective calls block both ends until the peer answers, and one dead member
breaks the group for every other; a TCP connection per transfer needs no rendezvous, fails
alone, and a timeout bounds it. The copy is one ``index_select`` per cache tensor on P and one
buffer per tensor on D, sent without further copies.

Wire format (one connection per transfer; every frame is a 4-byte big-endian length and a body):

1. D -> P: ``{"op": "pull", "handle": ..., "layout": {...}}`` (JSON)
2. P -> D: ``{"ok": false, "error": ...}``, or ``{"ok": true, "meta": {...}, "blocks": n,
   "sizes": [bytes per tensor]}`` followed by the raw bytes of each tensor, in order
3. D -> P: ``{"op": "ack"}`` once every byte arrived; P then reports the blocks sent.

P compares D's layout with its own before reading a block, and D checks P's answer against
its layout and the sizes, so a pair that disagrees on dtype, block size or shapes moves no KV.
Anything short of a complete copy is reported as failed and nothing is applied.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import hookimpl
from ..engine.kv_transfer import FAILED, RECEIVED, SEND_FAILED, SENT, BlockReader, KVConnector, KVLayout, TransferEvent

log = logging.getLogger("mindie_host.pd")

#: Seconds a transfer may stall (connecting, any read or write) before it counts as failed.
TRANSFER_TIMEOUT = 30.0
_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20


def _send_frame(sock: socket.socket, data: dict[str, Any]) -> None:
    body = json.dumps(data, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    view = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return view


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"a {n}-byte header is not a KV transfer frame")
    data = json.loads(bytes(_recv_exact(sock, n)))
    if not isinstance(data, dict):
        raise ConnectionError("a KV transfer frame is not a JSON object")
    return data


class TCPConnector(KVConnector):
    """KV transfers over TCP: P listens on ``host`` (an ephemeral port), D connects per transfer."""

    def __init__(self, host: str, advertise: str, timeout: float = TRANSFER_TIMEOUT) -> None:
        self.host = host
        self.advertise = advertise
        self.timeout = timeout
        self.layout: KVLayout | None = None
        self.read_blocks: BlockReader | None = None
        self.offers: dict[str, tuple[list[int], dict[str, Any]]] = {}
        self.events: deque[TransferEvent] = deque()
        self.lock = threading.Lock()
        self.linked: dict[str, None] = {}
        self.listener: socket.socket | None = None
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mindie-kv-pull")
        self.closed = False

    # -- both ---------------------------------------------------------------------------------
    def start(self, layout: KVLayout, read_blocks: BlockReader) -> str:
        self.layout, self.read_blocks = layout, read_blocks
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(64)
        self.listener = sock
        threading.Thread(target=self._accept, name="mindie-kv-serve", daemon=True).start()
        address = f"{self.advertise}:{sock.getsockname()[1]}"
        log.info("KV connector (tcp) serving on %s", address)
        return address

    def poll(self) -> list[TransferEvent]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def linked_peers(self) -> list[str]:
        with self.lock:
            return list(self.linked)

    def close(self) -> None:
        self.closed = True
        if self.listener is not None:
            self.listener.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- P ------------------------------------------------------------------------------------
    def offer(self, handle: str, blocks: list[int], meta: dict[str, Any]) -> None:
        with self.lock:
            self.offers[handle] = (list(blocks), dict(meta))

    def withdraw(self, handle: str) -> None:
        with self.lock:
            self.offers.pop(handle, None)

    def _accept(self) -> None:
        assert self.listener is not None
        while not self.closed:
            try:
                conn, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_one, args=(conn, f"{addr[0]}:{addr[1]}"), daemon=True,
                             name="mindie-kv-send").start()

    def _serve_one(self, conn: socket.socket, peer: str) -> None:
        handle, taken = "", False
        with conn:
            try:
                conn.settimeout(self.timeout)
                ask = _recv_frame(conn)
                handle = str(ask.get("handle", ""))
                assert self.layout is not None and self.read_blocks is not None
                problem = self.layout.mismatch(ask.get("layout") or {})
                with self.lock:
                    offer = self.offers.pop(handle, None) if problem is None else None
                taken = offer is not None
                if problem is not None:
                    _send_frame(conn, {"ok": False, "error": f"P and D disagree on the KV layout: {problem}"})
                    with self.lock:
                        gone = self.offers.pop(handle, None)
                    if gone is not None:
                        self.events.append(TransferEvent(SEND_FAILED, handle, peer, error="layout mismatch"))
                    return
                if offer is None:
                    _send_frame(conn, {"ok": False, "error": f"P holds no KV for {handle!r} (expired or released)"})
                    return
                blocks, meta = offer
                tensors = [t.contiguous() for t in self.read_blocks(blocks)]
                raw = [t.view(torch.uint8).numpy() if t.numel() else t.numpy() for t in tensors]
                _send_frame(conn, {"ok": True, "meta": meta, "blocks": len(blocks), "sizes": [r.nbytes for r in raw]})
                for r in raw:
                    conn.sendall(memoryview(r).cast("B"))
                ack = _recv_frame(conn)
                if ack.get("op") != "ack":
                    raise ConnectionError(f"expected an ack, got {ack!r}")
                self.events.append(TransferEvent(SENT, handle, peer))
            except (OSError, ValueError, ConnectionError) as exc:
                if taken:
                    self.events.append(TransferEvent(SEND_FAILED, handle, peer, error=f"{type(exc).__name__}: {exc}"))

    # -- D ------------------------------------------------------------------------------------
    def pull(self, handle: str, source: str) -> None:
        self.pool.submit(self._pull, handle, source)

    def _pull(self, handle: str, source: str) -> None:
        assert self.layout is not None
        try:
            host, _, port = source.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=self.timeout) as sock:
                sock.settimeout(self.timeout)
                _send_frame(sock, {"op": "pull", "handle": handle, "layout": self.layout.to_dict()})
                head = _recv_frame(sock)
                if not head.get("ok"):
                    raise ConnectionError(str(head.get("error") or "P refused the transfer"))
                n = int(head["blocks"])
                dtype = getattr(torch, self.layout.dtype)
                expected = [n * int(torch.tensor([], dtype=dtype).element_size()) * _prod(shape)
                            for shape in self.layout.block_shapes]
                if list(head.get("sizes", [])) != expected:
                    raise ConnectionError(f"P announced {head.get('sizes')} bytes per tensor, expected {expected}")
                tensors = []
                for shape, size in zip(self.layout.block_shapes, expected):
                    buf = bytearray(size)
                    _recv_exact(sock, size, memoryview(buf))
                    tensors.append(torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(n, *shape)
                                   if size else torch.empty((n, *shape), dtype=dtype))
                _send_frame(sock, {"op": "ack"})
            with self.lock:
                self.linked[source] = None
            self.events.append(TransferEvent(RECEIVED, handle, source, tensors=tensors, meta=dict(head.get("meta", {}))))
        except Exception as exc:  # reported to the engine, which fails this request alone
            with self.lock:
                self.linked.pop(source, None)
            self.events.append(TransferEvent(FAILED, handle, source, error=f"{type(exc).__name__}: {exc}"))


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


@hookimpl(trylast=True)
def mindie_host_kv_connector(ctx: Any) -> KVConnector:
    """The builtin transport (TCP), listening on the business address."""
    config = ctx.config
    ip = config.ServerConfig.ipAddress
    advertise = ip if ip not in ("0.0.0.0", "") else config.ServerConfig.managementIpAddress
    return TCPConnector(ip, advertise)
