"""Transport latency: kvstrata's client and server against bare pyzmq, one leg at a time.

A retrieve's time outside the copy is a request leg (engine to server) and a
reply leg (server to engine). This measures each leg three ways on the machine
it runs on, with ``perf_counter`` (one clock across processes) stamped by the
sender and read by the receiver:

* ``raw``: bare pyzmq on both ends, the receiving thread blocked in ``recv``
  (the floor);
* ``client``: kvstrata's :class:`~kvstrata.core.transport.Client` receiving
  replies from a bare echo (its I/O thread waking, the future resolving), with
  the caller blocked on the future, and with the caller polling with short
  sleeps as an engine's scheduler loop does;
* ``server``: kvstrata's :class:`~kvstrata.core.transport.Server` (its threads
  taking turns on the socket) receiving from a bare DEALER.

    python benchmarks/transport_latency.py --reps 1000 --out benchmarks/results/transport-latency-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

_ECHO = """
import sys, time, zmq
from kvstrata.core import codec
ctx = zmq.Context(); r = ctx.socket(zmq.ROUTER); r.bind(sys.argv[1])
print("ready", flush=True)
while True:
    ident, body = r.recv_multipart()
    if body == b"stop":
        break
    req = codec.decode_request(body)
    r.send_multipart([ident, codec.encode_reply(req.request_id, True, time.perf_counter())])
"""

_SERVER = """
import sys, time
from kvstrata.core.protocol import DECLARATIONS, RequestType
from kvstrata.core.transport import Server
s = Server(sys.argv[1], transfer_threads=4)
arrived = []
for rt, decl in DECLARATIONS.items():
    names = ", ".join(f"a{i}" for i in range(decl.arity))
    scope = {"time": time}
    exec(f"def h({names}):\\n    return time.perf_counter()", scope)
    s.register(rt, scope["h"])
s.start()
print("ready", flush=True)
sys.stdin.readline()
s.stop()
"""


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_us": round(statistics.median(s) * 1e6, 1), "p10_us": round(s[len(s) // 10] * 1e6, 1),
            "p90_us": round(s[(9 * len(s)) // 10] * 1e6, 1), "n": len(s)}


def spawn(code: str, address: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def main() -> int:
    from kvstrata.core import codec
    from kvstrata.core.protocol import RequestType
    from kvstrata.core.transport import Client

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

    # raw and client reply legs, against the bare echo
    echo = spawn(_ECHO, f"ipc://{directory}/echo")
    try:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{directory}/echo")
        legs = []
        for i in range(n + warm):
            time.sleep(gap)
            dealer.send(codec._pack([codec.WIRE_VERSION, i, int(RequestType.PING), []]))
            reply = dealer.recv()
            if i >= warm:
                legs.append(time.perf_counter() - codec.decode_reply(reply).value)
        out["raw_reply_leg"] = summary(legs)
        dealer.close(0)
        ctx.term()
    except Exception:
        echo.kill()
        raise
    echo.kill()
    echo = spawn(_ECHO, f"ipc://{directory}/echo2")
    client = Client(f"ipc://{directory}/echo2")
    resolved: dict[str, float] = {}
    original = Client._resolve

    def stamped(self: Client, frame: bytes) -> None:
        resolved["t"] = time.perf_counter()
        original(self, frame)

    Client._resolve = stamped  # type: ignore[method-assign]
    try:
        for mode in ("blocked", "polling"):
            legs = []
            for i in range(n + warm):
                time.sleep(gap)
                fut = client.submit(RequestType.PING, [])
                if mode == "polling":
                    while not fut.done():
                        time.sleep(2e-5)
                sent = fut.result(timeout=5)
                if i >= warm:
                    legs.append(resolved["t"] - sent)
            out[f"client_reply_leg_caller_{mode}"] = summary(legs)
    finally:
        Client._resolve = original  # type: ignore[method-assign]
        client.close()
        echo.kill()

    # raw and server request legs: a bare DEALER to the bare echo, then to kvstrata's Server
    for name, code in (("raw_request_leg", _ECHO), ("server_request_leg", _SERVER)):
        address = f"ipc://{directory}/{name}"
        child = spawn(code, address)
        try:
            ctx = zmq.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(address)
            legs = []
            for i in range(n + warm):
                time.sleep(gap)
                t0 = time.perf_counter()
                dealer.send(codec._pack([codec.WIRE_VERSION, i, int(RequestType.PING), []]))
                arrived = codec.decode_reply(dealer.recv()).value
                if i >= warm:
                    legs.append(arrived - t0)
            out[name] = summary(legs)
            dealer.close(0)
            ctx.term()
        finally:
            child.kill()
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
