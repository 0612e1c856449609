"""Front end <-> engine-process IPC: ZeroMQ + msgspec against multiprocessing's shared-memory queues.

Each transport echoes messages through a child process (spawned, as the engine process is).
Two message kinds, both the real types encoded the way each transport would carry them:

* ``request``: one :class:`EngineRequest` (a 1,000-token prompt), front end -> engine;
* ``outputs``: one step's batch of 32 :class:`RequestOutput` (one new token each), engine -> front end.

Reported per transport and kind: median round-trip latency (one message in flight) and
one-way throughput (messages/s, a burst of N then one acknowledgement).

    python bench/ipc_bench.py [--n 2000]

``mp-queue`` is :class:`multiprocessing.Queue` (a pipe plus pickle: what "shared-memory queue"
means in the standard library); ``mp-shm`` is a :class:`multiprocessing.shared_memory` ring of
one slot with two semaphores, the messages msgspec-encoded into it, which is the lowest-copy
design the standard library allows without a lock-free ring.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from multiprocessing import shared_memory
from typing import Any

import msgspec
import zmq

from mindie_host.engine import ipc
from mindie_host.engine.request import EngineRequest, RequestOutput, SamplingParams

SLOT = 1 << 20


def sample(kind: str) -> Any:
    if kind == "request":
        return EngineRequest("cmpl-123", list(range(1000)), SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256))
    return [RequestOutput(f"cmpl-{i}", [42], " the", "text so far the", list(range(100)), 1000) for i in range(32)]


def frames_of(kind: str, msg: Any) -> list[bytes]:
    return ipc.encode_request(msg) if kind == "request" else ipc.encode(ipc.OUTPUTS, msg, {"num_running": 32.0})


def decode_frames(kind: str, frames: list[bytes]) -> Any:
    return ipc.decode_request(frames) if kind == "request" else ipc.decode_outputs(frames[1])


# -- ZeroMQ + msgspec -------------------------------------------------------------------------------
def zmq_echo(addr_in: str, addr_out: str, kind: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    while True:
        frames = pull.recv_multipart()
        if frames[0] == b"stop":
            break
        msg = decode_frames(kind, frames)  # the receiver always decodes, as the engine does
        push.send_multipart([b"ok"] if frames[0] == b"burst" else frames_of(kind, msg))


def bench_zmq(kind: str, n: int, tmp: str) -> tuple[float, float]:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    a_in, a_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    push.bind(a_in)
    pull.bind(a_out)
    proc = mp.get_context("spawn").Process(target=zmq_echo, args=(a_in, a_out, kind))
    proc.start()
    msg = sample(kind)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        push.send_multipart(frames_of(kind, msg))
        decode_frames(kind, pull.recv_multipart())
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        frames = frames_of(kind, msg)
        frames[0] = b"burst"
        push.send_multipart(frames)
    for _ in range(n):
        pull.recv_multipart()
    rate = n / (time.perf_counter() - t)
    push.send_multipart([b"stop"])
    proc.join()
    ctx.destroy(linger=0)
    return statistics.median(lat) * 1e6, rate


# -- multiprocessing.Queue (pickle over a pipe) ------------------------------------------------------
def queue_echo(q_in: Any, q_out: Any) -> None:
    while True:
        item = q_in.get()
        if item is None:
            break
        burst, msg = item
        q_out.put(b"ok" if burst else msg)


def bench_queue(kind: str, n: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=queue_echo, args=(q_in, q_out))
    proc.start()
    msg = sample(kind)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        q_in.put((False, msg))
        q_out.get()
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        q_in.put((True, msg))
    for _ in range(n):
        q_out.get()
    rate = n / (time.perf_counter() - t)
    q_in.put(None)
    proc.join()
    return statistics.median(lat) * 1e6, rate


# -- shared memory, one slot, msgspec-encoded ---------------------------------------------------------
def shm_echo(name_in: str, name_out: str, sems: tuple[Any, Any, Any, Any], kind: str) -> None:
    full_in, free_in, full_out, free_out = sems
    shm_in, shm_out = shared_memory.SharedMemory(name_in), shared_memory.SharedMemory(name_out)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(EngineRequest if kind == "request" else list[RequestOutput])
    while True:
        full_in.acquire()
        size = int.from_bytes(shm_in.buf[:4], "little")
        burst = shm_in.buf[4]
        msg = dec.decode(bytes(shm_in.buf[5:5 + size])) if size else None
        free_in.release()
        if size == 0:
            break
        data = b"ok" if burst else enc.encode(msg)
        free_out.acquire()
        shm_out.buf[:4] = len(data).to_bytes(4, "little")
        shm_out.buf[4:4 + len(data)] = data
        full_out.release()
    shm_in.close()
    shm_out.close()


def bench_shm(kind: str, n: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    shm_in = shared_memory.SharedMemory(create=True, size=SLOT)
    shm_out = shared_memory.SharedMemory(create=True, size=SLOT)
    full_in, free_in, full_out, free_out = ctx.Semaphore(0), ctx.Semaphore(1), ctx.Semaphore(0), ctx.Semaphore(1)
    proc = ctx.Process(target=shm_echo, args=(shm_in.name, shm_out.name, (full_in, free_in, full_out, free_out), kind))
    proc.start()
    msg = sample(kind)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(EngineRequest if kind == "request" else list[RequestOutput])

    def send(obj: Any, burst: bool = False) -> None:
        data = enc.encode(obj)
        free_in.acquire()
        shm_in.buf[:4] = len(data).to_bytes(4, "little")
        shm_in.buf[4] = int(burst)
        shm_in.buf[5:5 + len(data)] = data
        full_in.release()

    def recv() -> Any:
        full_out.acquire()
        size = int.from_bytes(shm_out.buf[:4], "little")
        data = bytes(shm_out.buf[4:4 + size])
        free_out.release()
        return data if data == b"ok" else dec.decode(data)

    lat = []
    for _ in range(n):
        t = time.perf_counter()
        send(msg)
        recv()
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    # one slot each way: a burst is a pipelined ping-pong (the echo refills while we send the next)
    sent = got = 0
    while got < n:
        if sent < n and free_in.acquire(block=False):
            free_in.release()
            send(msg, burst=True)
            sent += 1
        else:
            recv()
            got += 1
    rate = n / (time.perf_counter() - t)
    free_in.acquire()
    shm_in.buf[:4] = (0).to_bytes(4, "little")
    full_in.release()
    proc.join()
    for shm in (shm_in, shm_out):
        shm.close()
        shm.unlink()
    return statistics.median(lat) * 1e6, rate


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    sizes = {k: sum(len(f) for f in frames_of(k, sample(k))) for k in ("request", "outputs")}
    pickled = {k: len(pickle.dumps(sample(k))) for k in ("request", "outputs")}
    print(f"message bytes, msgpack (pickle): request {sizes['request']} ({pickled['request']}), "
          f"outputs {sizes['outputs']} ({pickled['outputs']})")
    print(f"{'transport':<12} {'message':<8} {'p50 round trip (us)':>20} {'one-way msgs/s':>15}")
    for kind in ("request", "outputs"):
        with tempfile.TemporaryDirectory() as tmp:
            rows = [("zmq+msgspec", bench_zmq(kind, args.n, tmp)), ("mp-queue", bench_queue(kind, args.n)),
                    ("mp-shm", bench_shm(kind, args.n))]
        for name, (lat, rate) in rows:
            print(f"{name:<12} {kind:<8} {lat:>20.1f} {rate:>15.0f}")


if __name__ == "__main__":
    main()
