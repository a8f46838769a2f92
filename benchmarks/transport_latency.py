"""Transport latency: kvstrata's client and server against bare pyzmq, one leg at a time.

A retrieve's time outside the copy is a request leg (engine to server) and a
reply leg (server to engine). This measures each leg three ways on the machine
it runs on, with ``perf_counter`` (one clock across processes) stamped by the
sender and read by the receiver:

* ``raw``: bare pyzmq on both ends, the receiving thread blocked in ``recv``
  (the floor);
* ``client``: kvstrata's :class:`~kvstrata.core.wire.transport.Client` receiving
  replies from a bare echo (its I/O thread waking, the future resolving), with
  the caller blocked on the future, and with the caller polling with short
  sleeps as an engine's scheduler loop does;
* ``server``: kvstrata's :class:`~kvstrata.core.wire.transport.Server` (its threads
  taking turns on the socket) receiving from a bare DEALER.

    python benchmarks/transport_latency.py --reps 1000 --out benchmarks/results/transport-latency-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import zmq

ECHO = """
import sys, time, zmq
from kvstrata.core.wire import codec
ctx = zmq.Context(); r = ctx.socket(zmq.ROUTER); r.bind(sys.argv[1])
print("ready", flush=True)
while True:
    ident, body = r.recv_multipart()
    req = codec.decode_request(body)
    r.send_multipart([ident, codec.encode_reply(req.request_id, True, time.perf_counter())])
"""
"""A bare pyzmq server: answers every request with the time it received it."""

_SERVER = """
import sys, time
from kvstrata.core.wire.protocol import DECLARATIONS, TRANSPORT_REQUESTS, RequestType
from kvstrata.core.wire.transport import Server
s = Server(sys.argv[1], transfer_threads=4)
for rt, decl in DECLARATIONS.items():
    if rt in TRANSPORT_REQUESTS:
        continue
    names = ", ".join(item.name for item in decl.items)  # the server checks them against the declaration
    scope = {"time": time}
    exec(f"def h({names}):\\n    return time.perf_counter()", scope)
    s.register(rt, scope["h"])
s.start()
print("ready", flush=True)
sys.stdin.readline()
"""
"""kvstrata's Server with handlers that answer with the time they ran."""


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_us": round(statistics.median(s) * 1e6, 1), "p10_us": round(s[len(s) // 10] * 1e6, 1),
            "p90_us": round(s[(9 * len(s)) // 10] * 1e6, 1), "n": len(s)}


@contextlib.contextmanager
def running(code: str, address: str) -> Iterator[None]:
    """A child process running ``code`` (one of the servers above) on ``address``, killed on exit."""
    child = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield
    finally:
        child.kill()
        child.wait(timeout=10)


def bare_legs(address: str, reps: int, *, warm: int = 100, gap_s: float = 0.0,
              payload_bytes: int = 0) -> tuple[list[float], list[float]]:
    """(request legs, reply legs) in seconds of a bare pyzmq DEALER against a server above.

    Each request is a PING frame, carrying ``payload_bytes`` of padding when asked
    (the echo does not check payloads); the server's time stamp splits the round
    trip. ``gap_s`` of idle time goes before each request.
    """
    from kvstrata.core.wire import codec
    from kvstrata.core.wire.protocol import RequestType

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    items = [bytes(payload_bytes)] if payload_bytes else []
    there, back = [], []
    try:
        for i in range(reps + warm):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            dealer.send(codec._pack([codec.WIRE_VERSION, i, int(RequestType.PING), items]))
            stamp = codec.decode_reply(dealer.recv()).value
            t2 = time.perf_counter()
            if i >= warm:
                there.append(stamp - t0)
                back.append(t2 - stamp)
    finally:
        dealer.close(0)
        ctx.term()
    return there, back


def client_reply_legs(address: str, reps: int, *, warm: int, gap_s: float, polling: bool) -> list[float]:
    """Reply legs (s) of kvstrata's Client against the echo: from the echo's stamp to the future resolving."""
    from kvstrata.core.wire.protocol import RequestType
    from kvstrata.core.wire.transport import Client

    resolved: dict[str, float] = {}
    original = Client._resolve

    def stamped(self: Client, frame: bytes) -> None:
        resolved["t"] = time.perf_counter()
        original(self, frame)

    client = Client(address)
    Client._resolve = stamped  # type: ignore[method-assign]
    legs = []
    try:
        for i in range(reps + warm):
            time.sleep(gap_s)
            fut = client.submit(RequestType.PING, [])
            if polling:
                while not fut.done():
                    time.sleep(2e-5)
            sent = fut.result(timeout=5)
            if i >= warm:
                legs.append(resolved["t"] - sent)
    finally:
        Client._resolve = original  # type: ignore[method-assign]
        client.close()
    return legs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="idle time before each request: a transfer's reply comes after ~20 ms of quiet")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    n, warm = args.reps, 100
    gap = args.gap_ms / 1e3
    out: dict[str, Any] = {"benchmark": "transport_latency", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "gap_ms": args.gap_ms,
                           "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                                       "python": sys.version.split()[0], "pyzmq": zmq.__version__}}
    directory = tempfile.mkdtemp(prefix="kvstrata-latency-")

    echo = f"ipc://{directory}/echo"
    with running(ECHO, echo):
        there, back = bare_legs(echo, n, warm=warm, gap_s=gap)
        out["raw_reply_leg"] = summary(back)
        out["raw_request_leg"] = summary(there)
        for polling in (False, True):
            legs = client_reply_legs(echo, n, warm=warm, gap_s=gap, polling=polling)
            out[f"client_reply_leg_caller_{'polling' if polling else 'blocked'}"] = summary(legs)
    server = f"ipc://{directory}/server"
    with running(_SERVER, server):
        out["server_request_leg"] = summary(bare_legs(server, n, warm=warm, gap_s=gap)[0])
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
