"""The server's settings, each declared once.

Every setting of ``kvstrata serve`` is a dataclass field here, made by :func:`setting`: its default, its kind
(what values it takes, :class:`Kind`) and its help. ``kvstrata serve`` derives its flags (``--l1-size``), the
config file its keys (``l1_size``) and both their checks from these declarations (:func:`declared`), and
constructing a :class:`ServerConfig` or :class:`ConnectionLimits` checks every value the same way; so a setting
is added, bounded and documented in one place, and an error always names the setting's key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvstrata.core.wire.transport import DEFAULT_MAX_MESSAGE_BYTES

SETTING = "kvstrata_setting"
"""The field metadata key holding a setting's :class:`_Spec`."""
GROUP = "kvstrata_settings_group"
"""The field metadata key of a field holding a nested dataclass of settings (its keys are the group's own)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '1G', '1GiB', '1048576' -> bytes (binary multiples); ValueError for anything else."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 4G or a byte count)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


class Kind:
    """What values a setting takes. :meth:`check` takes a typed value (a config file's, a constructor's) and
    returns it normalised (a size's text as bytes); :meth:`parse` takes a command line's text. Both raise
    ValueError whose message is :attr:`expects` (what a good value is)."""

    expects = "a value"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    def check(self, value: Any) -> Any:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        return self.check(text)

    def _bad(self) -> ValueError:
        return ValueError(self.expects)


class Size(Kind):
    """Bytes: an integer, or text such as ``512M`` or ``4G`` (binary multiples); at least one byte."""

    expects = "a size (512M, 4G or a byte count)"
    metavar = "SIZE"

    def check(self, value: Any) -> int:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError:
                raise self._bad() from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad()
        return value


class Integer(Kind):
    """An integer in ``[low, high]`` (``high`` None: unbounded)."""

    def __init__(self, low: int, high: int | None = None, *, metavar: str = "N") -> None:
        self.low, self.high, self.metavar = low, high, metavar
        self.expects = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.low or \
                (self.high is not None and value > self.high):
            raise self._bad()
        return value

    def parse(self, text: str) -> int:
        try:
            return self.check(int(text))
        except ValueError:
            raise self._bad() from None


class Number(Kind):
    """A real number of at least ``low`` (more than it where ``above``), at most ``high`` where given."""

    def __init__(self, low: float = 0.0, *, above: bool = False, high: float | None = None,
                 metavar: str = "X") -> None:
        self.low, self.above, self.high, self.metavar = low, above, high, metavar
        if high is not None:
            self.expects = f"a number in {'(' if above else '['}{low:g}, {high:g}]"
        else:
            self.expects = f"a number {'>' if above else '>='} {low:g}"

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad()
        if not (value > self.low if self.above else value >= self.low) or \
                (self.high is not None and not value <= self.high):
            raise self._bad()
        return float(value)

    def parse(self, text: str) -> float:
        try:
            return self.check(float(text))
        except ValueError:
            raise self._bad() from None


class Boolean(Kind):
    """True or false; on a command line a switch (``--name`` where the default is false, ``--no-name`` where it
    is true)."""

    expects = "true or false"

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self._bad()
        return value


class Choice(Kind):
    """One of a few words."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices
        self.expects = f"one of {', '.join(choices)}"

    def check(self, value: Any) -> str:
        if value not in self.choices:
            raise self._bad()
        return value


class Text(Kind):
    """A non-empty string (an address, a path)."""

    expects = "a non-empty string"

    def __init__(self, metavar: str | None = None) -> None:
        self.metavar = metavar

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self._bad()
        return value


@dataclass(frozen=True)
class _Spec:
    kind: Kind
    help: str
    key: str | None
    default_text: str | None
    benchmark: bool


def setting(default: Any, kind: Kind, help: str, *, key: str | None = None, default_text: str | None = None,
            benchmark: bool = False) -> Any:
    """A settings dataclass field: ``default`` (None: unset, allowed only as the default), what values it takes,
    its help. ``key``: its flag's and config key's name where it differs from the field's; ``default_text``: the
    default as the help shows it; ``benchmark``: a parameter of A/B measurements, not a deployer's setting (its
    help says so)."""
    return field(default=default, metadata={SETTING: _Spec(kind, help, key, default_text, benchmark)})


def group(cls: type) -> Any:
    """A field holding a nested dataclass of settings, whose keys are flattened into the parent's."""
    return field(default_factory=cls, metadata={GROUP: cls})


@dataclass(frozen=True)
class Declared:
    """One setting as :func:`declared` finds it."""

    key: str
    """Its config key; its flag is ``--`` and the key with dashes."""
    path: tuple[str, ...]
    """Attribute names from the root dataclass (``("limits", "lease_seconds")``)."""
    kind: Kind
    help: str
    default: Any
    default_text: str
    benchmark: bool

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def declared(cls: type) -> list[Declared]:
    """Every setting of the settings dataclass ``cls``, nested groups flattened, in declaration order."""
    out: list[Declared] = []

    def walk(c: type, path: tuple[str, ...]) -> None:
        for f in dataclasses.fields(c):
            if GROUP in f.metadata:
                walk(f.metadata[GROUP], path + (f.name,))
            elif SETTING in f.metadata:
                spec: _Spec = f.metadata[SETTING]
                text = spec.default_text if spec.default_text is not None else str(f.default)
                out.append(Declared(spec.key or f.name, path + (f.name,), spec.kind, spec.help, f.default, text,
                                    spec.benchmark))

    walk(cls, ())
    keys = [d.key for d in out]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{cls.__name__} declares a setting key twice: {keys}")
    return out


def check_value(item: Declared, value: Any) -> Any:
    """``value`` for the setting, normalised; ValueError naming the key and what it expects."""
    if value is None and item.default is None:
        return None
    try:
        return item.kind.check(value)
    except ValueError as exc:
        raise ValueError(f"{item.key} = {value!r} is not {exc}") from None


def check_fields(obj: Any) -> None:
    """Check and normalise every setting declared directly on the dataclass instance ``obj`` (its groups check
    themselves when constructed)."""
    for f in dataclasses.fields(obj):
        if SETTING in f.metadata:
            spec: _Spec = f.metadata[SETTING]
            item = Declared(spec.key or f.name, (f.name,), spec.kind, spec.help, f.default, "", spec.benchmark)
            object.__setattr__(obj, f.name, check_value(item, getattr(obj, f.name)))
        elif GROUP in f.metadata and not isinstance(getattr(obj, f.name), f.metadata[GROUP]):
            raise ValueError(f"{f.name} must be a {f.metadata[GROUP].__name__}, got {getattr(obj, f.name)!r}")


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of the settings dataclass ``cls`` from ``values`` by key (what is not there keeps its
    default); an unknown key or a bad value raises ValueError naming it."""
    items = {d.key: d for d in declared(cls)}
    unknown = sorted(set(values) - set(items))
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}; known: {', '.join(items)}")

    def make(c: type, path: tuple[str, ...]) -> Any:
        kwargs = {}
        for f in dataclasses.fields(c):
            if GROUP in f.metadata:
                kwargs[f.name] = make(f.metadata[GROUP], path + (f.name,))
            elif SETTING in f.metadata:
                key = f.metadata[SETTING].key or f.name
                if key in values:
                    kwargs[f.name] = check_value(items[key], values[key])
        return c(**kwargs)

    return make(cls, ())


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold at once (see :mod:`kvstrata.core.server.connections`)."""

    lease_seconds: float = setting(30.0, Number(0, above=True, metavar="SECONDS"), "a connection silent this long "
                                   "(no request, no heartbeat) loses everything it holds (its client sends a "
                                   "heartbeat every second)")
    max_instances_per_connection: int = setting(64, Integer(1), "caches one connection may register at once (an "
                                                "engine process registers one per rank it serves); also bounds "
                                                "the arrival boards it may name")
    max_reserved_fraction: float = setting(0.5, Number(0, above=True, high=1), "share of the L1 pool one "
                                           "connection's uncommitted store reservations may hold")
    max_lock_owners_per_connection: int = setting(4096, Integer(1), "requests whose lookup locks one connection "
                                                  "may hold at once")
    max_prompt_tokens: int = setting(1 << 20, Integer(1), "tokens one key (a prompt) may name")
    max_request_id_bytes: int = setting(1024, Integer(1), "bytes of a key's request id (its lock owner)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class ServerConfig:
    """What a :class:`~kvstrata.core.server.cache_server.CacheServer` runs with; every field is a ``kvstrata
    serve`` setting (``l1_bytes`` under the key ``l1_size``), checked when constructed and by :meth:`check`."""

    address: str | None = setting(None, Text("ADDRESS"), "ipc://PATH (its directory must be private to this user) or "
                                  "tcp://127.0.0.1:PORT (needs curve_secret_key and curve_clients) to bind",
                                  default_text="an IPC socket in a private per-user directory")
    """None: ``kvstrata serve`` binds :func:`~kvstrata.core.wire.transport.default_address`."""
    l1_bytes: int = setting(1 << 30, Size(), "bytes of host memory for cached KV, e.g. 512M, 8G", key="l1_size",
                            default_text="1G")
    chunk_size: int = setting(256, Integer(1, metavar="TOKENS"), "tokens per stored chunk; engines' hits are "
                              "multiples of this")
    page_hash_tokens: int = setting(0, Integer(0, metavar="TOKENS"), "the page of the hash chain that names "
                                    "chunks: SGLang engines share chunks with vLLM and TensorRT-LLM engines when "
                                    "their --page-size is this (0: the chunk size)", default_text="the chunk size")
    transfer_threads: int = setting(4, Integer(1), "threads running STORE/RETRIEVE copies, so PING and LOOKUP "
                                    "never wait on them")
    busy_poll_ms: float = setting(25.0, Number(0, metavar="MS"), "with a GPU cache registered, keep polling the "
                                  "socket without sleeping this long after each request, so the next one is taken at "
                                  "once "
                                  "(about one core while it lasts; 0 = off)", default_text="25")
    allow_remote: bool = setting(False, Boolean(), "allow binding a non-loopback TCP address (CURVE-authenticated "
                                 "like any TCP), and serve metrics on every interface", default_text="off")
    curve_secret_key: str | None = setting(None, Text("FILE"), "the server's CURVE secret key file "
                                           "(NAME.key_secret, mode 0600, from `kvstrata keygen`); with "
                                           "curve_clients, only clients whose public key is there are served "
                                           "(required for a tcp:// address)", default_text="none")
    curve_clients: str | None = setting(None, Text("DIR"), "a directory of the public key files (NAME.key) of "
                                        "the clients allowed to connect; any other client completes no handshake "
                                        "(read at start)", default_text="none")
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, Size(), "the largest frame taken: a client "
                                     "sending a longer one is disconnected before it is read (the default holds "
                                     "a STORE or RETRIEVE of a prompt of millions of tokens)",
                                     default_text=f"{DEFAULT_MAX_MESSAGE_BYTES >> 20}M")
    metrics_port: int | None = setting(None, Integer(0, 65535, metavar="PORT"), "serve Prometheus metrics on "
                                       "http://127.0.0.1:PORT/metrics (0: any free port; every interface with "
                                       "allow_remote)", default_text="off")
    l2: str | None = setting(None, Text("ADDRESS"), "a shared tier the servers of every host write their chunks "
                             "to and read hits past their own pool from: valkey://HOST:PORT[,HOST:PORT...] "
                             "(valkeys:// with TLS; needs pip install kvstrata[l2])")
    l2_password_file: str | None = setting(None, Text("FILE"), "the shared tier's password, in a file only this "
                                           "user may read (mode 0600)")
    l2_timeout: float = setting(2.0, Number(0, above=True, metavar="SECONDS"), "how long one read or write of the shared "
                                "tier may take before it counts as a miss (a node down, a failover)")
    l2_write_queue: int = setting(256 << 20, Size(), "bytes of committed chunks that may wait to be written to the "
                                  "shared tier; chunks beyond them are skipped and counted, never waited for")
    limits: ConnectionLimits = group(ConnectionLimits)
    """Per-connection bounds and the lease (see :mod:`kvstrata.core.server.connections`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first setting holding a bad value (the config is mutable)."""
        check_fields(self)
        if self.page_hash_tokens and self.chunk_size % self.page_hash_tokens:
            raise ValueError(f"page_hash_tokens: {self.page_hash_tokens} does not divide the chunk size "
                             f"{self.chunk_size}: a chunk must be whole pages of the hash chain")

    @property
    def hash_page(self) -> int:
        """Tokens per page of the hash chain that names chunks (:mod:`kvstrata.core.store.keys`)."""
        return self.page_hash_tokens or self.chunk_size
