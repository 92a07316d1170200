"""The programs ``optimize`` compiles per signature: one row of :data:`PROGRAMS` each.

A row names the function (imported from MLX, or written with :mod:`attnpass.ir.ops` and traced), the
:data:`~.bounds.MIN_KEYS` kind that bounds its key rows, and the decisions taken on its rewritten graph
before it is lowered: a graph still one fused ``sdpa`` is declined (the client computes the same over the valid
keys, without a buffer's padding), a QSA program whose ``qsa-gather`` kept the masked form is declined with
``qsa-gather``'s own reason, and an MLA program neither absorbed nor gathered (mlx-lm's own expansion) with
``mla-absorb``'s. :func:`compile_program` makes a row's :class:`~attnpass.backends.specialize.
CompiledFunction`; an :class:`~.optimized.OptimizedModel` makes each one the first time a call needs it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnpass.ir import DType, ImportedGraph, TensorSpec, ops, trace
from attnpass.ir.core.types import native_dtype_name
from attnpass.passes import Decline, DSAGather, MLAAbsorb, Pass, PassResult, QSAGather
from attnpass.passes.analysis.devices import DEVICES

from ..specialize import CompiledFunction, Traceable, as_passes, wrapper_pipeline
from .bounds import Bounds, too_short
from .check import Numerics
from .compiled import MLXFrontend
from .masks import Structure

SELECTION = "selection"  # the QSA programs' selection input, promised to qsa-gather
TOKENS = "idx"  # the DSA program's top-k input, promised to mla-absorb and dsa-gather


def attention(queries: Any, keys: Any, values: Any, mask: Any, sinks: Any, scale: float) -> Any:
    """mlx-lm's helper's attention with an array mask (or none): MLX's fused call, imported and raised."""
    import mlx.core as mx

    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def structured_attention(queries: Any, keys: Any, values: Any, sinks: Any, scale: float, structure: Structure) -> Any:
    """The attention of a mask proven a structure: ``sdpa`` with the causal kind and window as attributes.
    Operands of mixed float dtypes (phi-2 and stablelm call the helper with float32 queries over float16 keys)
    are cast to their promoted dtype first, as MLX's fused call casts them."""
    causal, left, right, chunk = structure
    window = (left, right, chunk) if (left, right, chunk) != (None, None, None) else None
    wide = promoted(queries.dtype, keys.dtype, values.dtype)
    queries, keys, values = (widened(x, wide) for x in (queries, keys, values))
    return ops.sdpa(queries, keys, values, scale=scale, causal=causal, window=window, sinks=sinks)


def promoted(*dtypes: DType) -> DType:
    """MLX's promotion of float dtypes: one dtype stays itself, any two different ones (float16 with bfloat16
    too) give float32."""
    return dtypes[0] if len(set(dtypes)) == 1 else DType.float32


def widened(x: Any, dtype: DType) -> Any:
    """``x`` cast to ``dtype`` unless it has it."""
    return x if x.dtype is dtype else ops.cast(x, dtype)


def quantized_attention(
    queries: Any, kq: Any, ks: Any, kb: Any, vq: Any, vs: Any, vb: Any, mask: Any, scale: float, group_size: int,
    bits: int,
) -> Any:  # fmt: skip
    """mlx-lm's own quantized helper over a ``QuantizedKVCache``'s (words, scales, biases) K and V, imported and
    raised to ``quantized_sdpa``. Only ever imported (its arrays are then tracers): the helper scales its queries
    in place."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    keys, values = (kq, ks, kb), (vq, vs, vb)
    return quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size, bits)


def qsa_attention(
    queries: Any, keys: Any, values: Any, selection: Any, query_ends: Any, scale: float, ratio: int
) -> Any:  # fmt: skip
    """The masked form of one QSA call: ``sdpa`` over the buffer, masked by the selection's cells and the tail."""
    keep = ops.qsa_mask(selection, query_ends - 1, ratio=ratio, kv_len=keys.shape[2])
    return ops.sdpa(queries, keys, values, mask=keep, scale=scale)


def qsa_quantized_attention(
    queries: Any, kq: Any, ks: Any, kb: Any, vq: Any, vs: Any, vb: Any, selection: Any, query_ends: Any,
    scale: float, ratio: int, group_size: int, bits: int,
) -> Any:  # fmt: skip
    """The masked form of one QSA call on a quantized cache: ``quantized_sdpa`` over the (words, scales, biases)
    K and V, masked as :func:`qsa_attention`. Queries of another float dtype than the scales are computed as
    MLX's ``quantized_matmul`` computes them: queries, scales and biases cast to their promoted float dtype."""
    wide = promoted(queries.dtype, ks.dtype)
    queries, ks, kb, vs, vb = (widened(x, wide) for x in (queries, ks, kb, vs, vb))
    keep = ops.qsa_mask(selection, query_ends - 1, ratio=ratio, kv_len=kq.shape[2])
    options = {"scale": scale, "group_size": group_size, "bits": bits}
    return ops.quantized_sdpa(queries, (kq, ks, kb), (vq, vs, vb), mask=keep, **options)


def mla_attention(q: Any, latent: Any, w_uk: Any, w_uv: Any, mask: Any, sinks: Any, scale: float) -> Any:
    """mlx-lm's MLA call of more than one query row: keys and values the latent's per-head up-projections,
    the rope scores as the additive mask (docs/mla.md, "The traced form"); ``sinks`` per head, or None."""
    k = ops.matmul(latent, w_uk)
    v = ops.matmul(latent, ops.transpose(w_uv, (0, 2, 1)))
    return ops.sdpa(q, k, v, mask=mask, sinks=sinks, scale=scale)


def dsa_attention(q: Any, latent: Any, w_uk: Any, w_uv: Any, mask: Any, idx: Any, sinks: Any, scale: float) -> Any:
    """:func:`mla_attention` with the mask kept only on each row's top-k cells ``idx`` (the rest finfo.min)."""
    import numpy as np

    b, _, rows, _ = idx.shape
    hidden = ops.constant(np.zeros((b, 1, rows, latent.shape[2]), bool))
    selected = ops.put_along_axis(hidden, idx, ops.constant(True), axis=-1)
    mask = ops.where(selected, mask, float(mask.dtype.finfo.min))
    return mla_attention(q, latent, w_uk, w_uv, mask, sinks, scale)


def selected_attention(queries: Any, keys: Any, values: Any, mask: Any, idx: Any, scale: float) -> Any:
    """Attention under a bool ``mask`` ``[B, H, L, T]`` kept only on each row's cells ``idx`` ``[B, H, L, K]``, one
    selection per selection head ``H`` (each serving ``Hq / H`` query heads, :mod:`.selections`).

    The selection heads go into the batch with the KV heads they read (``H`` a multiple of ``Hkv``: each KV head's
    selection heads become rows; ``Hkv`` a multiple of ``H``: each selection head's KV heads stay heads), so every
    selection is head-shared: ``sdpa`` over ``where(put_along_axis(False, idx, True), mask, False)``, the form
    ``dsa-gather`` gathers (a pipeline without it attends every key under that mask: the client's function)."""
    import numpy as np

    b, hq, rows, d = queries.shape
    hkv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
    h, k = idx.shape[1], idx.shape[3]
    group = hq // h
    if h % hkv == 0:  # r selection heads per KV head: rows r * L of one KV head, Hq / H query heads each
        r = h // hkv
        q = ops.reshape(queries, (b, hkv, r, group, rows, d))
        q = ops.reshape(ops.transpose(q, (0, 1, 3, 2, 4, 5)), (b * hkv, group, r * rows, d))
        batch, heads, kv_heads, folded = b * hkv, group, 1, r * rows
    else:  # Hkv / H KV heads per selection head
        q = ops.reshape(queries, (b * h, group, rows, d))
        batch, heads, kv_heads, folded = b * h, group, hkv // h, rows
    kf = ops.reshape(keys, (batch, kv_heads, t, d))
    vf = ops.reshape(values, (batch, kv_heads, t, dv))
    cells = ops.reshape(mask, (batch, 1, folded, t))
    picked = ops.reshape(idx, (batch, 1, folded, k))
    selected = ops.put_along_axis(
        ops.constant(np.zeros((batch, 1, folded, t), bool)), picked, ops.constant(True), axis=-1
    )
    out = ops.sdpa(q, kf, vf, mask=ops.where(selected, cells, ops.constant(False)), scale=scale)
    if h % hkv == 0:
        out = ops.transpose(ops.reshape(out, (b, hkv, heads, h // hkv, rows, dv)), (0, 1, 3, 2, 4, 5))
    return ops.reshape(out, (b, hq, rows, dv))


def token_attention(queries: Any, latent: Any, mask: Any, idx: Any, scale: float) -> Any:
    """An absorbed latent call (keys and values the one latent) with its additive ``mask`` kept only on each row's
    top-k cells ``idx`` ``[B, 1, L, K]`` (the rest ``finfo.min``), the form ``dsa-gather`` gathers: one gather of
    the latent per row."""
    import numpy as np

    b, _, rows, _ = idx.shape
    hidden = ops.constant(np.zeros((b, 1, rows, latent.shape[2]), bool))
    selected = ops.put_along_axis(hidden, idx, ops.constant(True), axis=-1)
    mask = ops.where(selected, mask, float(mask.dtype.finfo.min))
    return ops.sdpa(queries, latent, latent, mask=mask, scale=scale)


@dataclass(frozen=True)
class ProgramSpec:
    """One program: its function, whether it is traced (:mod:`attnpass.ir.ops`) rather than exported from MLX,
    the :data:`~.bounds.MIN_KEYS` kind bounding its key rows (None: no bound), whether a graph still one fused
    ``sdpa`` is declined, whether it attends a QSA selection (``qsa-gather`` is told the selection input is
    promised, and a graph left masked is declined), and whether it is an MLA program (a graph left expanded is
    declined; ``tokens``: mla-absorb and dsa-gather are told the top-k input and that every row has a key).
    ``numerics`` is what its output states against the client's function under the CPU default pipeline
    (:mod:`.check`: bit for bit, or a bound per dtype)."""

    fn: Callable[..., Any]
    traced: bool = False
    bound: str | None = None
    declines_fused: bool = False
    selection: bool = False
    latent: bool = False
    tokens: bool = False
    numerics: Numerics = dataclasses.field(default_factory=dict)


LATENT: Numerics = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}  # the latent form sums in another order
GATHERED: Numerics = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}  # softmax and P @ V over the cells only


PROGRAMS: dict[str, ProgramSpec] = {
    "attention": ProgramSpec(attention, bound="float", declines_fused=True),
    "structured_attention": ProgramSpec(structured_attention, traced=True, bound="float", declines_fused=True),
    "quantized_attention": ProgramSpec(quantized_attention, bound="quantized"),
    "qsa_attention": ProgramSpec(qsa_attention, traced=True, selection=True, numerics=GATHERED),
    "qsa_quantized_attention": ProgramSpec(qsa_quantized_attention, traced=True, selection=True, numerics=GATHERED),
    "mla_attention": ProgramSpec(mla_attention, traced=True, bound="mla", latent=True, numerics=LATENT),
    "dsa_attention": ProgramSpec(dsa_attention, traced=True, bound="mla", latent=True, tokens=True, numerics=LATENT),
    "selected_attention": ProgramSpec(selected_attention, traced=True, bound="float", tokens=True, numerics=GATHERED),
    "token_attention": ProgramSpec(token_attention, traced=True, bound="float", tokens=True, numerics=GATHERED),
}


class OpsFrontend(MLXFrontend):
    """MLX signatures of a function written with :mod:`attnpass.ir.ops`: traced, not exported."""

    def import_graph(self, t: Traceable) -> ImportedGraph:
        specs = [TensorSpec(tuple(a.shape), native_dtype_name(a.dtype)) for a in t.arrays]
        return ImportedGraph(trace(t.fn, *specs))


def kept_fused(result: PassResult) -> Decline | None:
    """The decline of a rewritten graph still one MLX fused call (reshapes, and the casts of mixed operands that
    the fused call makes itself, aside): never lowered."""
    if Counter(n.op for n in result.graph.nodes() if n.op not in ("input", "reshape", "cast")) == {"sdpa": 1}:
        return Decline(
            "fused_kernel_serves",
            "the pipeline kept MLX's fused call: the client computes it on the valid keys, without a buffer's padding",
        )
    return None


NO_GAIN = frozenset({"raise-attention", "decompose-sdpa", "dce", "canonicalize"})  # passes that cut no work


def kept_fallback(declined: frozenset[DType]) -> Callable[[PassResult], Decline | None]:
    """The decline hook of a rewritten graph that is only MLX's CPU fallback's own ops (decompose-sdpa's fused
    rounding, no pass of the pipeline outside :data:`NO_GAIN` applied) in a dtype of ``declined`` (the device's
    ``fallback_declined``): the client's call runs those very ops over the valid keys, the program over the
    buffer's cut, which has more rows (docs/benchmarks.md, "Float32 decode on CPU")."""

    def decline(result: PassResult) -> Decline | None:
        applied = [r for r in result.remarks if r.kind == "applied"]
        fallback = [r for r in applied if r.pass_name == "decompose-sdpa" and r.data.get("rounding") == "fused"]
        if not fallback or any(r.pass_name not in NO_GAIN for r in applied):
            return None
        dtype = fallback[0].data["dtype"]
        if DType(dtype) not in declined:
            return None
        return Decline(
            "fallback_ops",
            f"the program would be MLX's CPU fallback's own {dtype} ops (no rewrite cuts work) over the buffer's "
            "cut: the client's call runs the same ops over the valid keys only, faster (docs/benchmarks.md)",
            data={"dtype": dtype},
        )

    return decline


def kept_masked(result: PassResult) -> Decline | None:
    """The decline of a QSA graph ``qsa-gather`` left in the masked form, with ``qsa-gather``'s own reason."""
    if not any(n.op == "qsa_mask" for n in result.graph.nodes()):
        return None
    return _kept_by("qsa-gather", result, "the masked form", "no_gather_pass")


def kept_expanded(result: PassResult) -> Decline | None:
    """The decline of an MLA graph neither absorbed nor gathered (the client's own expansion), with
    mla-absorb's own reason."""
    if any(r.kind == "applied" and r.pass_name in ("mla-absorb", "dsa-gather") for r in result.remarks):
        return None
    return _kept_by("mla-absorb", result, "the expansion", "no_absorb_pass")


def _kept_by(pass_name: str, result: PassResult, form: str, missing: str) -> Decline:
    """The decline of a graph ``pass_name`` left in the client's ``form``: the pass's own first decline, or
    ``missing`` when the pipeline has no such pass."""
    kept = next((r for r in result.remarks if r.pass_name == pass_name and r.kind == "declined"), None)
    if kept is not None:
        return Decline(kept.reason, f"{pass_name} kept {form}: {kept.message}", data=kept.data)
    return Decline(missing, f"the pipeline has no {pass_name}: {form} is the client's own")


def compile_program(
    spec: ProgramSpec, pipeline: str | Sequence[Pass] | None, *, strict: bool, max_signatures: int,
    min_keys: int | None, bounds: Bounds,
) -> CompiledFunction:  # fmt: skip
    """``spec``'s function compiled per signature under ``pipeline`` (None: the device's wrapper pipeline), its
    decisions taken on each rewritten graph in the order fused, too short, fallback (``min_keys`` None only),
    masked."""
    frontend = OpsFrontend() if spec.traced else MLXFrontend()
    passes = wrapper_pipeline(frontend.device(), frontend.target) if pipeline is None else as_passes(pipeline)
    if spec.selection:
        passes = [_promised(p) for p in passes]
    if spec.tokens:
        passes = [_tokens_promised(p) for p in passes]
    device = DEVICES[frontend.device()]
    hooks: list[Callable[[PassResult], Decline | None]] = []
    if spec.declines_fused:
        hooks.append(kept_fused)
    if spec.bound is not None:
        hooks.append(too_short(spec.bound, min_keys, device.min_keys, bounds))
    if spec.declines_fused and min_keys is None:  # an explicit min_keys replaces the measured bounds, this one too
        hooks.append(kept_fallback(device.fallback_declined))
    if spec.selection:
        hooks.append(kept_masked)
    if spec.latent:
        hooks.append(kept_expanded)

    def decline(result: PassResult) -> Decline | None:
        return next((found for found in (hook(result) for hook in hooks) if found is not None), None)

    return CompiledFunction(
        spec.fn, frontend, pipeline=passes, strict=strict, max_signatures=max_signatures,
        name="attnpass.backends.mlx.optimize", decline=decline, fallback=False,
    )  # fmt: skip


def _promised(p: Pass) -> Pass:
    """A ``qsa-gather`` not told of a selection input, told the programs' one; any other pass as it is."""
    if isinstance(p, QSAGather) and p.selection_input is None:
        return dataclasses.replace(p, selection_input=SELECTION)
    return p


def _tokens_promised(p: Pass) -> Pass:
    """An ``mla-absorb`` or ``dsa-gather`` not told of a selection input, told the DSA program's top-k input and
    that its every row has a key (what the route proved); any other pass as it is."""
    if isinstance(p, (MLAAbsorb, DSAGather)) and p.selection_input is None:
        return dataclasses.replace(p, selection_input=TOKENS, rows_have_keys=True)
    return p


__all__ = [
    "PROGRAMS", "OpsFrontend", "ProgramSpec", "attention", "compile_program", "dsa_attention", "kept_expanded",
    "kept_fallback", "kept_fused", "kept_masked", "mla_attention", "qsa_attention", "qsa_quantized_attention",
    "quantized_attention", "selected_attention", "structured_attention", "token_attention",
]  # fmt: skip
