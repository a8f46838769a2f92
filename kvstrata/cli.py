"""The ``kvstrata`` command: ``serve`` runs a cache server, ``demo`` runs the embedded quick start."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading

log = logging.getLogger("kvstrata")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '1G', '1GiB', '1048576' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 4G or a byte count)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser() -> argparse.ArgumentParser:
    from kvstrata.core.wire.transport import default_address

    p = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a cache server until SIGTERM/SIGINT",
                       description="Run a kvstrata cache server. Engines connect to --address, register their KV "
                                   "cache, and STORE/RETRIEVE chunks of --chunk-size tokens kept in an L1 pool of "
                                   "--l1-size bytes of shared memory (allocated at start, private to this user).")
    s.add_argument("--address", default=None,
                   help="ipc://PATH or tcp://127.0.0.1:PORT to bind (default: an IPC socket in a private "
                        f"per-user directory, currently {default_address()})")
    s.add_argument("--l1-size", type=parse_size, default=parse_size("1G"),
                   help="bytes of host memory for cached KV, e.g. 512M, 8G (default 1G)")
    s.add_argument("--chunk-size", type=int, default=256,
                   help="tokens per stored chunk; engines' hits are multiples of this (default 256)")
    s.add_argument("--transfer-threads", type=int, default=4,
                   help="threads running STORE/RETRIEVE copies, so PING and LOOKUP never wait on them (default 4)")
    s.add_argument("--busy-poll-ms", type=float, default=25.0,
                   help="with a GPU cache registered, keep polling the socket without sleeping this long after "
                        "each request, so the next one is taken at once (about one core while it lasts; 0 = off; "
                        "default 25)")
    s.add_argument("--cuda-mode", default="staged", choices=["staged", "kernel", "torch"],
                   help="how GPU caches are copied, for A/B measurements (default staged; see "
                        "kvstrata.native.cuda_executor)")
    s.add_argument("--no-deferred-replies", dest="deferred_replies", action="store_false",
                   help="with busy polling, answer a transfer from its own thread instead of the polling thread, "
                        "for A/B measurements")
    s.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback TCP address (off by default: the protocol has no auth)")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    d = sub.add_parser("demo", help="store and retrieve a prompt's KV with an embedded server and reference engine",
                       description="Start a server process and a reference engine on CPU, store one prompt's KV, "
                                   "then retrieve it chunk-major and layer-major with early release, checking "
                                   "every byte and printing what happened.")
    d.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    d.add_argument("--layers-per-stage", type=int, default=1, help="slice width for the layer-major run (default 1)")
    d.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def serve(args: argparse.Namespace) -> int:
    from kvstrata.core.server.cache_server import CacheServer, ServerConfig
    from kvstrata.core.wire.transport import default_address

    config = ServerConfig(address=args.address or default_address(), l1_bytes=args.l1_size,
                          chunk_size=args.chunk_size, transfer_threads=args.transfer_threads,
                          allow_remote=args.allow_remote, busy_poll_ms=args.busy_poll_ms,
                          deferred_replies=args.deferred_replies)
    from kvstrata.native import target_openers
    from kvstrata.native.cuda_executor import CudaTransferConfig

    cuda_config = CudaTransferConfig(mode=args.cuda_mode)
    log.info("starting with %s, GPU caches: %s", config, cuda_config)
    server = CacheServer(config, target_openers=target_openers(cuda_config))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    if args.command == "serve":
        return serve(args)
    if args.command == "demo":
        from kvstrata.demo import run_demo

        return run_demo(tokens=args.tokens, layers_per_stage=args.layers_per_stage)
    return 2


if __name__ == "__main__":
    sys.exit(main())
