"""Default pipelines per device: which rewrites a QSA decode or verify step gets where it runs.

``default_pipeline(device)`` returns the passes (``PassManager(...)`` runs them;
``format_pipeline`` prints them):

- every device: ``qsa-pool-cache`` (the indexer scores against a resident f32
  block-key cache instead of re-pooling the whole raw key cache; the graph
  gains a state pair the caller carries) and ``qsa-gather`` (attention over
  the selected cells only, every row of a verify step in one gather; a
  prefill cut into tiles of the device's ``prefill_tile`` rows, one gather each);
- ``"cpu"``: ``block-sparse``, a causal ``sdpa`` (with a sliding window or
  chunks) of more than 512 rows computed per 512-row tile over only the keys
  the tile's rows see, where the tiles skip at least a sixth of the score plane
  (benchmarks/block_sparse.py, MLX and JAX CPU: 4.8x at a window of 1024 over 8K
  rows, 2.0x causal at 8K; the other devices are not measured, so not given it);
- ``"metal"``: ``head-chunk``, so GQA calls fit MLX's fused vector kernel;
- every device: ``decompose-sdpa{device=...}``, which keeps the fused
  ``sdpa`` where the device has a fused kernel for the call and folds GQA
  into f32 matmuls where it does not (CPU decode and gathered attention);
  its remarks say which strategy each call got and why;
- then ``dce``, ``narrow-inputs`` (the padded mask shrinks to the rows read), ``dce``.

``keep_signature=True`` leaves out the two passes that change the program's
signature, ``qsa-pool-cache`` (adds a state input and output) and
``narrow-inputs`` (retypes inputs), and the ``dce`` after them: the pipeline
of a drop-in wrapper (:func:`attnpass.backends.specialize.wrapper_pipeline`),
whose program is called with the function's own arguments. ``"tpu"`` keeps
every attention call fused, as ``"gpu"`` does.
"""

from __future__ import annotations

from .analysis.devices import DEVICES
from .infra.base import Pass
from .rewrites.block_sparse import BlockSparse
from .rewrites.dce import DeadCodeElimination
from .rewrites.decompose_sdpa import DecomposeSDPA
from .rewrites.head_chunk import HeadChunkSDPA
from .rewrites.narrow_inputs import NarrowInputs
from .rewrites.qsa_gather import QSAGather
from .rewrites.qsa_pool_cache import QSAPoolCache


def default_pipeline(device: str, *, keep_signature: bool = False, target: str | None = None) -> list[Pass]:
    """The passes for ``device`` (``"cpu"``, ``"metal"``, ``"gpu"`` or ``"tpu"``), in order.

    ``keep_signature``: only passes that keep the graph's inputs and outputs as they are (dead inputs may go).
    ``target`` (``"mlx"``, ``"jax"`` or None): the backend the graph is lowered to, named in decompose-sdpa's remarks.
    """
    if device not in DEVICES:
        raise ValueError(f"default_pipeline: device must be one of {', '.join(DEVICES)}, got {device!r}")
    own: list[Pass] = {"cpu": [BlockSparse(device=device)], "metal": [HeadChunkSDPA()]}.get(device, [])
    gather = QSAGather(prefill_tile=DEVICES[device].prefill_tile)
    if keep_signature:
        return [gather, *own, DecomposeSDPA(device=device, target=target), DeadCodeElimination()]
    return [
        QSAPoolCache(),
        gather,
        *own,
        DecomposeSDPA(device=device, target=target),
        DeadCodeElimination(),
        NarrowInputs(),
        DeadCodeElimination(),
    ]


__all__ = ["default_pipeline"]
