"""CURVE keys for the TCP transport: ZMQ's own authentication and encryption (CurveZMQ, via ``zmq.auth``).

Anything that can reach a TCP port can connect to it, other users of the host included, so a server on
``tcp://`` always runs CURVE (:func:`~kvstrata.core.wire.transport.check_bind_address` refuses to bind one
without it). The server holds a key pair (its secret key file, ``kvstrata serve --curve-secret-key``) and a
directory of the public keys of the clients it accepts (``--curve-clients``); a client holds the server's public
key and its own key pair. A client whose public key is not in that directory, or one that does not speak CURVE,
completes no handshake: libzmq drops it before a single frame of it is read, so it gets no reply (its requests
time out, with a message that says why: :func:`handshake_hint`).

The files are ``zmq.auth``'s certificate files: ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair.
:func:`write_keypair` (``kvstrata keygen``) writes them, mode 0600. A secret key file that group or other users
may read is refused, and so is an authorized-keys directory (or key in it) that they may write: whoever can
write there can let themselves in. The server reads the authorized keys when it starts; restart it to take
in a new client.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kvstrata"
"""The ZAP domain a CURVE server's socket names; its authenticator checks keys for this domain only."""

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""What a TCP client's socket monitor reports: how its last handshake ended (see :func:`handshake_hint`)."""

FLAGS_HINT = ("kvstrata serve --curve-secret-key FILE (the server's NAME.key_secret) --curve-clients DIR "
              "(a directory of the authorized clients' NAME.key files); make key pairs with `kvstrata keygen DIR`")


class CurveKeyError(ValueError):
    """A key file or the authorized-keys directory cannot be used (the message names it and says why)."""


def write_keypair(directory: str, name: str) -> tuple[str, str]:
    """Write a new key pair as ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (both keys), mode 0600.

    Refuses to overwrite either file. The directory is created (mode 0700) if missing. The files are created
    0600 before a key is written into them, so the secret key is never readable by anyone else, whatever the
    umask.
    """
    if not name or os.sep in name or name.startswith("."):
        raise CurveKeyError(f"bad key name {name!r}: a plain file name, without '/' or a leading '.'")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    base = os.path.join(directory, name)
    paths = (f"{base}.key", f"{base}.key_secret")
    created = []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                raise CurveKeyError(f"{path} exists; refusing to overwrite a key (remove it first)") from None
            created.append(path)
            os.fchmod(fd, 0o600)
            os.close(fd)
        public, secret = zmq.auth.create_certificates(directory, name)  # writes into the files made above
    except BaseException:
        for path in created:
            os.unlink(path)
        raise
    assert (public, secret) == paths
    return public, secret


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _load(path: str, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    for key in (public, secret):
        if key is not None:
            try:
                if len(key) != 40 or len(z85.decode(key)) != 32:
                    raise ValueError
            except ValueError:
                raise CurveKeyError(f"{what} {path} holds a malformed key (expected 40 Z85 characters)") from None
    return public, secret


def load_public_key(path: str, what: str = "public key file") -> bytes:
    """The Z85 public key in ``path`` (a ``NAME.key`` or ``NAME.key_secret`` file)."""
    return _load(path, what)[0]


def load_secret_key(path: str, what: str = "secret key file") -> tuple[bytes, bytes]:
    """(public, secret) from a ``NAME.key_secret`` file that no group or other user may read."""
    try:
        mode = _mode(path)
    except OSError as exc:
        raise CurveKeyError(f"cannot read {what} {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise CurveKeyError(f"{what} {path} has mode {mode:04o}: group or other users may read it; refusing to use "
                            f"it (chmod 600 {path})")
    public, secret = _load(path, what)
    if secret is None:
        raise CurveKeyError(f"{what} {path} holds no secret key: give the NAME.key_secret file, not NAME.key")
    return public, secret


def check_authorized_keys(directory: str) -> int:
    """How many client public keys (``*.key``) ``directory`` holds; refuses one others may write, or none."""
    if not os.path.isdir(directory):
        raise CurveKeyError(f"authorized client keys: {directory} is not a directory")
    mode = _mode(directory)
    if mode & 0o022:
        raise CurveKeyError(f"authorized client keys: {directory} has mode {mode:04o}: group or other users may "
                            f"add keys to it; refusing to use it (chmod go-w {directory})")
    count = 0
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".key"):
            continue
        path = os.path.join(directory, entry)
        key_mode = _mode(path)
        if key_mode & 0o022:
            raise CurveKeyError(f"authorized client key {path} has mode {key_mode:04o}: group or other users may "
                                f"change it; refusing to use it (chmod go-w {path})")
        load_public_key(path, "authorized client key")
        count += 1
    if count == 0:
        raise CurveKeyError(f"authorized client keys: {directory} holds no NAME.key file, so no client could "
                            "connect (copy each client's public NAME.key there)")
    return count


@dataclass(frozen=True, repr=False)
class ServerCurve:
    """A CURVE server's keys: its own pair and the directory of authorized client keys."""

    public: bytes
    secret: bytes
    clients: str
    authorized: int

    @classmethod
    def load(cls, secret_key_file: str | None, clients_dir: str | None) -> "ServerCurve":
        if not secret_key_file or not clients_dir:
            raise CurveKeyError("CURVE needs both the server's secret key file (--curve-secret-key) and the "
                                "directory of authorized client keys (--curve-clients)")
        public, secret = load_secret_key(secret_key_file, "server secret key file")
        return cls(public, secret, clients_dir, check_authorized_keys(clients_dir))

    def __repr__(self) -> str:  # never the secret
        return f"ServerCurve(public={self.public.decode()!r}, clients={self.clients!r})"

    def apply(self, sock: zmq.Socket, ctx: zmq.Context):
        """Make ``sock`` (not bound yet) a CURVE server whose clients an authenticator on ``ctx`` checks
        against the authorized keys; returns that authenticator (stop it before terminating ``ctx``).

        The authenticator runs before the socket binds, and the socket insists on it (ZAP_ENFORCE_DOMAIN):
        without one, libzmq would accept any client key.
        """
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.auth"))
        auth.start()
        try:
            auth.configure_curve(domain=ZAP_DOMAIN, location=self.clients)
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_server = True
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.zap_domain = ZAP_DOMAIN.encode()
        except BaseException:
            auth.stop()
            raise
        log.info("CURVE: server key %s, %d authorized client key(s) from %s", self.public.decode(), self.authorized,
                 self.clients)
        return auth


@dataclass(frozen=True, repr=False)
class ClientCurve:
    """A CURVE client's keys: the server's public key and the client's own pair."""

    server_public: bytes
    public: bytes
    secret: bytes
    server_key_file: str
    client_key_file: str

    @classmethod
    def load(cls, server_key_file: str | None, client_key_file: str | None) -> "ClientCurve":
        if not server_key_file or not client_key_file:
            raise CurveKeyError("CURVE needs both the server's public key file (curve_server_key) and this "
                                "client's secret key file (curve_client_key)")
        server_public = load_public_key(server_key_file, "server public key file")
        public, secret = load_secret_key(client_key_file, "client secret key file")
        return cls(server_public, public, secret, server_key_file, client_key_file)

    def __repr__(self) -> str:  # never the secret
        return f"ClientCurve(server={self.server_public.decode()!r}, public={self.public.decode()!r})"

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not connected yet) a CURVE client of the server whose public key this holds."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def handshake_hint(event: int | None, value: int, curve: ClientCurve | None, address: str) -> str:
    """Why a TCP client got no reply, from how its last handshake ended (None: no handshake ended yet)."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return ""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        pub = curve.client_key_file.removesuffix("_secret") if curve is not None else "its NAME.key"
        return (f": the server refused this client's CURVE key (ZAP status {value}); authorize it by copying its "
                f"public key ({pub}) into the server's --curve-clients directory and restarting the server")
    if curve is None:
        seen = "the server does not accept clients without CURVE" if event is not None else \
            "no CURVE handshake completed"
        return (f": {seen}; a kvstrata server on tcp:// answers CURVE-authenticated clients only: give the "
                "server's public key file and this client's secret key file (curve_server_key and curve_client_key; "
                "kvstrata status --curve-server-key FILE --curve-client-key FILE)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return f": the server at {address} does not speak CURVE"
    if event is not None:
        return (f": the CURVE handshake failed; is {curve.server_key_file} the public key of the server at "
                f"{address}?")
    return ": no CURVE handshake completed (is the server running?)"
