"""The ``kvstrata`` command: ``serve`` runs a cache server, ``status`` shows one, ``demo`` runs the quick start,
``keygen`` writes CURVE key pairs for TCP."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.server_config import ServeSettings

log = logging.getLogger("kvstrata")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser() -> argparse.ArgumentParser:
    from kvstrata.core.wire.transport import default_address
    from kvstrata.server_config import add_flags

    from kvstrata import __version__

    p = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a cache server until SIGTERM/SIGINT",
                       description="Run a kvstrata cache server. Engines connect to --address (default "
                                   f"{default_address()}), register their KV cache, and STORE/RETRIEVE chunks of "
                                   "--chunk-size tokens kept in an L1 pool of --l1-size bytes of shared memory "
                                   "(allocated at start, private to this user).")
    add_flags(s)
    s.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML or YAML file of these settings, named as the flags without dashes "
                        "(l1_size = \"4G\"), at its top level or in a [serve] table; flags given here override it")

    st = sub.add_parser("status", help="show a running server: pool use, instances, transfers, hit rate",
                        description="Ask a running kvstrata server for its state and print it; exit code 1 when "
                                    "no server answers.")
    st.add_argument("--address", default=None, help=f"the server's address (default {default_address()})")
    st.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)")
    st.add_argument("--curve-server-key", default=None, metavar="FILE",
                    help="the server's CURVE public key file (NAME.key): needed for a tcp:// server")
    st.add_argument("--curve-client-key", default=None, metavar="FILE",
                    help="this client's CURVE secret key file (NAME.key_secret), whose public key the server "
                         "authorizes")

    k = sub.add_parser("keygen", help="write CURVE key pairs for serving and connecting over TCP",
                       description="Write a CURVE key pair per NAME: DIR/NAME.key (public) and DIR/NAME.key_secret "
                                   "(both keys), mode 0600; existing files are never overwritten. The server takes "
                                   "--curve-secret-key DIR/server.key_secret and --curve-clients CLIENTS, a directory "
                                   "holding a copy of each client's NAME.key; a client takes the server's "
                                   "server.key and its own NAME.key_secret.")
    k.add_argument("directory", metavar="DIR", help="where to write the key files (created 0700 if missing)")
    k.add_argument("names", nargs="*", metavar="NAME", default=["server", "client"],
                   help="one key pair per name (default: server client)")

    d = sub.add_parser("demo", help="store and retrieve a prompt's KV with an embedded server and reference engine",
                       description="Start a server process and a reference engine on CPU, store one prompt's KV, "
                                   "then retrieve it chunk-major and layer-major with early release, checking "
                                   "every byte and printing what happened.")
    d.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    d.add_argument("--layers-per-slice", type=int, default=1, help="slice width for the layer-major run (default 1)")
    d.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def serve(settings: ServeSettings, config_file: str | None = None) -> int:
    """Run a server with ``settings`` until SIGTERM or SIGINT (``config_file``: where some came from, logged)."""
    from kvstrata.core.shm import SegmentTooLarge
    from kvstrata.core.store.l2.backend import TierUnavailable
    from kvstrata.core.server.cache_server import CacheServer
    from kvstrata.core.wire.transport import default_address
    from kvstrata.native import target_openers
    from kvstrata.native.cuda_executor import CudaTransferConfig

    config = settings.server
    if config.address is None:
        config = dataclasses.replace(config, address=default_address())
    cuda_config = CudaTransferConfig(mode=settings.cuda_mode)
    if config_file:
        log.info("settings from %s, overridden by the command line's flags", config_file)
    log.info("effective configuration: %s, GPU caches: %s", config, cuda_config)
    try:
        server = CacheServer(config, target_openers=target_openers(cuda_config))
    except (ValueError, PermissionError) as exc:  # who may connect: an address or keys it refuses to serve
        print(f"kvstrata serve: {exc}", file=sys.stderr)
        return 2
    except SegmentTooLarge as exc:  # the L1 pool does not fit in /dev/shm
        print(f"kvstrata serve: --l1-size: {exc.strerror}", file=sys.stderr)
        return 2
    except TierUnavailable as exc:  # --l2 names no cluster that answers
        print(f"kvstrata serve: --l2: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status":
        return status(args)
    if args.command == "keygen":
        return keygen(args)
    if args.command == "serve":
        from kvstrata.server_config import ConfigError, settings_from

        try:
            settings = settings_from(args)
        except ConfigError as exc:
            print(f"kvstrata serve: {exc}", file=sys.stderr)
            return 2
        _setup_logging(settings.log_level)
        return serve(settings, args.config)
    _setup_logging(args.log_level)
    if args.command == "demo":
        from kvstrata.demo import run_demo

        return run_demo(tokens=args.tokens, layers_per_slice=args.layers_per_slice)
    return 2


def status(args: argparse.Namespace) -> int:
    import json

    from kvstrata.core.wire.client import CacheClient
    from kvstrata.core.wire.transport import default_address

    address = args.address or default_address()
    try:
        client = CacheClient(address, timeout=args.timeout, curve_server_key=args.curve_server_key,
                             curve_client_key=args.curve_client_key)
    except ValueError as exc:  # unusable CURVE key files
        print(f"kvstrata status: {exc}", file=sys.stderr)
        return 2
    try:
        info = client.server_info()
    except Exception as exc:
        print(f"kvstrata status: no kvstrata server answered at {address} within {args.timeout:g}s "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True, default=str))
        return 0
    print(format_status(address, info))
    return 0


def keygen(args: argparse.Namespace) -> int:
    """``kvstrata keygen DIR [NAME ...]``: a CURVE key pair per name (see :func:`kvstrata.core.wire.curve.write_keypair`)."""
    from kvstrata.core.wire.curve import CurveKeyError, write_keypair

    for name in args.names:
        try:
            public, secret = write_keypair(args.directory, name)
        except CurveKeyError as exc:
            print(f"kvstrata keygen: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: public key {public}, secret key {secret}")
    return 0


def format_tier(l2: dict | None) -> str:
    if not l2:
        return "off"
    misses = {k[len("miss_"):]: v for k, v in l2.items() if k.startswith("miss_") and v}
    nodes = l2.get("nodes") or []
    held = sum(n.get("used_bytes", 0) for n in nodes) / (1 << 20)
    down = [n["node"] for n in nodes if not n.get("reachable")]
    asked, fetched = l2.get("asked", 0), l2.get("fetched", 0)
    return (f"{l2['address']}: {len(nodes) - len(down)} of {len(nodes)} nodes answer"
            f"{' (not: ' + ', '.join(down) + ')' if down else ''}, {held:.1f} MiB held; "
            f"{fetched} of {asked} chunks asked past L1 fetched"
            f"{f' ({100 * fetched / asked:.0f}%)' if asked else ''}, misses {misses or 'none'}; "
            f"{l2.get('written', 0)} chunks written ({l2.get('write_skipped', 0)} skipped, "
            f"{l2.get('write_failed', 0)} failed, {l2.get('write_queue_bytes', 0) >> 20} MiB queued)")


def format_status(address: str, info: dict) -> str:
    """The readable table ``kvstrata status`` prints."""
    l1 = info["l1"]
    used = l1["capacity_bytes"] - l1["free_bytes"]
    totals = info.get("totals", {})
    asked = totals.get("lookup_hit_tokens", 0) + totals.get("lookup_miss_tokens", 0)
    hit_rate = f"{100 * totals.get('lookup_hit_tokens', 0) / asked:.1f}% of {int(asked)} looked-up tokens" \
        if asked else "no lookups yet"
    rows = [
        ("server", f"kvstrata {info['version']} at {address}"),
        ("uptime", f"{info.get('uptime_s', 0):.0f} s"),
        ("L1 pool", f"{used / (1 << 20):.1f} of {l1['capacity_bytes'] / (1 << 20):.0f} MiB used, "
                    f"{l1['objects']} chunks, {l1['locked_objects']} locked, {l1['evictions']} evicted"),
        ("chunk size", f"{info['chunk_size']} tokens"),
        ("hit rate", hit_rate),
        ("stored", f"{int(totals.get('stored_tokens', 0))} tokens, {totals.get('stored_bytes', 0) / (1 << 20):.1f} MiB"),
        ("retrieved", f"{int(totals.get('retrieved_tokens', 0))} tokens, "
                      f"{totals.get('retrieved_bytes', 0) / (1 << 20):.1f} MiB"),
        ("transfers in flight", str(info.get("transfers_in_flight", 0))),
        ("metrics", f"http://127.0.0.1:{info['metrics_port']}/metrics" if info.get("metrics_port") else "off"),
        ("shared tier", format_tier(info.get("l2"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    details = info.get("instance_details", [])
    lines.append(f"{'instances':<{width}}  {len(details)}")
    if details:
        lines.append("  id  format                placement  device   layers  blocks x tokens  transfers")
        for i in details:
            lines.append(f"  {i['instance_id']:>2}  {i['format']:<20}  {i['placement']:<9}  {i['device']:<7}  "
                         f"{i['layers']:>6}  {i['blocks']:>6} x {i['block_size']:<6}  {i['transfers']:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
