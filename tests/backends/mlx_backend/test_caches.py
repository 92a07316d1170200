"""The cache adapters' registry (backends/mlx/caches/): every cache class mlx-lm and mlx-vlm ship has exactly one
adapter (routed, or declined by its row), no adapter names a class that does not exist, and a cache without one
is declined by code, never routed."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from tests.util import lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm", "mlx_vlm")

mx = lazy_import("mlx.core")


def shipped_caches() -> set[tuple[str, str]]:
    """(module, class) of every cache class mlx-lm's and mlx-vlm's model packages (and mlx-vlm's TurboQuant
    module) define: a ``_BaseCache``
    subclass, or a class with ``update_and_fetch`` or ``update_indexer`` of its own (mlx-vlm's batched QSA cache
    is no ``_BaseCache``)."""
    import mlx_lm.models
    import mlx_vlm.models

    bases = tuple(importlib.import_module(f"{p}.models.cache")._BaseCache for p in ("mlx_lm", "mlx_vlm"))
    found = set()
    packages = (mlx_lm.models, mlx_vlm.models)
    names = [i.name for p in packages for i in pkgutil.walk_packages(p.__path__, p.__name__ + ".")]
    for module_name in [*names, "mlx_vlm.turboquant"]:  # TurboQuant's caches live beside the models
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit):  # a model module whose optional dependency is missing (olmo exits)
            continue
        for name, cls in inspect.getmembers(module, inspect.isclass):
            own = cls.__module__ == module.__name__ and not name.startswith("_")
            cache = issubclass(cls, bases) or {"update_and_fetch", "update_indexer"} & set(vars(cls))
            if own and cache and "Cache" in name:
                found.add((cls.__module__, cls.__qualname__))
    return found


def test_every_cache_class_mlx_lm_and_mlx_vlm_ship_has_an_adapter():
    from attnpass.backends.mlx.caches import ADAPTERS

    missing = sorted(shipped_caches() - set(ADAPTERS))
    assert not missing, (
        f"a new cache class: add an adapter module in backends/mlx/caches/ (or a row in declined.py): {missing}"
    )


def test_every_adapter_names_a_class_that_exists():
    from attnpass.backends.mlx.caches import ADAPTERS
    from attnpass.backends.mlx.calls import classes

    for module, name in ADAPTERS:
        if module != "builtins":
            assert classes(module, name)[0].__qualname__ == name


def test_a_class_has_one_adapter_and_a_second_registration_is_refused():
    from attnpass.backends.mlx.caches import register
    from attnpass.backends.mlx.caches.kv import KVCache

    with pytest.raises(ValueError, match="mlx_lm.models.cache.KVCache already has an adapter: KVCache"):
        register(type("Again", (KVCache,), {}))


def test_a_cache_without_an_adapter_or_of_another_client_is_declined_by_code():
    """A subclass of a routed cache class is not that class: it has no adapter and its calls run mlx-lm's helper;
    a QSA cache reaching mlx-lm's helper is not one its adapter routes."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache
    from mlx_vlm.models.qwen4_exp.language import QSAKVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    class MyCache(KVCache):
        pass

    q = mx.random.normal((1, 4, 1, 16))
    k, v = mx.random.normal((2, 1, 2, 1, 16))
    with optimize(Probe(), min_keys=0) as opt:
        for cache in (MyCache(), QSAKVCache()):
            probe = opt.model
            out = probe(q, k, v, cache)
            keys, values, _ = probe.received
            expected = base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=SCALE, mask=None)
            assert mx.array_equal(out, expected)
    assert opt.routed == 0 and opt.declined == {"unknown_cache": 1, "cache_unrouted": 1}
    assert "MyCache has no cache adapter" in opt.declines["unknown_cache"].message
    assert opt.declines["unknown_cache"].data == {"cache": "MyCache"}
