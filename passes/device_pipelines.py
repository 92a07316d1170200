"""Default pipelines per device: which rewrites an attention step (QSA, MLA, DSA) gets where it runs.

``default_pipeline(device)`` returns the passes, in order (``PassManager(...)`` runs them):

- every device: ``mla-absorb`` (MLA attention in the latent space below the device's crossover,
  ``mla_crossover_factor``), ``qsa-pool-cache`` (a resident f32 block-key cache instead of re-pooling the
  raw key cache; the graph gains a state pair), ``qsa-gather`` (attention over the selected cells only; a
  prefill cut into tiles of the device's ``prefill_tile`` rows) and ``dsa-gather`` (each row over its
  indexed tokens only, in tiles of ``dsa_tile_bytes``), all read from :data:`.analysis.devices.DEVICES`;
- the device's ``own_passes`` from the same row: ``block-sparse`` on ``"cpu"`` (causal calls tiled over the keys
  each tile sees, the device's ``block_q`` rows per tile), ``head-chunk`` on ``"metal"`` (GQA calls fit MLX's
  fused vector kernel);
- every device: ``decompose-sdpa{device=...}`` (fused where the device has a kernel for the call, GQA
  folded into f32 matmuls where not), then ``dce``, ``narrow-inputs``, ``dce``.

``keep_signature=True`` leaves out the passes that change the program's signature (``qsa-pool-cache``,
``narrow-inputs``) and the ``dce`` after them: the pipeline of a drop-in wrapper
(:func:`attnpass.backends.specialize.wrapper_pipeline`), called with the function's own arguments.
"""

from __future__ import annotations

from .analysis.devices import DEVICES
from .infra.base import Pass
from .infra.pipeline_text import parse_pipeline
from .rewrites.dce import DeadCodeElimination
from .rewrites.decompose_sdpa import DecomposeSDPA
from .rewrites.dsa_gather import DSAGather
from .rewrites.mla_absorb import MLAAbsorb
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
    facts = DEVICES[device]
    own = parse_pipeline(list(facts.own_passes))
    absorb = MLAAbsorb(crossover_factor=facts.mla_crossover_factor)
    gathers = [QSAGather(prefill_tile=facts.prefill_tile), DSAGather(tile_bytes=facts.dsa_tile_bytes)]
    if keep_signature:
        return [absorb, *gathers, *own, DecomposeSDPA(device=device, target=target), DeadCodeElimination()]
    return [
        absorb,
        QSAPoolCache(),
        *gathers,
        *own,
        DecomposeSDPA(device=device, target=target),
        DeadCodeElimination(),
        NarrowInputs(),
        DeadCodeElimination(),
    ]


__all__ = ["default_pipeline"]
