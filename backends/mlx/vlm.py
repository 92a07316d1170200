"""mlx-vlm's Qwen4-Exp QSA attention under ``optimize``: the model's own selection, attended by a gather.

**Routing** (the mechanism of :mod:`.lm`, for another client function).
``mlx_vlm.models.qwen4_exp`` calls ``dispatch_qsa_attention(queries, keys,
values, selected_blocks, query_ends, cache=..., causal=..., mask=...)`` from
its ``language`` module, both in ``Qwen4ExpAttention`` (prefill, verify) and in
its batch-invariant forward (decode, MTP verify). ``optimize`` replaces that
name with :func:`route` and, while an optimized model runs, records what
``Qwen4ExpQSAIndexer.select_from_projected`` returned per cache (the
selection) besides what ``KVCache.update_and_fetch`` returned (mlx-vlm's own
``KVCache``, which ``QSAKVCache`` extends).

**The program** (:func:`qsa_attention`, traced with :mod:`attnpass.ir.ops`):
``sdpa(q, k, v, mask=qsa_mask(selection, query_ends - 1))`` over the cache's
whole buffer (signatures per buffer length, as in :mod:`.lm`), rewritten by
the device pipeline with ``qsa-gather{selection_input=selection}``: attention
over each row's ``K*ratio + ratio - 1`` cells instead of the buffer.

**What the router proves before it substitutes** (else it declines by name
and the model's own dispatch runs):

- the cache is exactly a ``QSAKVCache`` or ``QSAQuantizedKVCache`` (a
  ``BatchQSAKVCache`` takes the same proofs over its inner ``BatchKVCache``:
  :mod:`.batched`); ``keys``/``values`` *are* the arrays (for a quantized
  cache, the (words, scales, biases) tuples) its last ``update_and_fetch`` of
  this model call returned, and it still holds that buffer and offset (so
  ``keys == cache.keys[..., :offset, :]``, array by array);
- ``selected_blocks`` and ``query_ends`` *are* the arrays the indexer's last
  selection for this cache returned, made without left padding, with the
  indexer's block size, over as many indexer keys as the cache holds; so
  ``query_ends = offset_before + s + 1`` and each row's valid ids are distinct
  (``argpartition`` indices, the invisible ones set to ``-1``): what
  ``selection_input`` promises;
- ``causal`` with no mask: the model would attend ``build_mask(selection)``,
  which is ``qsa_mask(selection, query_ends - 1)`` (selected blocks' cells,
  the tail, causal) whenever the indexer's scores are not NaN: with ``n_complete
  <= K`` the model attends all causal cells and its top-k holds every visible
  block, since visible blocks score finite and the rest ``-inf``;
- the model's own plan is not its indexed sparse kernel (Metal, f16/bf16):
  where it has one, it keeps the call.

The indexer itself (scoring, top-k, the pooled block keys it caches in
``index_block_keys``, M-RoPE positions) stays the model's code: the selection
is the model's by construction. attnpass's ``qsa-pool-cache`` is therefore not
used: the model already pools one block per ``ratio`` steps, and rebuilds its
pooled keys from the raw ones after a trim.

**Quantized caches.** On a ``QSAQuantizedKVCache`` (mlx-vlm's uniform KV
quantization: K/V as MLX's packed words, scales and biases, the indexer's keys
and pooled block keys float) the model's dispatch has no sparse plan for the
packed K/V (its plan is ``DENSE_UNSUPPORTED``): it builds the selection's mask
over the whole cache and runs mlx-vlm's quantized helper, two
``quantized_matmul`` over every cached row. The program is then
:func:`qsa_quantized_attention`, the same masked form with ``quantized_sdpa``
(that helper's op) over the buffer's six arrays (the words viewed as int32),
one signature per buffer length, group size and bits; ``qsa-gather`` gathers
each row's ``W`` cells of the six arrays and attends them with one
``quantized_sdpa``: only the selected cells' packed rows are read, nothing is
dequantized. Exact up to reduction order (the softmax and ``P @ V`` run over
the ``W`` cells instead of the buffer): greedy tokens equal the plain model's,
logits not bit for bit (``tests/backends/test_dropin_mlx_vlm_qsa.py``).

**Indexer buffers.** The one part of the cache's own code replaced is where
``QSAKVCache.update_indexer`` (and ``QSAQuantizedKVCache``'s, the same code) keeps the raw indexer keys and positions: the
model concatenates the whole history every step (a fresh allocation growing
with depth); under an optimized call :func:`buffered_indexer` appends in place
into buffers kept beside the cache and gives the cache views of them, the same
values, and falls back to the model's update (then rebuilds) whenever the
cache no longer holds those views (trimmed, loaded, a plain call between).

**Prefill** (more than 8 query rows) takes the same proofs and the same
program; the default pipeline's ``qsa-gather`` cuts its rows into tiles of
``PREFILL_TILES[device]`` rows, one gather and one sdpa per tile. Where the
model has its indexed sparse kernel (Metal, f16/bf16) that kernel keeps the
call (declined by name, above); elsewhere (CPU, or f32 on Metal) the model's
dispatch would attend the whole buffer masked, so the tiles take it.
``mlx_vlm.generate`` prefills in chunks of ``prefill_step_size`` tokens: each
chunk is such a call over the cache so far (measured: docs/qsa.md, "Prefill").

Calls the pipeline leaves masked (a cache shallower than ``2 * W``, or a
prefill under a pipeline whose ``qsa-gather`` has ``prefill_tile=0``) are
declined with qsa-gather's reason and run the model's dispatch, so a routed
call is always a gather.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnpass.ir import DType, ImportedGraph, TensorSpec, ops, trace
from attnpass.ir.core.types import native_dtype_name
from attnpass.passes import Pass, QSAGather

from ..specialize import CompiledFunction, Specialization, Traceable, as_passes, wrapper_pipeline
from .compiled import MLXFrontend
from .router import ACTIVE, QWEN4_EXP, classes, fetch_reason

NAME = "dispatch_qsa_attention"
SELECTION = "selection"
MASKED = "qsa-gather kept the masked form"
NOT_SELECTED = (
    "selected_blocks/query_ends are not the arrays this cache's indexer selection returned in this model call"
)
MODEL_MASK = "the model combined a mask with the selection (left padding or an array mask)"
MODEL_KERNEL = "the model's indexed sparse kernel takes this call (Metal, float16/bfloat16)"
CACHES = "only QSAKVCache and QSAQuantizedKVCache have a buffer and a selection to prove"


def qsa_attention(
    queries: Any, keys: Any, values: Any, selection: Any, query_ends: Any, scale: float, ratio: int
) -> Any:
    """The masked form of one QSA call: ``sdpa`` over the buffer, masked by the selection's cells and the tail."""
    keep = ops.qsa_mask(selection, query_ends - 1, ratio=ratio, kv_len=keys.shape[2])
    return ops.sdpa(queries, keys, values, mask=keep, scale=scale)


def qsa_quantized_attention(
    queries: Any, kq: Any, ks: Any, kb: Any, vq: Any, vs: Any, vb: Any, selection: Any, query_ends: Any,
    scale: float, ratio: int, group_size: int, bits: int,
) -> Any:  # fmt: skip
    """The masked form of one QSA call on a ``QSAQuantizedKVCache``: mlx-vlm's quantized attention
    (``quantized_sdpa``) over the buffer's (words, scales, biases) K and V, masked as :func:`qsa_attention`.

    Queries of another float dtype than the scales (float32 queries over a bfloat16 cache: mlx-vlm's
    Qwen4-Exp in bfloat16, whose Gated-DeltaNet layers hand on float32) are computed as MLX's
    ``quantized_matmul`` computes them: queries, scales and biases cast to their promoted float dtype (the casts
    MLX's own export shows; widening is exact)."""
    wide = queries.dtype if queries.dtype is ks.dtype else DType.float32  # MLX: float16 with bfloat16 -> float32
    queries, ks, kb, vs, vb = (x if x.dtype is wide else ops.cast(x, wide) for x in (queries, ks, kb, vs, vb))
    keep = ops.qsa_mask(selection, query_ends - 1, ratio=ratio, kv_len=kq.shape[2])
    options = {"scale": scale, "group_size": group_size, "bits": bits}
    return ops.quantized_sdpa(queries, (kq, ks, kb), (vq, vs, vb), mask=keep, **options)


class OpsFrontend(MLXFrontend):
    """MLX signatures of a function written with :mod:`attnpass.ir.ops`: traced, not exported."""

    def import_graph(self, t: Traceable) -> ImportedGraph:
        specs = [TensorSpec(tuple(a.shape), native_dtype_name(a.dtype)) for a in t.arrays]
        return ImportedGraph(trace(t.fn, *specs))


def _kept_masked(graph: Any) -> str | None:
    """:data:`MASKED` when qsa-gather left the masked form: the model's dispatch computes it as well."""
    return MASKED if any(n.op == "qsa_mask" for n in graph.nodes()) else None


def programs(
    pipeline: str | Sequence[Pass] | None, *, strict: bool, max_signatures: int,
    fn: Callable[..., Any] = qsa_attention,
) -> CompiledFunction:  # fmt: skip
    """``fn`` (:func:`qsa_attention` or :func:`qsa_quantized_attention`) compiled per signature; every
    ``qsa-gather`` told the selection input is promised."""
    frontend = OpsFrontend()
    passes = wrapper_pipeline(frontend.device(), frontend.target) if pipeline is None else as_passes(pipeline)
    promised = [isinstance(p, QSAGather) and p.selection_input is None for p in passes]
    passes = [dataclasses.replace(p, selection_input=SELECTION) if tell else p for p, tell in zip(passes, promised)]
    return CompiledFunction(
        fn, frontend, pipeline=passes, strict=strict, max_signatures=max_signatures,
        name="attnpass.backends.mlx.optimize", decline=_kept_masked,
    )  # fmt: skip


def declined(entry: Specialization) -> str:
    """The reason a signature runs the model's dispatch: qsa-gather's own decline, or the failed stage."""
    if entry.reason == MASKED:
        kept = [r.message for r in entry.remarks if r.pass_name == "qsa-gather" and r.kind == "declined"]
        return f"{MASKED}: {kept[0]}" if kept else MASKED
    return f"no compiled program: {entry.reason.splitlines()[0]}"


def original() -> Callable[..., Any]:
    """mlx-vlm's ``dispatch_qsa_attention``."""
    from mlx_vlm.models.qwen4_exp import qsa_kernel

    return qsa_kernel.dispatch_qsa_attention


def is_quantized(cache: Any) -> bool:
    """Whether ``cache`` is exactly mlx-vlm Qwen4-Exp's ``QSAQuantizedKVCache`` (K/V packed, indexer float)."""
    return type(cache) is classes(QWEN4_EXP, "QSAQuantizedKVCache")[0]


def routed_modules(names: Sequence[str], route: Callable[..., Any]) -> list[str]:
    """The modules among ``names`` calling mlx-vlm's dispatch (or already ``route``); none without mlx-vlm loaded."""
    kernel = sys.modules.get("mlx_vlm.models.qwen4_exp.qsa_kernel")
    if kernel is None:
        return []
    return [n for n in names if getattr(sys.modules.get(n), NAME, None) in (kernel.dispatch_qsa_attention, route)]


def record_selection(select: Callable[..., Any]) -> Callable[..., Any]:
    """``select_from_projected`` that also records its selection, per cache, in the active optimized call."""

    def recording(indexer: Any, qk: Any, cache: Any, position_ids: Any) -> Any:
        selection = select(indexer, qk, cache, position_ids)
        call = ACTIVE.get()
        if call is not None and cache is not None and selection is not None:
            call.selections[id(cache)] = (cache, selection, indexer.compress_ratio)
        return selection

    recording.__wrapped__ = select  # type: ignore[attr-defined]
    return recording


STEP = 256  # indexer buffer growth, as KVCache's


@dataclass
class IndexBuffer:
    """The indexer's raw keys and positions kept in buffers beside a ``QSAKVCache``; the cache holds views."""

    keys: Any  # [B, capacity, D]
    positions: Any  # [..., capacity]
    length: int
    view: tuple[Any, Any] | None  # the (index_keys, index_position_ids) the cache was given


def buffered_indexer(update_indexer: Callable[..., Any]) -> Callable[..., Any]:
    """``QSAKVCache.update_indexer`` that appends into a buffer (in place) instead of concatenating, when active.

    The model's update concatenates the whole key history every step (a fresh allocation of depth x
    128 values). Under an optimized call the keys and positions are written into buffers grown by
    :data:`STEP` rows, and the cache gets the views ``buffer[:, :length]``: the same values as the
    concatenation. Whenever the cache no longer holds the views it was given (trimmed, loaded, a plain
    call in between) or a write would change shape or dtype, the model's own update runs and the
    buffers are rebuilt from its result.
    """

    def update(cache: Any, keys: Any, position_ids: Any) -> Any:
        if ACTIVE.get() is None:
            return update_indexer(cache, keys, position_ids)
        buffer, n = cache.__dict__.get("_attnpass_index"), keys.shape[1]
        if buffer is None or not _appendable(buffer, cache, keys, position_ids):
            index_keys, positions = update_indexer(cache, keys, position_ids)
            buffer = cache._attnpass_index = _rebuild(index_keys, positions)
        else:
            buffer.view = cache.index_keys = cache.index_position_ids = None  # the buffers' only readers now
            start = buffer.length
            buffer.keys[:, start : start + n] = keys
            buffer.positions[..., start : start + n] = position_ids.astype(buffer.positions.dtype)
            buffer.length = start + n
        view = (buffer.keys[:, : buffer.length], buffer.positions[..., : buffer.length])
        cache.index_keys, cache.index_position_ids = buffer.view = view
        return view

    update.__wrapped__ = update_indexer  # type: ignore[attr-defined]
    return update


def _same_after_concat() -> set[tuple[Any, Any]]:
    """(new, held) position dtypes whose concatenation keeps the held dtype."""
    import mlx.core as mx

    return {(mx.int32, mx.int32), (mx.int64, mx.int64), (mx.int32, mx.int64)}


def _appendable(buffer: IndexBuffer, cache: Any, keys: Any, positions: Any) -> bool:
    """The cache holds the buffers' views and the new rows fit them (shape, dtype, capacity) as concat would."""
    held = buffer.view is not None and cache.index_keys is buffer.view[0] and cache.index_position_ids is buffer.view[1]
    return (
        held
        and buffer.length + keys.shape[1] <= buffer.keys.shape[1]
        and keys.shape[0] == buffer.keys.shape[0] and keys.shape[2:] == buffer.keys.shape[2:]
        and keys.dtype == buffer.keys.dtype
        and positions.shape[:-1] == buffer.positions.shape[:-1]
        and (positions.dtype, buffer.positions.dtype) in _same_after_concat()
    )  # fmt: skip


def _rebuild(index_keys: Any, positions: Any) -> IndexBuffer:
    """Buffers holding ``index_keys`` and ``positions``, with room for at least :data:`STEP` more rows."""
    import mlx.core as mx

    length = index_keys.shape[1]
    capacity = (length // STEP + 2) * STEP
    keys = mx.zeros((index_keys.shape[0], capacity, *index_keys.shape[2:]), dtype=index_keys.dtype)
    keys[:, :length] = index_keys
    held = mx.zeros((*positions.shape[:-1], capacity), dtype=positions.dtype)
    held[..., :length] = positions
    return IndexBuffer(keys, held, length, None)


def unprovable(
    queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, cache: Any, block_size: int,
    causal: bool, mask: Any, allow_sparse_decode: bool, fetched: dict, selections: dict,
) -> str | None:  # fmt: skip
    """Why a QSA call cannot take the program (None when it can): see the module docstring's proofs."""
    if type(cache) not in classes(QWEN4_EXP, "QSAKVCache", "QSAQuantizedKVCache"):
        return f"{type(cache).__name__}: {CACHES}"
    reason = model_keeps(queries, keys, values, blocks, query_ends, block_size, causal, mask, allow_sparse_decode)
    if reason is not None:
        return reason
    reason = fetch_reason(keys, values, cache, fetched)
    return (
        reason
        if reason is not None
        else selection_reason(blocks, query_ends, cache, block_size, cache.offset, selections)
    )


def model_keeps(
    queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, block_size: int, causal: bool, mask: Any,
    allow_sparse_decode: bool,
) -> str | None:  # fmt: skip
    """Why the model's own dispatch keeps a QSA call: a mask combined with the selection, or its sparse kernel."""
    from mlx_vlm.models.qwen4_exp.qsa_kernel import QSAExecutionPlan, select_qsa_execution_plan

    if not causal or mask is not None:
        return MODEL_MASK
    plan = select_qsa_execution_plan(
        queries, keys, values, blocks, query_ends, block_size=block_size, causal=causal,
        allow_sparse_decode=allow_sparse_decode,
    )  # fmt: skip
    return MODEL_KERNEL if plan is QSAExecutionPlan.INDEXED_SPARSE_PREFILL else None


def selection_reason(
    blocks: Any, query_ends: Any, cache: Any, block_size: int, rows: int, selections: dict
) -> str | None:  # fmt: skip
    """None when ``blocks``/``query_ends`` are the indexer's last selection for ``cache`` over its ``rows`` keys."""
    held, selection, ratio = selections.get(id(cache), (None, None, None))
    if held is not cache or blocks is not selection.selected_blocks or query_ends is not selection.query_ends:
        return NOT_SELECTED
    if not selection.zero_padding:
        return "the selection was made with left padding"
    if block_size != ratio:
        return f"block_size {block_size} is not the indexer's compress ratio {ratio}"
    if selection.key_len != rows:
        return f"the indexer selected over {selection.key_len} keys, the cache holds {rows}"
    return None


__all__ = [
    "CACHES", "MASKED", "MODEL_KERNEL", "MODEL_MASK", "NOT_SELECTED", "OpsFrontend", "is_quantized", "programs",
    "qsa_attention", "qsa_quantized_attention",
]  # fmt: skip
