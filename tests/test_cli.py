"""The `kvstrata` command: help text, start-up logging, clean SIGTERM shutdown, the demo."""

import os
import re
import signal
import subprocess
import sys
import time

from kvstrata.core.wire.client import CacheClient
from kvstrata.cli import parse_size


def test_serve_help_explains_the_flags():
    out = subprocess.run([sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--address", "--l1-size", "--chunk-size", "--log-level", "--allow-remote"):
        assert flag in out


def test_serve_takes_the_a_b_switches_as_options():
    from kvstrata.cli import build_parser
    from kvstrata.native.cuda_executor import MODES

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.cuda_mode == "staged" and args.deferred_replies is True
    args = parser.parse_args(["serve", "--cuda-mode", "kernel", "--no-deferred-replies"])
    assert args.cuda_mode == "kernel" and args.deferred_replies is False
    for mode in MODES:  # every mode the executor knows is accepted
        assert parser.parse_args(["serve", "--cuda-mode", mode]).cuda_mode == mode


def test_parse_size():
    assert parse_size("512M") == 512 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096


def test_sigterm_shuts_down_cleanly_and_removes_shared_memory(tmp_path):
    address = f"ipc://{tmp_path}/s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--address", address, "--l1-size", "16M",
                             "--log-level", "INFO"], stderr=subprocess.PIPE, text=True)
    client = CacheClient(address, timeout=1.0)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                info = client.server_info()
                break
            except Exception:
                assert time.monotonic() < deadline, "server did not come up"
        segment = info["pool"]["name"]
        assert os.path.exists(f"/dev/shm/{segment}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        stderr = proc.stderr.read()
        assert re.search(r"effective configuration: ServerConfig\(address=.*l1_bytes=16777216", stderr)
        assert "received SIGTERM" in stderr and f"{segment} removed" in stderr
        assert not os.path.exists(f"/dev/shm/{segment}")
        assert not os.path.exists(str(tmp_path / "s.sock"))
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_demo_runs_and_checks_every_byte():
    out = subprocess.run([sys.executable, "-m", "kvstrata", "demo", "--tokens", "512"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "32/32 layers byte-exact" in out.stdout and "transfer still in flight" in out.stdout
    assert out.stdout.strip().endswith("ok")


def test_a_starting_server_removes_segments_left_by_dead_processes(tmp_path):
    from kvstrata.core.shm import SHM_DIR, Segment
    from kvstrata.core.testing.server_process import ServerProcess

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Segment(f"kvstrata-l1-{dead.pid}-0123abcd", 4096, create=True)
    alive = Segment.create("engine", 4096)  # this process's: must survive
    try:
        with ServerProcess(l1_bytes=8 << 20, log_level="WARNING"):
            pass
        assert not os.path.exists(os.path.join(SHM_DIR, stale.name))
        assert os.path.exists(os.path.join(SHM_DIR, alive.name))
    finally:
        stale.close()
        stale.unlink()
        alive.destroy()


def test_a_server_that_never_answers_is_not_left_running():
    import pytest

    from kvstrata.core.testing.server_process import ServerProcess

    sp = ServerProcess(l1_bytes=8 << 20)
    with pytest.raises(TimeoutError, match="did not answer PING"):
        sp.start(timeout=0.01)
    assert sp.proc.poll() is not None
