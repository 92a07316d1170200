"""A pytest plugin for running mlx-lm's own tests with every model they build optimized (``examples/peer_suite.py``).

Loaded with ``-p peer_optimize_plugin`` (``examples/`` on ``PYTHONPATH``) in each run of the peer suite:

- ``--attnpass-stand-in DIR``: the hub models the tests download (:data:`STAND_IN_REPOS`) resolve to ``DIR``, a
  local tiny model, at mlx-lm's download seam (``mlx_lm.utils.snapshot_download``, which ``load``, ``convert``,
  ``load_tokenizer`` and ``hf_repo_to_path`` call) and at ``transformers.AutoTokenizer.from_pretrained``;
- ``--attnpass-optimize``: every ``Model`` of ``mlx_lm.models`` is optimized as its outermost ``__init__`` returns
  (``optimize(model, min_keys=0)``: every attention call routed), a model whose attention optimize cannot route
  counted by its module and left plain; ``--attnpass-check`` adds ``check=True`` (each routed call's output also
  checked against mlx-lm's helper, which evaluates both: arrays a test leaves lazy are computed) for the models of
  at most :data:`CHECK_MAX_PARAMETERS` parameters (mlx-lm's tests build some in full size, 20 billion parameters,
  and never evaluate them), the larger ones counted and optimized without it;
- ``--attnpass-counts FILE``: the session's seconds and, optimized, the models optimized, the attention calls routed
  and declined by code, and per test the models it optimized and the calls it routed, as JSON at its end.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import importlib
import json
import pkgutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from mlx.utils import tree_flatten

from attnpass.backends.mlx import OptimizedModel, optimize
from attnpass.backends.mlx.optimized import NoClientError

STAND_IN_REPOS = ("mlx-community/Qwen1.5-0.5B-Chat-4bit",)  # the hub model mlx-lm 0.32.2's tests load
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
        self.unroutable: collections.Counter[str] = collections.Counter()
        self.tests: dict[str, dict[str, int]] = {}
        self._live: list[tuple[weakref.ref[OptimizedModel], Seen]] = []
        self._freed = Seen()
        self._lock = threading.Lock()
        gc.callbacks.append(self._collecting)

    def optimize(self, model: Any) -> None:
        """``optimize(model, min_keys=0, check=...)``; a model none of whose modules calls a client function (mlx-lm's
        helper) is counted by its module and left plain."""
        check = self.check and sum(p.size for _, p in tree_flatten(model.parameters())) <= CHECK_MAX_PARAMETERS
        try:
            found = optimize(model, min_keys=0, check=check)
        except NoClientError:
            with self._lock:
                self.unroutable[type(model).__module__] += 1
            return
        with self._lock:
            self.optimized += 1
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


def _optimize_every_model(patch: pytest.MonkeyPatch, tally: Tally) -> None:
    """Wrap the ``__init__`` of each ``Model`` class defined in a module of ``mlx_lm.models``."""
    import mlx.nn as nn
    import mlx_lm.models

    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        name = f"mlx_lm.models.{info.name}"
        try:
            module = importlib.import_module(name)
        except (ImportError, SystemExit):  # a family needing a package this venv lacks (olmo exits): left as it is
            continue
        cls = getattr(module, "Model", None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == name and "__init__" in vars(cls):
            patch.setattr(cls, "__init__", _optimizing(cls.__init__, tally))


def _serve_stand_in(patch: pytest.MonkeyPatch, path: Path) -> None:
    """Resolve :data:`STAND_IN_REPOS` to ``path`` where mlx-lm downloads and where the tests load tokenizers."""
    import mlx_lm.utils
    import transformers

    download = mlx_lm.utils.snapshot_download
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def snapshot_download(repo_id: str, *args: Any, **kwargs: Any) -> str:
        return str(path) if repo_id in STAND_IN_REPOS else download(repo_id, *args, **kwargs)

    def tokenizer(name: Any, *args: Any, **kwargs: Any) -> Any:
        return from_pretrained(str(path) if name in STAND_IN_REPOS else name, *args, **kwargs)

    patch.setattr(mlx_lm.utils, "snapshot_download", snapshot_download)
    patch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(tokenizer))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnpass", "attnpass peer suite (examples/peer_suite.py)")
    group.addoption("--attnpass-stand-in", metavar="DIR", help=f"a local model for {', '.join(STAND_IN_REPOS)}")
    group.addoption("--attnpass-optimize", action="store_true", help="optimize every mlx-lm model the tests build")
    group.addoption("--attnpass-check", action="store_true", help="optimize with check=True (the shadow mode)")
    group.addoption("--attnpass-counts", metavar="FILE", help="write the optimize counts to FILE as JSON")


_TALLY = pytest.StashKey[Tally]()
_START = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_START] = time.monotonic()
    patch = pytest.MonkeyPatch()
    config.add_cleanup(patch.undo)
    stand_in = config.getoption("--attnpass-stand-in")
    if stand_in:
        _serve_stand_in(patch, Path(stand_in).resolve())
    if config.getoption("--attnpass-optimize"):
        config.stash[_TALLY] = Tally(config.getoption("--attnpass-check"))
        _optimize_every_model(patch, config.stash[_TALLY])


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
