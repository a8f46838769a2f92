"""CURVE keys for a test's tcp:// server: a server pair, an authorized client and a stranger (tests, benchmarks)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from kvstrata.core.wire.curve import write_keypair


@dataclass(frozen=True)
class CurveKeys:
    directory: str
    server_public: str
    server_secret: str
    clients: str
    """The authorized-keys directory: holds client.key only."""
    client_public: str
    client_secret: str
    stranger_public: str
    stranger_secret: str
    """A valid key pair the server was never told about."""

    @classmethod
    def make(cls, directory: str) -> "CurveKeys":
        """Write the three pairs under ``directory`` (``kvstrata keygen``'s files) and authorize the client."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        server = write_keypair(directory, "server")
        client = write_keypair(directory, "client")
        stranger = write_keypair(directory, "stranger")
        clients = os.path.join(directory, "clients")
        os.mkdir(clients, 0o700)
        shutil.copy(client[0], clients)
        return cls(directory, *server, clients, *client, *stranger)

    @property
    def serve_args(self) -> list[str]:
        """``kvstrata serve`` flags serving the authorized client only."""
        return ["--curve-secret-key", self.server_secret, "--curve-clients", self.clients]

    @property
    def server_options(self) -> dict[str, str]:
        """``ServerConfig`` / ``Server`` keywords serving the authorized client only."""
        return {"curve_secret_key": self.server_secret, "curve_clients": self.clients}

    @property
    def client_options(self) -> dict[str, str]:
        """``CacheClient`` / ``Client`` keywords of the authorized client."""
        return {"curve_server_key": self.server_public, "curve_client_key": self.client_secret}

    @property
    def stranger_options(self) -> dict[str, str]:
        """``CacheClient`` / ``Client`` keywords of a client with a key the server does not know."""
        return {"curve_server_key": self.server_public, "curve_client_key": self.stranger_secret}
