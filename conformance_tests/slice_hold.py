"""Hold a transfer at a chosen slice until the test opens it (test-only).

A test that asserts an ordering ("released before its transfer completed",
"the engine waited on a layer still in flight", "the reply came after the
board said complete") must not depend on which thread wins a race: on a loaded
2-core machine a small copy finishes before the engine's next poll. A hold
makes the in-flight state last as long as the test needs: the copying side
stops after a chosen number of slices (a slice observer, see
:data:`kvstrata.core.transfer.planner.SliceObserver`) and goes on only when the test opens it, typically once
it has seen the release.

A hold is a private directory that the test and the copying process share, so
the same hold works in this process (engine placement), in a ``kvstrata serve``
child (server placement) and in an engine's spawned processes:

* ``rules.json``: what to hold, written by the test (``SliceHold.hold``);
* ``held-<request>``: written by the copying side when it starts holding (the engine runtimes name a
  copy by its key's lock owner, ``<request>@i<instance>``; the test's side finds it by the request id);
* ``open-<request or rule prefix>``: written by the test (``SliceHold.open``).

Ways to install it, none reachable from production code:

* a transfer queue or server the test builds itself: pass ``slice_observer=hold.on_slice``;
* whatever this process builds from now on, however deep inside an engine:
  ``with SliceHold(directory).installed(): ...`` (see :func:`add_slice_observer`);
* a server child: ``HeldServerProcess(slice_hold=hold)``, which runs
  ``python -m kvstrata.conformance_tests.slice_hold DIRECTORY serve ARGS...``;
* an engine's processes: ``KVSTRATA_TEST_SLICE_HOLD=DIRECTORY`` plus a
  ``sitecustomize`` on the engine's ``PYTHONPATH`` that calls
  :func:`install_from_environment` (the vLLM tests ship one).

A hold never hangs a run: after ``timeout`` seconds it logs an error and lets
the transfer go on (the assertion that needed the hold then fails on its own).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from kvstrata.core.engine.requests import request_of_lock_owner
from kvstrata.core.transfer.planner import SliceObserver
from kvstrata.server_process import ServerProcess

log = logging.getLogger("kvstrata.testing.slice_hold")

ENVIRONMENT_VARIABLE = "KVSTRATA_TEST_SLICE_HOLD"
UNTIL_OPENED = "opened"
UNTIL_ENGINE_WAITED = "engine_waited"
"""Also opens once the engine side's JSON-lines record (``record_path``) shows a per-layer wait made while
this request was in flight: the vLLM tests use it, where no test code runs inside the engine's step."""


@dataclass(frozen=True)
class HoldRule:
    prefix: str
    """Holds every transfer whose request id starts with this ("" = every transfer)."""
    after_slices: int = 1
    """Hold once this many slices are published (0: before the first; chunk-major has one slice)."""
    until: str = UNTIL_OPENED
    record_path: str | None = None
    timeout: float = 120.0


def _file_name(request_id: str) -> str:
    return request_id.replace("/", "_").replace("\0", "_")


_observers: list[SliceObserver] = []
"""The observers :func:`add_slice_observer` gave this process, in the order added."""


def _tell_observers(request_id: str, slices: int) -> None:
    for observer in list(_observers):
        observer(request_id, slices)


_tell_observers.active = lambda: bool(_observers)  # type: ignore[attr-defined]
"""With no observer added, a queue may plan loads on the engine's thread as it does without one."""


def inject_slice_observers() -> None:
    """Make every :class:`TransferQueue` and :class:`CacheServer` built from now on in this process take
    :func:`_tell_observers` as its ``slice_observer`` where its builder passed none: the test's way into the
    ones an engine builds deep inside itself. Their constructors are wrapped once and stay wrapped (with no
    observer added, the call does nothing)."""
    from kvstrata.core.engine.transfer_queue import TransferQueue
    from kvstrata.core.server.cache_server import CacheServer

    for cls in (TransferQueue, CacheServer):
        if getattr(cls.__init__, "_kvstrata_injects_observers", False):
            continue
        original = cls.__init__

        def init(self: Any, *args: Any, _original: Callable[..., None] = original,
                 slice_observer: SliceObserver | None = None, **kwargs: Any) -> None:
            _original(self, *args, slice_observer=slice_observer or _tell_observers, **kwargs)

        init._kvstrata_injects_observers = True  # type: ignore[attr-defined]
        init.__doc__ = original.__doc__
        cls.__init__ = init  # type: ignore[method-assign]


def add_slice_observer(observer: SliceObserver) -> None:
    """Tell ``observer`` of the slices of every transfer queue and server this process builds from now on
    (test-only; the order added is the order called)."""
    inject_slice_observers()
    if observer in _observers:
        raise RuntimeError(f"slice observer {observer!r} is already added in this process")
    _observers.append(observer)


def remove_slice_observer(observer: SliceObserver) -> None:
    if observer in _observers:
        _observers.remove(observer)


class SliceHold:
    """The test's handle on a hold directory, and the slice observer that honours it."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        if directory is None:
            directory = tempfile.mkdtemp(prefix="kvstrata-hold-")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._rules: list[HoldRule] = []
        self._rules_stamp: tuple[int, int] | None = None
        self._held_once: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    # --- the test's side ---------------------------------------------------------------------

    def hold(self, prefix: str, after_slices: int = 1, *, until: str = UNTIL_OPENED, record_path: str | None = None,
             timeout: float = 120.0) -> HoldRule:
        """Hold transfers of requests starting with ``prefix`` once ``after_slices`` slices are published."""
        if until not in (UNTIL_OPENED, UNTIL_ENGINE_WAITED):
            raise ValueError(f"until must be {UNTIL_OPENED!r} or {UNTIL_ENGINE_WAITED!r}, got {until!r}")
        if until == UNTIL_ENGINE_WAITED and not record_path:
            raise ValueError(f"until={UNTIL_ENGINE_WAITED!r} needs the engine side's record_path")
        rule = HoldRule(prefix, after_slices, until, record_path, timeout)
        rules = [r for r in self._read_rules() if r.prefix != prefix] + [rule]
        tmp = self.directory / f".rules-{os.getpid()}-{threading.get_ident()}"
        tmp.write_text(json.dumps([asdict(r) for r in rules]))
        os.replace(tmp, self.directory / "rules.json")
        return rule

    def open(self, name: str) -> None:
        """Let the held transfer of request ``name`` go on (or every transfer of the rule with that prefix), and
        the one named by a lock owner of that request."""
        (self.directory / f"open-{_file_name(name)}").touch()
        held = self._held_file(name)
        if held is not None:
            (self.directory / f"open-{held.name[len('held-'):]}").touch()

    def open_all(self) -> None:
        """Let every transfer any rule holds, or will hold, go on (tear-down)."""
        for rule in self._read_rules():
            self.open(rule.prefix)

    def _held_file(self, name: str) -> Path | None:
        """The marker of the held transfer ``name``: that exact name, or a lock owner made from it
        (``name@i<instance>``, how the engine runtimes name their copies); None while nothing is held."""
        exact = self.directory / f"held-{_file_name(name)}"
        if exact.exists():
            return exact
        # name@i<instance>, or name@a<attempt>@i<instance> (a request the engine looked up again)
        for path in self.directory.glob(f"held-{glob.escape(_file_name(name))}@*"):
            if request_of_lock_owner(path.name[len("held-"):]) == _file_name(name):
                return path
        return None

    def is_held(self, request_id: str) -> bool:
        """Whether the transfer named ``request_id`` (or a lock owner of that request) is held."""
        return self._held_file(request_id) is not None

    def wait_held(self, request_id: str, timeout: float = 60.0) -> None:
        """Block until the copying side holds ``request_id`` (bounded: only catches a hang)."""
        deadline = time.monotonic() + timeout
        while not self.is_held(request_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer {request_id} was not held within {timeout:.0f}s")
            time.sleep(0.001)

    # --- the copying side --------------------------------------------------------------------

    def install(self) -> None:
        """Hold the transfers of every queue and server this process builds from now on (:func:`add_slice_observer`)."""
        add_slice_observer(self.on_slice)

    def uninstall(self) -> None:
        remove_slice_observer(self.on_slice)

    @contextlib.contextmanager
    def installed(self) -> Iterator["SliceHold"]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def on_slice(self, request_id: str, slices: int) -> None:
        """A :data:`~kvstrata.core.transfer.planner.SliceObserver`: blocks while a rule holds ``request_id`` at
        ``slices``."""
        for rule in self._read_rules():
            if request_id.startswith(rule.prefix) and slices == rule.after_slices:
                with self._lock:
                    if (rule.prefix, request_id) in self._held_once:
                        continue
                    self._held_once.add((rule.prefix, request_id))
                self._hold(rule, request_id, slices)

    def _hold(self, rule: HoldRule, request_id: str, slices: int) -> None:
        name = _file_name(request_id)
        marker = self.directory / f"held-{name}"
        marker.write_text(str(slices))
        log.info("holding transfer %s after %d slice(s) (test-only slice hold %s)", request_id, slices,
                 self.directory)
        opened = (self.directory / f"open-{name}", self.directory / f"open-{_file_name(rule.prefix)}")
        deadline = time.monotonic() + rule.timeout
        while not any(p.exists() for p in opened):
            if rule.until == UNTIL_ENGINE_WAITED and _engine_waited(rule.record_path, request_id):
                break
            if time.monotonic() > deadline:
                log.error("slice hold on %s was never opened within %.0fs; letting it go on", request_id,
                          rule.timeout)
                break
            time.sleep(0.001)
        log.info("transfer %s goes on after the test-only slice hold", request_id)

    def _read_rules(self) -> list[HoldRule]:
        path = self.directory / "rules.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._rules_stamp:
            self._rules = [HoldRule(**r) for r in json.loads(path.read_text())]
            self._rules_stamp = stamp
        return self._rules


def _engine_waited(record_path: str | None, request_id: str) -> bool:
    """True once the record shows a ``wait_for_layer_load`` with ``request_id`` among the transfers in flight.
    The copy is named by its key's lock owner, the record by the engine's request id: either matches."""
    request_id = request_of_lock_owner(request_id)
    try:
        with open(record_path) as f:
            for line in f:
                if '"wait_for_layer_load"' in line and request_id in line:
                    event = json.loads(line)
                    if event.get("event") == "wait_for_layer_load" and request_id in event.get("in_flight", ()):
                        return True
    except (OSError, ValueError):
        return False
    return False


def install_from_environment() -> SliceHold | None:
    """Install the hold named by ``KVSTRATA_TEST_SLICE_HOLD`` in this process, if it names one."""
    directory = os.environ.get(ENVIRONMENT_VARIABLE)
    if not directory:
        return None
    hold = SliceHold(directory)
    hold.install()
    return hold


class HeldServerProcess(ServerProcess):
    """A ``kvstrata serve`` child with ``slice_hold`` installed in it (none: a plain server)."""

    def __init__(self, *, slice_hold: SliceHold | None = None, **kwargs: Any) -> None:
        if slice_hold is not None:
            kwargs["entry"] = ("kvstrata.conformance_tests.slice_hold", str(slice_hold.directory))
        super().__init__(**kwargs)
        self.slice_hold = slice_hold


def main(argv: list[str]) -> int:
    """``python -m kvstrata.conformance_tests.slice_hold DIRECTORY serve ARGS...``: a server with the hold installed."""
    if len(argv) < 2:
        print("usage: python -m kvstrata.conformance_tests.slice_hold DIRECTORY serve ARGS...", file=sys.stderr)
        return 2
    SliceHold(argv[0]).install()
    from kvstrata.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
