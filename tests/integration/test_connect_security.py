"""Who may connect: a real `kvstrata serve` refuses addresses other users could reach, serves TCP to
CURVE-authorized clients only, and drops an oversize frame unread.

Every "refused" below is shown from the side that is refused (an exit code and its message, a handshake
event from libzmq, a kernel error), never by waiting for a reply that does not come: the waits in these
tests are bounds that only catch a hang.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import sys

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstrata.server_process import ServerProcess
from kvstrata.core.wire import codec
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.curve import HANDSHAKE_EVENTS, ClientCurve, CurveKeyError, ServerCurve, write_keypair
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.wire.transport import (DEFAULT_MAX_MESSAGE_BYTES, Client, RequestTimeout, Server,
                                          check_bind_address, default_address, ensure_private_dir)

NOBODY = 65534
HANG_MS = 60_000
"""Bound on waits for an event that is certain to come (a handshake's end, a disconnect): catches a hang only."""

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to chown to, or run as, another user)")


def kvstrata(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``kvstrata`` command to its end (a server that is refused exits at once; the bound catches one
    that was not)."""
    return subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def serve_refused(address: str, *flags: str) -> str:
    """``kvstrata serve`` on ``address``, which must be refused: its one-line error."""
    out = kvstrata("serve", "--address", address, "--l1-size", "8M", "--log-level", "WARNING", *flags)
    assert out.returncode == 2, (out.returncode, out.stderr)
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kvstrata serve: "), out.stderr
    return line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SETTLED = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
"""Handshake ends after which libzmq does not try again (a NO_DETAIL failure, a dropped connection, may come
first: the client then reconnects)."""


def handshake_end(address: str, curve: ClientCurve | None) -> dict:
    """How a bare pyzmq DEALER's handshakes with ``address`` end for good (libzmq's monitor event)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(dealer)
    monitor = dealer.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        dealer.connect(address)
        while True:
            assert monitor.poll(HANG_MS), "no handshake ended"
            event = recv_monitor_message(monitor)
            if event["event"] in SETTLED:
                return event
    finally:
        monitor.close(0)
        dealer.close(0)
        ctx.term()


def refusal(client: Client, expected: str, attempts: int = 100) -> str:
    """The timeout message of a client the server never answers, once it says ``expected`` (the client
    learns how its handshake ended from libzmq, at its own pace: each attempt also shows no reply came)."""
    for _ in range(attempts):
        with pytest.raises(RequestTimeout) as info:
            client.call(RequestType.PING, timeout=0.5)
        if expected in str(info.value):
            return str(info.value)
    pytest.fail(f"the timeout never said {expected!r}: {info.value}")


# --- IPC: abstract sockets and the socket's directory ---------------------------------------------------


def test_an_abstract_ipc_address_is_refused():
    name = f"kvstrata-test-{os.getpid()}"
    with pytest.raises(ValueError, match="abstract socket"):
        check_bind_address(f"ipc://@{name}")
    line = serve_refused(f"ipc://@{name}")
    assert "abstract socket" in line and "any local user could connect" in line
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(ConnectionRefusedError):
        s.connect("\0" + name)  # nothing was bound there


def _symlinked(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    return tmp_path / "link", "is a symbolic link"


def _group_writable(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o770)
    return d, f"{d} has mode 0770"


def _world_readable(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o705)
    return d, f"{d} has mode 0705"


def _foreign_owned(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another user")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    return d, f"{d} belongs to uid {NOBODY}"


@pytest.mark.parametrize("make", [_symlinked, _group_writable, _world_readable, _foreign_owned],
                         ids=["symlink", "group-writable", "world-readable", "foreign-owned"])
def test_a_socket_directory_others_control_is_refused_and_left_alone(tmp_path, make):
    directory, expected = make(tmp_path)
    before = os.lstat(directory)
    line = serve_refused(f"ipc://{directory}/server.sock")
    assert expected in line, line
    after = os.lstat(directory)
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid), "the directory was changed"
    assert not os.path.exists(os.path.join(os.path.realpath(directory), "server.sock"))


def test_the_default_socket_directory_is_made_private_and_never_followed_or_re_moded(tmp_path, monkeypatch):
    base = tmp_path / "runtime"
    base.mkdir(mode=0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    mine = base / f"kvstrata-{os.getuid()}"
    assert default_address() == f"ipc://{mine}/server.sock"
    st = os.lstat(mine)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert default_address() == f"ipc://{mine}/server.sock"  # the same directory again: fine

    mine.chmod(0o750)
    with pytest.raises(PermissionError, match=f"{mine} has mode 0750"):
        default_address()
    assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o750  # reported, not fixed
    mine.rmdir()

    elsewhere = tmp_path / "planted"
    elsewhere.mkdir(mode=0o700)
    mine.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="symbolic link"):
        default_address()
    mine.unlink()

    mine.write_text("")
    with pytest.raises(PermissionError, match="not a directory"):
        ensure_private_dir(str(mine))


# --- TCP: CURVE -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def curve_server(curve_keys):
    """A real `kvstrata serve` on loopback TCP, serving the fixture's authorized client only."""
    with ServerProcess(address=f"tcp://127.0.0.1:{free_port()}", l1_bytes=8 << 20, extra_args=curve_keys.serve_args,
                       client_options=curve_keys.client_options) as srv:
        yield srv


def test_an_authorized_client_is_served(curve_server, curve_keys):
    client = CacheClient(curve_server.address, timeout=20, **curve_keys.client_options)
    try:
        assert client.ping() == "pong"
        assert client.server_info()["version"]
    finally:
        client.close()
    assert handshake_end(curve_server.address, ClientCurve.load(curve_keys.server_public, curve_keys.client_secret)
                         )["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    out = kvstrata("status", "--address", curve_server.address, "--curve-server-key", curve_keys.server_public,
                   "--curve-client-key", curve_keys.client_secret, "--timeout", "20")
    assert out.returncode == 0, out.stderr
    assert f"at {curve_server.address}" in out.stdout


def test_a_client_with_an_unknown_key_is_refused(curve_server, curve_keys):
    stranger = ClientCurve.load(curve_keys.server_public, curve_keys.stranger_secret)
    event = handshake_end(curve_server.address, stranger)
    assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and event["value"] == 400  # ZAP: denied

    client = Client(curve_server.address, **curve_keys.stranger_options)
    try:
        message = refusal(client, "refused this client's CURVE key")
    finally:
        client.close()
    assert "--curve-clients" in message and "stranger.key" in message

    out = kvstrata("status", "--address", curve_server.address, "--curve-server-key", curve_keys.server_public,
                   "--curve-client-key", curve_keys.stranger_secret, "--timeout", "1")
    assert out.returncode == 1 and "CURVE" in out.stderr, out.stderr


def test_a_client_without_curve_is_refused(curve_server):
    event = handshake_end(curve_server.address, None)
    assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH

    client = Client(curve_server.address)
    try:
        message = refusal(client, "does not accept clients without CURVE")
    finally:
        client.close()
    assert "curve_server_key" in message and "--curve-client-key" in message

    out = kvstrata("status", "--address", curve_server.address, "--timeout", "1")
    assert out.returncode == 1 and "CURVE" in out.stderr, out.stderr


def test_plain_tcp_is_refused_at_bind(curve_keys, tmp_path):
    port = free_port()
    line = serve_refused(f"tcp://127.0.0.1:{port}")
    for flag in ("without CURVE keys", "--curve-secret-key", "--curve-clients", "kvstrata keygen"):
        assert flag in line, line
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))  # nothing listens there
    assert "without CURVE keys" in serve_refused(f"tcp://0.0.0.0:{port}", "--allow-remote")
    # half the keys is no keys
    assert "needs both" in serve_refused(f"tcp://127.0.0.1:{port}", "--curve-secret-key", curve_keys.server_secret)
    with pytest.raises(ValueError, match="without CURVE keys"):
        Server(f"tcp://127.0.0.1:{port}")


def test_key_files_others_may_read_or_write_are_refused(curve_keys, tmp_path):
    exposed = tmp_path / "server.key_secret"
    shutil.copy(curve_keys.server_secret, exposed)
    exposed.chmod(0o640)
    with pytest.raises(CurveKeyError, match=f"{exposed} has mode 0640: group or other users may read it"):
        ServerCurve.load(str(exposed), curve_keys.clients)
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        ServerCurve.load(curve_keys.server_public, curve_keys.clients)  # the public half

    open_dir = tmp_path / "clients"
    shutil.copytree(curve_keys.clients, open_dir)
    open_dir.chmod(0o775)
    with pytest.raises(CurveKeyError, match="may add keys to it"):
        ServerCurve.load(curve_keys.server_secret, str(open_dir))
    open_dir.chmod(0o700)
    for key in open_dir.iterdir():
        key.unlink()
    with pytest.raises(CurveKeyError, match="holds no NAME.key"):
        ServerCurve.load(curve_keys.server_secret, str(open_dir))

    line = serve_refused(f"tcp://127.0.0.1:{free_port()}", "--curve-secret-key", str(exposed),
                         "--curve-clients", curve_keys.clients)
    assert "mode 0640" in line


def test_keygen_writes_private_key_files_and_never_overwrites(tmp_path, capsys):
    from kvstrata.cli import main

    directory = tmp_path / "keys"
    assert main(["keygen", str(directory)]) == 0
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret"):
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    public, secret = zmq.auth.load_certificate(str(directory / "client.key_secret"))
    assert secret is not None and zmq.auth.load_certificate(str(directory / "client.key"))[0] == public
    before = (directory / "server.key_secret").read_bytes()
    assert main(["keygen", str(directory), "server"]) == 2
    assert "exists; refusing to overwrite" in capsys.readouterr().err
    assert (directory / "server.key_secret").read_bytes() == before
    with pytest.raises(CurveKeyError, match="exists"):
        write_keypair(str(directory), "client")


def test_serve_settings_in_a_config_file(tmp_path, curve_keys):
    from kvstrata.server_config import read_config

    config = tmp_path / "kvstrata.toml"
    config.write_text(f'max_message_bytes = "1M"\ncurve_secret_key = "{curve_keys.server_secret}"\n'
                      f'curve_clients = "{curve_keys.clients}"\n')
    assert read_config(str(config)) == {"max_message_bytes": 1 << 20, "curve_secret_key": curve_keys.server_secret,
                                        "curve_clients": curve_keys.clients}


def test_engine_settings_carry_the_client_keys(curve_keys):
    from kvstrata.core.engine.settings import RuntimeSettings

    settings = RuntimeSettings.from_mapping({"server_address": "tcp://127.0.0.1:1", **curve_keys.client_options})
    assert settings.client_options() == curve_keys.client_options
    with pytest.raises(ValueError, match="needs both"):
        RuntimeSettings.from_mapping({"server_address": "tcp://127.0.0.1:1",
                                      "curve_server_key": curve_keys.server_public})


# --- the largest frame --------------------------------------------------------------------------------


def _peak_rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_the_default_frame_limit_holds_a_long_prompt():
    """A RETRIEVE of a 1M-token prompt with one block per token (the worst case for block ids) is a
    quarter of the default limit at most, which so holds a 4M-token prompt."""
    import numpy as np

    from kvstrata.core.store.keys import CacheKey
    from kvstrata.core.wire.client import build_retrieve_payload

    n = 1 << 20
    key = CacheKey.for_tokens("r", np.arange(n, dtype=np.int64) + 100_000, model="m")
    frame = codec.encode_request(1 << 40, RequestType.RETRIEVE,
                                 build_retrieve_payload(key, 0, [list(range(3 * n, 4 * n))]))
    assert 4 * len(frame) < DEFAULT_MAX_MESSAGE_BYTES <= codec.MAX_FRAME_BYTES


def test_an_oversize_frame_is_dropped_unread_and_the_server_keeps_serving():
    limit = 16 << 20
    with ServerProcess(l1_bytes=8 << 20, extra_args=["--max-message-bytes", str(limit)]) as srv:
        bystander = CacheClient(srv.address, timeout=20)
        ctx = zmq.Context()
        sender = ctx.socket(zmq.DEALER)
        sender.setsockopt(zmq.LINGER, 0)
        monitor = sender.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            assert bystander.ping() == "pong"
            sender.connect(srv.address)
            peak = _peak_rss_kib(srv.proc.pid)

            sender.send(codec.encode_request(7, RequestType.PING, [bytes(4 * limit)]))
            assert monitor.poll(HANG_MS), "the server never dropped the sender"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            grown = _peak_rss_kib(srv.proc.pid) - peak
            assert grown < (limit >> 10) // 2, f"peak RSS grew {grown} KiB for a {4 * limit}-byte frame"
            assert bystander.ping() == "pong"  # everyone else is still served

            # the control: a frame under the limit is read whole (and answered), and the peak shows it
            peak = _peak_rss_kib(srv.proc.pid)
            sender.send(codec.encode_request(8, RequestType.PING, [bytes(limit * 3 // 4)]))
            assert sender.poll(HANG_MS), "no reply to a frame under the limit"
            reply = codec.decode_reply(sender.recv())
            assert (reply.request_id, reply.ok, reply.value["code"]) == (8, False, "bad_request")
            assert _peak_rss_kib(srv.proc.pid) - peak >= (limit * 3 // 4) >> 10
            assert bystander.ping() == "pong"
        finally:
            bystander.close()
            monitor.close(0)
            sender.close(0)
            ctx.term()


# --- another user of the host --------------------------------------------------------------------------


OTHER_USER_PRELUDE = """
import site, sys
site.addsitedir(sys.argv[1])
"""


@pytest.fixture(scope="module")
def as_nobody():
    """Run Python code as uid 65534 with this environment's packages; skips where that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    site_packages = os.path.dirname(os.path.dirname(zmq.__file__))
    # this interpreter may live where uid 65534 cannot go (a pyenv under /root): the system's of the same version
    candidates = [os.path.realpath(sys.executable), f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"]

    def run(python: str, code: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, "-c", OTHER_USER_PRELUDE + code, site_packages, *args], user=NOBODY,
                              group=NOBODY, extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    def works(python: str) -> bool:
        try:
            probe = run(python, "import os, zmq, kvstrata.core.wire.transport; print(os.getuid())")
        except PermissionError:
            return False
        return probe.returncode == 0 and probe.stdout.split() == [str(NOBODY)]

    copy = None
    try:
        for attempt in range(2):
            for python in candidates:
                if os.path.exists(python) and works(python):
                    yield lambda code, *args, python=python: run(python, code, *args)
                    return
            if attempt == 0:
                # this environment's packages may lie where uid 65534 cannot read them (tox makes .tox/ 0700): a
                # copy of what the client needs, readable by everyone, stands in for them (removed at the end)
                copy = tempfile.mkdtemp(prefix="kvstrata-other-user-")
                site_packages = readable_copy_of_client_packages(copy)
        pytest.skip("no Python that uid 65534 can run with this environment's pyzmq")
    finally:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)


def readable_copy_of_client_packages(directory) -> str:
    """Copy the packages a kvstrata client imports (kvstrata, pyzmq with its bundled libzmq, msgpack, numpy)
    into ``directory`` and open it to every user; returns its path."""
    import msgpack
    import numpy

    import kvstrata

    target = str(directory)
    for module in (zmq, msgpack, numpy, kvstrata):
        package = os.path.dirname(module.__file__)
        shutil.copytree(package, os.path.join(target, os.path.basename(package)), dirs_exist_ok=True)
        for libs in (package + ".libs", os.path.join(os.path.dirname(package), f"py{os.path.basename(package)}.libs")):
            if os.path.isdir(libs):  # auditwheel's bundled shared libraries beside the package
                shutil.copytree(libs, os.path.join(target, os.path.basename(libs)), dirs_exist_ok=True)
    for root, dirs, files in os.walk(target):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644 if not name.endswith(".so") and ".so." not in name else 0o755)
    return target


def test_another_user_cannot_reach_an_ipc_server(server, as_nobody):
    """``server`` (tests/conftest.py): a real `kvstrata serve` on ipc:// in a 0700 directory of this user."""
    path = server.address[len("ipc://"):]
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    out = as_nobody("""
import os, socket
path = sys.argv[2]
try:
    os.stat(path)
    print("stat: ok")
except PermissionError:
    print("stat: EACCES")
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(path)
    print("connect: ok")
except PermissionError:
    print("connect: EACCES")
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.wire.transport import Client, RequestTimeout
c = Client("ipc://" + path, default_timeout=1)
try:
    print("zmq:", c.call(RequestType.PING))
except RequestTimeout:
    print("zmq: no reply")
c.close()
""", path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["stat: EACCES", "connect: EACCES", "zmq: no reply"], out.stdout
    client = CacheClient(server.address, timeout=20)  # the owner still connects
    try:
        assert client.ping() == "pong"
    finally:
        client.close()


def test_another_user_without_the_key_is_refused_over_tcp(curve_server, curve_keys, as_nobody):
    server_public = zmq.auth.load_certificate(curve_keys.server_public)[0].decode()  # public: no secret in it
    out = as_nobody("""
import zmq
from zmq.utils.monitor import recv_monitor_message
from kvstrata.core.wire.curve import HANDSHAKE_EVENTS
address, server_public, client_secret = sys.argv[2:5]
try:
    open(client_secret).read()
    print("key: read")
except PermissionError:
    print("key: EACCES")
for label, curve in (("own key", True), ("no curve", False)):
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    if curve:
        d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
        d.curve_serverkey = server_public.encode()
    m = d.get_monitor_socket(HANDSHAKE_EVENTS)
    d.connect(address)
    while True:  # until it ends for good (a dropped connection, NO_DETAIL, is tried again)
        assert m.poll(60000), "no handshake ended"
        event = zmq.Event(recv_monitor_message(m)["event"])
        if event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            break
    print(f"{label}: {event.name}")
    m.close(0)
    d.close(0)
    ctx.term()
""", curve_server.address, server_public, curve_keys.client_secret)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["key: EACCES", "own key: HANDSHAKE_FAILED_AUTH",
                                         "no curve: HANDSHAKE_FAILED_PROTOCOL"], out.stdout
