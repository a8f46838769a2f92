"""The `kvstrata` command: help text, start-up logging, clean SIGTERM shutdown, the demo."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvstrata.core.wire.client import CacheClient
from kvstrata.core.server.config import parse_size


def test_serve_help_explains_the_flags():
    out = subprocess.run([sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--address", "--l1-size", "--chunk-size", "--log-level", "--allow-remote"):
        assert flag in out


def test_serve_takes_the_a_b_switches_as_options():
    from kvstrata.cli import build_parser
    from kvstrata.native.cuda_executor import MODES
    from kvstrata.server_config import CUDA_MODES, settings_from

    parser = build_parser()
    settings = settings_from(parser.parse_args(["serve"]))
    assert settings.cuda_mode == "staged" and settings.server.busy_poll_ms == 25.0
    settings = settings_from(parser.parse_args(["serve", "--cuda-mode", "torch", "--busy-poll-ms", "0"]))
    assert settings.cuda_mode == "torch" and settings.server.busy_poll_ms == 0.0
    assert set(CUDA_MODES) == set(MODES) - {"kernel"}  # the CLI names the executor's modes without importing torch
    for mode in CUDA_MODES:
        assert settings_from(parser.parse_args(["serve", "--cuda-mode", mode])).cuda_mode == mode
    with pytest.raises(SystemExit):  # the kernel mode lost its A/B (docs/decisions.md): not a server setting
        parser.parse_args(["serve", "--cuda-mode", "kernel"])
    out = subprocess.run([sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag, benchmark in (("--cuda-mode", True), ("--busy-poll-ms", False)):  # busy polling earned its place
        entry = out.split("\n  " + flag + " ")[1].split("\n  --")[0]  # the flag's own help
        assert ("benchmark parameter" in entry) == benchmark, (flag, entry)


def test_parse_size():
    assert parse_size("512M") == 512 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    for bad in ("lots", "-1M", "1X"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_every_serve_setting_is_a_flag_and_a_config_key_from_one_declaration(tmp_path):
    """The flags, the config keys and the checks all come from the settings dataclasses."""
    from kvstrata.cli import build_parser
    from kvstrata.core.server.config import ConnectionLimits, ServerConfig, declared
    from kvstrata.server_config import ServeSettings, read_config, settings_from

    items = declared(ServeSettings)
    keys = [d.key for d in items]
    for key in ("address", "l1_size", "chunk_size", "transfer_threads", "busy_poll_ms", "cuda_mode",
                "allow_remote", "metrics_port", "max_message_bytes", "curve_secret_key",
                "curve_clients", "log_level", "lease_seconds", "max_instances_per_connection",
                "max_reserved_fraction", "max_lock_owners_per_connection", "max_prompt_tokens",
                "max_request_id_bytes"):
        assert key in keys, key
    parser = build_parser()
    defaults = settings_from(parser.parse_args(["serve"]))
    assert defaults.server == ServerConfig() and defaults.server.limits == ConnectionLimits()
    assert defaults.server.l1_bytes == 1 << 30 and defaults.log_level == "INFO"
    # a file sets what no flag gives; a flag wins over the file (also an abbreviated one, as argparse allows)
    config = tmp_path / "kvstrata.toml"
    config.write_text('[serve]\nl1_size = "32M"\nchunk_size = 128\nlease-seconds = 5\ncuda_mode = "torch"\n')
    assert read_config(str(config)) == {"l1_size": 32 << 20, "chunk_size": 128, "lease_seconds": 5.0,
                                        "cuda_mode": "torch"}
    settings = settings_from(parser.parse_args(["serve", "--config", str(config), "--chunk-size", "64",
                                                "--max-reserved", "0.25"]))
    assert settings.server.l1_bytes == 32 << 20 and settings.server.chunk_size == 64
    assert settings.server.limits.lease_seconds == 5.0 and settings.server.limits.max_reserved_fraction == 0.25
    assert settings.cuda_mode == "torch"


@pytest.mark.parametrize("flags, message", [
    (["--chunk-size", "0"], "argument --chunk-size: '0' is not an integer >= 1"),
    (["--l1-size", "lots"], "argument --l1-size: 'lots' is not a size"),
    (["--max-reserved-fraction", "1.5"], "argument --max-reserved-fraction: '1.5' is not a number in (0, 1]"),
    (["--lease-seconds", "0"], "argument --lease-seconds: '0' is not a number > 0"),
    (["--metrics-port", "70000"], "argument --metrics-port: '70000' is not an integer in [0, 65535]"),
])
def test_a_bad_flag_is_refused_naming_it(flags, message, capsys):
    from kvstrata.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_a_pool_larger_than_dev_shm_is_refused_at_start_naming_the_flag(tmp_path):
    """The pool is allocated when the server starts (so an engine registering it for DMA does not pay for its
    pages): one that /dev/shm cannot hold is refused there, with the room there is, and nothing is left."""
    fs = os.statvfs("/dev/shm")
    too_large = fs.f_bavail * fs.f_frsize + (1 << 30)
    proc = subprocess.run([sys.executable, "-m", "kvstrata", "serve", "--address", f"ipc://{tmp_path}/s.sock",
                           "--l1-size", str(too_large)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "kvstrata serve: --l1-size: " in proc.stderr and "bytes free, fewer than the" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "s.sock")


def test_a_bad_value_in_code_is_refused_naming_the_setting():
    from kvstrata.core.server.config import ConnectionLimits, ServerConfig

    with pytest.raises(ValueError, match=r"chunk_size = 0 is not an integer >= 1"):
        ServerConfig(chunk_size=0)
    with pytest.raises(ValueError, match=r"max_reserved_fraction = 0 is not a number in \(0, 1\]"):
        ConnectionLimits(max_reserved_fraction=0)
    with pytest.raises(ValueError, match=r"max_prompt_tokens = True is not an integer >= 1"):
        ConnectionLimits(max_prompt_tokens=True)
    config = ServerConfig(l1_bytes="16M")
    assert config.l1_bytes == 16 << 20
    config.chunk_size = -1  # the config is mutable: the server checks it again when it starts
    with pytest.raises(ValueError, match="chunk_size = -1"):
        config.check()


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
    from kvstrata.server_process import ServerProcess

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

    from kvstrata.server_process import ServerProcess

    sp = ServerProcess(l1_bytes=8 << 20)
    with pytest.raises(TimeoutError, match="did not answer PING"):
        sp.start(timeout=0.01)
    assert sp.proc.poll() is not None
