"""Failure location of MLX imports: the replay fallback (``mlx_source.locate``) costs one export, whatever the depth."""

from __future__ import annotations

import pytest

from attnpass.ir import ModelImportError, from_mlx
from tests.util import requires


def _chain(blocks: int, hold_argument=None):
    import mlx.core as mx

    weights = [mx.random.normal((16, 16)) * 0.1 for _ in range(blocks)]
    mx.eval(weights)

    def fn(x):
        held = None if hold_argument is None else hold_argument * 1.0  # noqa: F841 (the export refuses it)
        for w in weights:
            x = x + mx.tanh(x @ w)
        return mx.sort(x, axis=-1)

    return fn


@requires("mlx.core")
@pytest.mark.parametrize("path", ["recorded", "replay"])
def test_a_deep_failing_import_is_located_with_a_bounded_number_of_exports(monkeypatch, path):
    """32 residual blocks then an unsupported sort: the error names the sort's line. The recorded path
    exports once; the replay (reached when the function holds an array made from the example argument itself,
    which the export refuses as an extra output) adds one export, where it used to export once per new array."""
    import mlx.core as mx

    import attnpass.ir.frontends.import_mlx as import_mlx

    x = mx.random.normal((2, 16))
    mx.eval(x)
    fn = _chain(32, x if path == "replay" else None)
    exports, replays = [], []
    real_export, real_locate = mx.export_function, import_mlx.locate
    monkeypatch.setattr(mx, "export_function", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    monkeypatch.setattr(import_mlx, "locate", lambda *a, **k: replays.append(1) or real_locate(*a, **k))
    with pytest.raises(ModelImportError, match=r"unsupported MLX primitive Sort") as err:
        from_mlx(fn, x)
    sort_line = fn.__code__.co_firstlineno + 4
    assert str(err.value).endswith(f"at {__file__}:{sort_line} in fn")
    assert len(replays) == (1 if path == "replay" else 0)
    assert len(exports) == (3 if path == "replay" else 1)
