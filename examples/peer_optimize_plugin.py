"""A pytest plugin for running a peer library's own tests with every model they build optimized (``examples/peer_suite.py``).

Loaded with ``-p peer_optimize_plugin`` (``examples/`` on ``PYTHONPATH``) in each run of a peer suite, for the peer
``--attnpass-peer NAME`` of ``examples/peers.py``'s table (mlx-lm or mlx-vlm):

- ``--attnpass-stand-in DIR``: the hub models the tests download (the record's ``stand_in.repos``) resolve to
  ``DIR``, a local tiny model, at the peer's download seams (``stand_in.serve``: mlx-lm's
  ``mlx_lm.utils.snapshot_download`` and ``transformers.AutoTokenizer.from_pretrained``);
- ``--attnpass-optimize``: every model class of the peer (the record's ``classes`` defined in each module or
  package of ``models``: mlx-lm's ``Model``; mlx-vlm's ``Model`` and ``LanguageModel``) is optimized as the
  outermost model ``__init__`` running returns (``optimize(model, min_keys=0)``: every attention call routed; a
  VLM's ``Model`` built around its ``LanguageModel`` is optimized once, as the whole, which routes its language
  model's calls too), a model whose attention optimize cannot route counted by its module and left plain;
  ``--attnpass-check`` adds ``check=True`` (each routed call's output also checked against the peer's helper, which
  evaluates both: arrays a test leaves lazy are computed) for the models of at most :data:`CHECK_MAX_PARAMETERS`
  parameters (the peers' tests build some in full size, up to 20 billion parameters, and never evaluate them), the
  larger ones counted and optimized without it;
- ``--attnpass-counts FILE``: the session's seconds and, optimized, the models optimized (by class name), the
  attention calls routed and declined by code, and per test the models it optimized and the calls it routed, as
  JSON at its end.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import importlib
import itertools
import json
import pkgutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx.utils import tree_flatten
from peers import PEERS, Peer  # examples/, this plugin's folder

from attnpass.backends.mlx import OptimizedModel, optimize
from attnpass.backends.mlx.optimized import NoClientError

CHECK_MAX_PARAMETERS = 2**28  # 1 GiB of float32 weights


class Tally:
    """The models optimized in this session and their counts, per test too.

    Models are held weakly (a test suite builds hundreds): each one's counts are read at every garbage collection's
    start, before the collection that frees it (an optimized model is in a reference cycle with its class, so only
    the collector frees it), and at each test's end.
    """

    def __init__(self, check: bool) -> None:
        self.check = check
        self.optimized = 0
        self.unchecked = 0
        self.classes: collections.Counter[str] = collections.Counter()  # the models optimized, by class name
        self.unroutable: collections.Counter[str] = collections.Counter()
        self.tests: dict[str, dict[str, int]] = {}
        self._live: list[tuple[weakref.ref[OptimizedModel], Seen]] = []
        self._freed = Seen()
        self._lock = threading.Lock()
        gc.callbacks.append(self._collecting)

    def optimize(self, model: Any) -> None:
        """``optimize(model, min_keys=0, check=...)``; a model none of whose modules calls a client function (the
        peer's helper) is counted by its module and left plain."""
        check = self.check and sum(p.size for _, p in tree_flatten(model.parameters())) <= CHECK_MAX_PARAMETERS
        try:
            found = optimize(model, min_keys=0, check=check)
        except NoClientError:
            with self._lock:
                self.unroutable[type(model).__module__] += 1
            return
        with self._lock:
            self.optimized += 1
            self.classes[type(model).__name__] += 1
            self.unchecked += int(self.check and not check)
            self._live.append((weakref.ref(found), Seen()))

    def _collecting(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: read the live models' counts as a collection starts (skipped while one is read)."""
        if phase == "start" and self._lock.acquire(blocking=False):
            try:
                self._read()
            finally:
                self._lock.release()

    def _read(self) -> None:
        """Each live model's counts as they are now; a freed model's last counts added to ``_freed``."""
        live = []
        for ref, seen in self._live:
            model = ref()
            if model is None:
                self._freed.add(seen)
            else:
                seen.routed, seen.declined = model.routed, collections.Counter(model.declined)
                live.append((ref, seen))
        self._live = live

    def totals(self) -> Seen:
        """The calls routed and declined so far, by every model this session optimized."""
        with self._lock:
            self._read()
            found = Seen()
            found.add(self._freed)
            for _, seen in self._live:
                found.add(seen)
            return found

    def report(self) -> dict[str, Any]:
        """What ``--attnpass-counts`` writes."""
        gc.callbacks.remove(self._collecting)
        found = self.totals()
        return {
            "check": self.check,
            "optimized": self.optimized,
            "classes": dict(self.classes.most_common()),
            "unchecked": self.unchecked,
            "routed": found.routed,
            "declined": dict(found.declined.most_common()),
            "unroutable": dict(self.unroutable.most_common()),
            "tests": self.tests,
        }


@dataclasses.dataclass
class Seen:
    """Attention calls routed and declined (by code)."""

    routed: int = 0
    declined: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, other: Seen) -> None:
        self.routed += other.routed
        self.declined.update(other.declined)


_depth = threading.local()  # the Model.__init__ calls running in this thread (an outer model builds inner ones)


def _optimizing(init: Callable[..., None], tally: Tally) -> Callable[..., None]:
    """``init``, then, for the outermost model under construction, ``tally.optimize(self)``."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _depth.n = depth
        if depth == 0:
            tally.optimize(self)

    return __init__


def _optimize_every_model(patch: pytest.MonkeyPatch, tally: Tally, peer: Peer) -> None:
    """Wrap the ``__init__`` of each class named in ``peer.classes`` that a module or package of ``peer.models``
    defines (in itself or a submodule) and that it or its submodules ``peer.submodules`` name (mlx-vlm's text
    families keep their ``LanguageModel`` in ``language``): each class once (a family may import another's)."""
    from mlx import nn

    package = importlib.import_module(peer.models)
    wrapped: set[type] = set()
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{peer.models}.{info.name}"
        found = []
        for module in (name, *(f"{name}.{sub}" for sub in peer.submodules if info.ispkg)):
            try:
                found.append(importlib.import_module(module))
            except (ImportError, SystemExit):  # a family needing a package this venv lacks (olmo exits): left alone
                continue
        for module, attribute in itertools.product(found, peer.classes):
            cls = getattr(module, attribute, None)
            if (
                isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in wrapped and "__init__" in vars(cls)
                and (cls.__module__ == name or cls.__module__.startswith(f"{name}."))
            ):  # fmt: skip
                wrapped.add(cls)
                patch.setattr(cls, "__init__", _optimizing(cls.__init__, tally))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnpass", "attnpass peer suite (examples/peer_suite.py)")
    group.addoption("--attnpass-peer", metavar="NAME", choices=sorted(PEERS), help="whose tests these are")
    group.addoption("--attnpass-stand-in", metavar="DIR", help="a local model for the hub models the tests load")
    group.addoption("--attnpass-optimize", action="store_true", help="optimize every model the tests build")
    group.addoption("--attnpass-check", action="store_true", help="optimize with check=True (the shadow mode)")
    group.addoption("--attnpass-counts", metavar="FILE", help="write the optimize counts to FILE as JSON")


_TALLY = pytest.StashKey[Tally]()
_START = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_START] = time.monotonic()
    patch = pytest.MonkeyPatch()
    config.add_cleanup(patch.undo)
    name, stand_in = config.getoption("--attnpass-peer"), config.getoption("--attnpass-stand-in")
    if name is None:
        if stand_in or config.getoption("--attnpass-optimize"):
            raise pytest.UsageError("--attnpass-stand-in and --attnpass-optimize need --attnpass-peer NAME")
        return
    peer = PEERS[name]
    if stand_in:
        if peer.stand_in is None:
            raise pytest.UsageError(f"--attnpass-stand-in: {name}'s tests load no hub model")
        peer.stand_in.serve(patch, Path(stand_in).resolve())
    if config.getoption("--attnpass-optimize"):
        config.stash[_TALLY] = Tally(config.getoption("--attnpass-check"))
        _optimize_every_model(patch, config.stash[_TALLY], peer)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    tally = item.config.stash.get(_TALLY, None)
    if tally is None:
        return (yield)
    models, routed = tally.optimized, tally.totals().routed
    try:
        return (yield)
    finally:
        tally.tests[item.nodeid] = {"optimized": tally.optimized - models, "routed": tally.totals().routed - routed}


def pytest_sessionfinish(session: pytest.Session) -> None:
    counts = session.config.getoption("--attnpass-counts")
    if counts:
        tally = session.config.stash.get(_TALLY, None)
        report = {"seconds": time.monotonic() - session.config.stash[_START], **(tally.report() if tally else {})}
        Path(counts).write_text(json.dumps(report, indent=1) + "\n")
