"""``optimize(model)``: an mlx-lm model's attention through attnpass programs, compiled per signature.

This module routes mlx-lm's attention helper and holds the model wrapper; the
same mechanism routes mlx-vlm's Qwen4-Exp QSA dispatch (:mod:`.vlm`, with its
own proofs), and both share the recorders and patches of :mod:`.router`.

**Routing.** mlx-lm's attention modules call ``scaled_dot_product_attention``,
which each model module imports from ``mlx_lm.models.base``. ``optimize``
replaces that name, in the modules defining the model's layers, with a router,
and gives the model a subclass whose ``__call__`` marks it active (a context
variable, so per thread; mlx-vlm's MTP verifier, ``_speculative_verify``,
is wrapped the same way, and so is a model's ``language_model``, which
mlx-vlm's generate calls directly). The router sends the attention of an active optimized
model to its compiled program (:func:`attnpass.backends.mlx.compile` of
:func:`attention`) and every other call, of models not optimized, to mlx-lm's
helper. :meth:`OptimizedModel.restore` (or leaving a ``with`` block) undoes both.

**Signatures.** With a ``KVCache`` the keys grow by one row per decode step
while the cache's buffer grows in steps of ``KVCache.step`` (256). The router
passes the buffer cut to :func:`buffer_rows` rows (the offset rounded up to 32
rows, or to 1/32 of its power of two from 2048 on) and a bool mask of the
valid (and, for several query rows, causal) positions, so a signature is the
query shape, the cut's length, the mask shape, the scale and the dtype: one
trace per 32 rows of context up to 2048 keys, then 32 per doubling, per layer
shape, whatever the position inside the cut. A CPU program works on every row
it is given: the whole buffer (up to 255 padding rows) cost up to twice the
work just past a buffer boundary and made a short context's decode slower
than mlx-lm's helper (which attends the valid keys alone); a trace costs about
10-15 ms on CPU. Without a cache, and for prefills (below), the keys are
passed as they are (one signature per length).

**Quantized caches.** With a ``QuantizedKVCache`` (``kv_bits``) mlx-lm's
helper runs ``quantized_scaled_dot_product_attention`` over the cache's
(packed words, scales, biases) K and V. The router passes the six arrays of
the buffer (the words as int32 of the same bits) and the same bool mask
to :func:`quantized_attention`, mlx-lm's own quantized helper, compiled per
signature: ``raise-attention`` raises it to ``quantized_sdpa``, lowered
GQA-folded (one ``quantized_matmul`` per kv head over the packed keys, one over
the packed values; the cache is never dequantized or repeated per query head).
The group size and bits are part of the signature. The buffer is cut to
:func:`buffer_rows` rows as a float buffer is. On CPU a bfloat16 or float16
call is declined at any depth (:data:`QUANTIZED_TIE`, decided per signature on
the rewritten graph by the :data:`MIN_KEYS` table, unless the pipeline widened
it to float32: then its float32 entry holds; ``optimize(min_keys=)`` routes
it): MLX's CPU kernel adds half-float products one by one, so reading the keys
once per kv head instead of once per query head saves nothing measurable
there (measured from 2K to 16K keys), and the cut's padding rows would cost
up to 3%.

**What the router proves before it substitutes the buffer.** While an
optimized model runs, ``update_and_fetch`` of ``KVCache`` and
``QuantizedKVCache`` records, per cache, the
arrays it returned and the buffer and offset it left. A call with a cache is
routed only if the cache is exactly a ``KVCache`` or ``QuantizedKVCache`` (or a windowed cache,
below), the helper's ``keys`` and ``values`` *are* (object identity) the arrays that cache's last
``update_and_fetch`` of this model call returned, and the cache still holds
that buffer and offset: then ``keys == cache.keys[..., :offset, :]`` (and so
for values; for each of the three quantized arrays) by the cache's own code, and the padded buffer with its mask
computes the same attention. Models that build keys from what the cache holds
(MLA: deepseek_v3, kimi_linear, glm4_moe_lite, ... cache a latent) fail the
identity and are declined.

**Windowed caches** (``RotatingKVCache``: sliding-window layers of gemma3,
cohere2, gpt_oss, exaone4, ...; ``ChunkedKVCache``: llama4's chunked layers)
are routed with the same proof, by their own ``update_and_fetch``: the fetched
keys are the buffer itself or its first rows (a rotating cache's
``keys_and_values``: its first ``offset`` rows while the buffer is longer; a
chunked cache's: its first ``offset - start_position``). A one-row step attends
the buffer as it is (a full ring in its rotated order: every row it holds is in
the window, and the model's mask, if any, is over that order) with the rows
past the keys masked out. A step of several rows (a prefill, which concatenates
and trims the ring) attends its own keys; its mask is read once per step and
checked on every pair (:meth:`OptimizedModel._structure`):
when it is a causal kind with a window or chunk, the program gets no mask but
``structure`` (:func:`attention` builds it from positions, raise-attention
proves it and carries it as the ``sdpa``'s ``window``), and the keys before the
first one any row sees are left out (llama4's cache starts mid-chunk; the chunk
attribute counts from key 0). Any other mask is passed as it is. The same holds
for a ``KVCache`` prefill of more than :data:`PREFILL_ROWS` rows and for calls
without a cache: their own keys, ``"causal"`` as a structure, so that
``block-sparse`` can tile them.

**Declined** calls run mlx-lm's helper and are counted by reason in
:attr:`OptimizedModel.declined`: caches other than these four and ``BatchKVCache`` (which has its
own proofs, :mod:`.batched`; cache lists, ...: no buffer to key on), sinks on a ``QuantizedKVCache``, k/v that are not the cache's fetched
arrays (or not its buffer's valid prefix), string masks other than
``"causal"``, signatures that fell back to the original function, and
signatures whose rewritten graph is still one MLX fused call (:data:`FUSED`:
the helper computes the same on the valid keys, without the buffer padding),
half-float quantized signatures on CPU (:data:`QUANTIZED_TIE`), and, on CPU, signatures whose
keys are fewer rows than :data:`MIN_KEYS` gives their dtype (:data:`SHORT_CONTEXT`: a short context's
program costs more per call than mlx-lm's helper over the valid keys; ``optimize(min_keys=)`` sets the
bound); once the first signature of a dtype and cache kind has found its bound, a call of that kind whose cut
is shorter is declined before its arguments are built or its signature looked up
(:meth:`OptimizedModel._known_short`: a declined decode step costs the helper and the router's checks).
Attention sinks (gpt_oss) are an input of the program. A ``FUSED`` signature
is decided after the pipeline, before lowering: it is never compiled, and as
every signature, built once. So a model is only as fast as the pipeline's
rewrites make it, and never pays the padding for nothing.

**Numerics** (on CPU; ``tests/backends/test_dropin_mlx_lm.py``). A routed call
runs the rewritten program instead of mlx-lm's helper. Head-chunk (MLX's fused
call per chunk of heads) gives plain mlx-lm's log-probabilities bit for bit, in
float32 and bfloat16; the default pipeline's decompose-sdpa does in float32,
and in bfloat16 rounds differently than MLX's call: log-probabilities within two
bf16 steps, so greedy decoding may take the other branch of a near-tie and the
texts part from there. Declined calls are mlx-lm's helper, bit for bit.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import numpy as np

from attnpass.ir import DType, Graph
from attnpass.ir.core.types import native_dtype_name
from attnpass.passes import Pass
from attnpass.passes.analysis.mask_structure import interval_structure
from attnpass.ir import require_int

from ..specialize import MAX_SIGNATURES, CompiledFunction
from . import batched, vlm
from .compiled import MLXFrontend
from .router import (
    ACTIVE,
    LOCK,
    MLX_LM_CACHES,
    NOT_FETCHED,
    Call,
    buffer_rows,
    classes,
    fetch_reason,
    first_rows,
    patch,
    record_fetch,
    unpatch,
)

HELPER = "scaled_dot_product_attention"
ROUTABLE = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache")  # mlx-lm's caches with a buffer
CACHES = f"only {', '.join(ROUTABLE[:-1])} and {ROUTABLE[-1]} have a buffer to key signatures on"
QUANTIZED_SINKS = "attention sinks on a QuantizedKVCache (mlx-lm's helper refuses them)"
PREFILL_ROWS = 64  # more query rows on a KVCache: a prefill, given its own keys (one signature per length)
FUSED = "the pipeline kept MLX's fused call: mlx-lm's helper runs it on the valid keys, without the buffer padding"
# On CPU, (over a quantized cache, the call's precision) -> the fewest key rows (of the program's cut) routed:
# fewer, and the program costs more per call than mlx-lm's helper over the valid keys (measured per call,
# benchmarks/mlx_lm_decode.py's breakdown; docs/benchmarks.md, issue 21's short contexts). float16 as bfloat16.
# None: never routed by default (QUANTIZED_TIE).
MIN_KEYS: dict[tuple[bool, DType], int | None] = {
    (False, DType.float32): 192,
    (False, DType.bfloat16): 128,
    (False, DType.float16): 128,
    (True, DType.float32): 512,
    (True, DType.bfloat16): None,
    (True, DType.float16): None,
}
QUANTIZED_TIE = (
    "a half-float quantized_sdpa on CPU: MLX's CPU quantized_matmul adds half-float products one by one, so the "
    "GQA-folded program only ties mlx-lm's helper at every depth measured (bf16, the helper's time over the "
    "program's per call: 0.88-1.05x at 2K-4K keys, 0.93-1.16x at 8K-16K; whole decode steps at 16K 0.82-1.10x) "
    "and would add its cut's padding rows: mlx-lm's helper runs it (optimize's min_keys, or a pipeline computing "
    "it in float32, routes it)"
)
SHORT_CONTEXT = (
    f"fewer cache rows than the routed minimum (on CPU by default MIN_KEYS: float32 "
    f"{MIN_KEYS[False, DType.float32]}, bfloat16 {MIN_KEYS[False, DType.bfloat16]}, float32 over a quantized "
    f"cache {MIN_KEYS[True, DType.float32]}; or optimize's min_keys): "
    "at a short context the program's fixed cost and its cut's padding rows cost more than mlx-lm's helper over "
    "the valid keys, so the helper runs it"
)
DECLINES = (FUSED, QUANTIZED_TIE, SHORT_CONTEXT)  # decided per signature on the rewritten graph: not failures
Bounds = dict[tuple[bool, str], tuple["int | None", str]]  # (quantized, dtype) -> (fewest rows routed, else why)
Structure = tuple[str, "int | None", "int | None", "int | None"]  # (causal, left, right, chunk) of a sdpa
ENTRY_POINTS = ("__call__", "_speculative_verify")  # the model's methods that run its layers (MTP verify: mlx-vlm)


def attention(
    queries: Any, keys: Any, values: Any, mask: Any, sinks: Any, scale: float, structure: Structure | None = None
) -> Any:
    """The attention an optimized model compiles: MLX's fused call, imported and rewritten per signature.

    ``structure`` ``(causal, left, right, chunk)`` (static) is the mask by positions, as mlx-lm's
    ``create_causal_mask`` builds it from aranges: raise-attention proves it and carries it as the ``sdpa``'s
    causal kind and ``window`` (docs/semantics.md §1.4), no mask array in the program's signature.
    """
    import mlx.core as mx

    if structure is not None:
        causal, left, right, chunk = structure
        s, t = queries.shape[2], keys.shape[2]
        off = t - s if causal == "bottom_right" else 0
        rows, cols = mx.arange(off, off + s)[:, None], mx.arange(t)[None]
        parts = [rows >= cols] if causal != "none" else []
        parts += [rows < cols + left] if left is not None else []
        parts += [cols <= rows + right] if right is not None else []
        parts += [rows // chunk == cols // chunk] if chunk is not None else []
        mask = parts[0]
        for part in parts[1:]:
            mask = mask & part
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def quantized_attention(
    queries: Any, kq: Any, ks: Any, kb: Any, vq: Any, vs: Any, vb: Any, mask: Any, scale: float, group_size: int,
    bits: int,
) -> Any:  # fmt: skip
    """The attention an optimized model compiles for a ``QuantizedKVCache``: mlx-lm's own quantized helper over
    the cache's (words, scales, biases) K and V, imported and raised to ``quantized_sdpa`` per signature.

    Only ever imported (its arrays are then tracers): the helper scales its queries in place."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    keys, values = (kq, ks, kb), (vq, vs, vb)
    return quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size, bits)


def _helper() -> Any:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def route(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, through the active optimized model's programs if any."""
    call = ACTIVE.get()
    if call is None:
        return _helper()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return call.model.attend(queries, keys, values, cache, scale, mask, sinks)


def route_qsa(queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, **options: Any) -> Any:
    """mlx-vlm's ``dispatch_qsa_attention``, through the active optimized model's programs if any."""
    call = ACTIVE.get()
    if call is None:
        return vlm.original()(queries, keys, values, blocks, query_ends, **options)
    return call.model.attend_qsa(queries, keys, values, blocks, query_ends, **options)


def _kept_fused(graph: Graph) -> str | None:
    """:data:`FUSED` when the rewritten graph is still one MLX fused call (reshapes aside): decline, don't lower."""
    ops = Counter(n.op for n in graph.nodes() if n.op not in ("input", "reshape"))
    return FUSED if ops == {"sdpa": 1} else None


def _precision(graph: Graph) -> DType:
    """The dtype a rewritten attention graph computes in: its ``quantized_sdpa``'s (float32 when the pipeline
    widened it), else its queries' (the first input)."""
    for node in graph.nodes():
        if node.op == "quantized_sdpa":
            widened = node.type.dtype is DType.float32 or node.attrs["precision"] != "dtype"
            return DType.float32 if widened else node.type.dtype
    return graph.node(graph.inputs[0]).type.dtype


def _too_short(
    quantized: bool, min_keys: int | None, table: dict[tuple[bool, DType], int | None], bounds: Bounds
) -> Callable[[Graph], str | None]:
    """The decline of a signature whose keys (the second input: the cut's rows, or a quantized cache's words)
    are fewer than ``min_keys`` rows, or when it is None than ``table`` gives for the call (:data:`MIN_KEYS` on
    CPU): :data:`SHORT_CONTEXT`, or :data:`QUANTIZED_TIE` at any depth where the table has None; None when
    routed. Each decision records the bound and its reason in ``bounds``, by (quantized, the queries' dtype): the
    bound depends on the call's kind and precision only, which its dtype decides in a pipeline."""

    def decline(graph: Graph) -> str | None:
        least = table.get((quantized, _precision(graph)), 0) if min_keys is None else min_keys
        reason = QUANTIZED_TIE if least is None else SHORT_CONTEXT
        bounds[quantized, graph.node(graph.inputs[0]).type.dtype.value] = (least, reason)
        return reason if least is None or graph.node(graph.inputs[1]).type.shape[2] < least else None

    return decline


class OptimizedModel:
    """What :func:`optimize` returns: the compiled attention, routing counts, and :meth:`restore`.

    ``compiled`` is the :class:`CompiledFunction` of :func:`attention` for the
    modules calling mlx-lm's helper (None when none does), ``quantized`` the one of
    :func:`quantized_attention` for their calls on a ``QuantizedKVCache``, ``qsa`` the one of
    :func:`attnpass.backends.mlx.vlm.qsa_attention` for those calling mlx-vlm's
    QSA dispatch (None when none does), ``qsa_quantized`` the one of
    :func:`attnpass.backends.mlx.vlm.qsa_quantized_attention` for their calls on a
    ``QSAQuantizedKVCache``; their ``specializations`` hold each
    signature's rewritten graph and remarks. ``traces`` counts the signatures
    built, ``routed`` the attention calls that ran an attnpass program and
    ``declined`` the others, by reason.
    """

    def __init__(
        self, model: Any, compiled: CompiledFunction | None, modules: Sequence[str],
        qsa: CompiledFunction | None = None, qsa_modules: Sequence[str] = (),
        quantized: CompiledFunction | None = None, qsa_quantized: CompiledFunction | None = None,
        bounds: Bounds | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.compiled = compiled
        self.quantized = quantized
        self.modules = tuple(modules)
        self.qsa = qsa
        self.qsa_quantized = qsa_quantized
        self.qsa_modules = tuple(qsa_modules)
        self.routed = 0
        self.declined: Counter[str] = Counter()
        self._original_class = type(model)
        self._entered: list[tuple[Any, type]] = []  # (module, its own class) given an entered subclass
        self._lock = threading.Lock()
        self._last_mask: tuple[tuple, Any] | None = None  # every layer of a step shares its mask
        self._last_structure: tuple[Any, tuple[int, Structure] | None] | None = None
        self._restored = False
        self.bounds: Bounds = {} if bounds is None else bounds  # filled by the programs' _too_short declines

    @property
    def traces(self) -> int:
        return sum(c.traces for c in self._compiled() if c is not None)

    def _compiled(self) -> tuple[CompiledFunction | None, ...]:
        return self.compiled, self.quantized, self.qsa, self.qsa_quantized

    @contextmanager
    def active(self) -> Iterator[None]:
        """Where the model's calls run: this thread's attention comes here, ``KVCache`` fetches are recorded.

        Outside the model (a benchmark timing :meth:`attend`), fetch and attend inside one ``with opt.active():``.
        """
        token = ACTIVE.set(Call(self))
        try:
            yield
        finally:
            ACTIVE.reset(token)

    def attend(self, queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any) -> Any:
        """One attention call of the model: its compiled program, or mlx-lm's helper when declined."""
        call = ACTIVE.get()
        fetched, masks = (call.fetched, call.masks) if call is not None and call.model is self else ({}, {})
        reason = _unroutable(keys, values, cache, mask, sinks, fetched, masks)
        reason = reason or self._known_short(queries, keys, cache)
        if reason is None:
            args = self._program_arguments(queries, keys, values, cache, mask)
            if _quantized(cache):
                entry = self.quantized.specialization(*args, scale, cache.group_size, cache.bits)
                given = [_words(a) for a in args] if entry.compiled else []
            else:
                q, k, v, m, structure = args
                entry = self.compiled.specialization(q, k, v, m, sinks, scale, structure)
                given = [a for a in (q, k, v, m, sinks) if a is not None]
            if entry.compiled:
                with self._lock:
                    self.routed += 1
                return entry.call(given)
            declined = entry.reason in DECLINES
            reason = entry.reason if declined else f"no compiled program: {entry.reason.splitlines()[0]}"
        with self._lock:
            self.declined[reason] += 1
        return _helper()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def _known_short(self, queries: Any, keys: Any, cache: Any) -> str | None:
        """The :data:`SHORT_CONTEXT` or :data:`QUANTIZED_TIE` decline of a call whose program would get fewer key
        rows than the bound its dtype and cache kind were found to have (:func:`_too_short`, when its first
        signature was decided), decided before its arguments are built or its signature looked up (a declined call
        then costs little more than mlx-lm's helper); None when not known to be too short.

        A program's key rows are at most the cut of the cache's buffer (:func:`buffer_rows`), or the call's own
        keys without a cache."""
        least, reason = self.bounds.get((_quantized(cache), native_dtype_name(queries.dtype)), (0, None))
        if least is None:
            return reason
        n = _rows(keys)
        most = n if cache is None else buffer_rows(n, _rows(cache.keys))
        return reason if most < least else None

    def attend_qsa(self, queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, **options: Any) -> Any:
        """One QSA call of the model: the gather program over its own selection, or its dispatch when declined."""
        call = ACTIVE.get()
        fetched, selections = (call.fetched, call.selections) if call is not None and call.model is self else ({}, {})
        cache, ratio, scale = options["cache"], options["block_size"], options["scale"]
        unprovable = batched.unprovable_qsa if batched.is_qsa_batch(cache) else vlm.unprovable
        reason = unprovable(
            queries, keys, values, blocks, query_ends, cache, ratio, options["causal"], options["mask"],
            options.get("allow_sparse_decode", False), fetched, selections,
        )  # fmt: skip
        if reason is None:
            if vlm.is_quantized(cache):  # the packed buffer: words (as int32), scales and biases of K, then of V
                args = (queries, *[_words(a) for a in (*cache.keys, *cache.values)], blocks, query_ends)
                entry = self.qsa_quantized.specialization(*args, scale, ratio, cache.group_size, cache.bits)
            else:
                args = (queries, *batched.qsa_buffer(cache), blocks, query_ends)
                entry = self.qsa.specialization(*args, scale, ratio)
            if entry.compiled:
                with self._lock:
                    self.routed += 1
                return entry.call(list(args))
            reason = vlm.declined(entry)
        with self._lock:
            self.declined[reason] += 1
        return vlm.original()(queries, keys, values, blocks, query_ends, **options)

    def _program_arguments(self, queries: Any, keys: Any, values: Any, cache: Any, mask: Any) -> tuple:
        """``(queries, keys, values, mask, structure)`` for the program.

        A batched cache: :func:`.batched.arguments` (no structure). A ``QuantizedKVCache``:
        :meth:`_quantized_arguments` (no structure). A prefill (more than :data:`PREFILL_ROWS` query rows, or
        several on a windowed cache, or no cache): the helper's own keys, and a causal, windowed or chunked mask
        as ``structure`` (:meth:`_structure`). A decode or verify step: the cache's buffer cut to
        :func:`buffer_rows` rows and a mask of its valid rows (:func:`_prefix_reason`: the keys are its first rows).
        """
        import mlx.core as mx

        if batched.is_batch(cache):
            return (*batched.arguments(queries, cache, mask, _pad_last), None)
        if _quantized(cache):
            return self._quantized_arguments(queries, cache, mask)
        rows = queries.shape[2]
        if cache is None or (
            rows > 1 and (type(cache) is not classes(MLX_LM_CACHES, "KVCache")[0] or rows > PREFILL_ROWS)
        ):
            if isinstance(mask, str):
                return queries, keys, values, None, ("bottom_right", None, None, None)
            if mask is None or mask.dtype != mx.bool_:
                return queries, keys, values, mask, None
            found = self._structure(mask, rows, keys.shape[2])
            if found is None:
                return queries, keys, values, mask, None
            first, structure = found
            if first:  # keys before the first one any row sees: hidden from every row, left out
                keys, values = keys[:, :, first:], values[:, :, first:]
            return queries, keys, values, None, structure
        n = keys.shape[2]
        length = buffer_rows(n, cache.keys.shape[2])
        mask = self._buffer_mask(mask, rows, n, length)
        return queries, *(first_rows(a, length) for a in (cache.keys, cache.values)), mask, None

    def _buffer_mask(self, mask: Any, rows: int, n: int, length: int) -> Any:
        """The call's mask over a buffer of ``length`` rows whose first ``n`` are its keys: the valid rows (and
        causal, for ``"causal"``) when it has none, else its own padded with masked-out rows."""
        if mask is None or isinstance(mask, str):
            return self._valid(rows, n, length, causal=mask is not None)  # also when all valid: one signature
        return _pad_last(mask, length - n) if length > n else mask

    def _structure(self, mask: Any, rows: int, keys: int) -> tuple[int, Structure] | None:
        """``(first, structure)`` when the bool ``mask`` is, on every one of its pairs, the ``structure`` over the
        keys from ``first`` on (keys before are hidden from every row); None when it is no such structure.

        Each row's keys must be one interval (checked against the whole mask in MLX, one pass), every row must
        see one, and the intervals must be a causal kind's, window's or chunk's
        (:func:`~attnpass.passes.analysis.mask_structure.interval_structure`, row by row)."""
        import mlx.core as mx

        last = self._last_structure
        if last is not None and last[0] is mask:  # every layer of a step shares its mask
            return last[1]
        found = None
        if mask.size == rows * keys and mask.shape[-1] == keys:
            plane = mask.reshape(rows, keys)
            lo, count = mx.argmax(plane.astype(mx.uint8), axis=-1), plane.sum(axis=-1)
            j = mx.arange(keys)[None]
            one = mx.array_equal((j >= lo[:, None]) & (j < (lo + count)[:, None]), plane)
            lo, count = np.array(lo, np.int64), np.array(count, np.int64)
            if one.item() and (count > 0).all():
                first = int(lo.min())
                shape = interval_structure(lo - first, lo + count - first, keys - first)
                if not isinstance(shape, str) and (shape[0] != "none" or shape[1] is not None):
                    causal, window = shape
                    left, right, chunk = window if window is not None else (None, None, None)
                    found = first, (causal, left, right, chunk)
        self._last_structure = (mask, found)
        return found

    def _quantized_arguments(self, queries: Any, cache: Any, mask: Any) -> tuple:
        """``(queries, *key parts, *value parts, mask)``: a ``QuantizedKVCache``'s words, scales and biases of its
        keys, then of its values, over the buffer's first :func:`buffer_rows` rows, and a mask of the valid
        rows."""
        length = buffer_rows(cache.offset, cache.keys[0].shape[2])
        mask = self._buffer_mask(mask, queries.shape[2], cache.offset, length)
        return queries, *(first_rows(a, length) for a in (*cache.keys, *cache.values)), mask

    def _valid(self, rows: int, offset: int, length: int, *, causal: bool) -> Any:
        """bool ``[1, 1, rows|1, length]``: key ``j`` valid below ``offset``, and causal (bottom-right) if asked."""
        import mlx.core as mx

        key = (rows, offset, length, causal)
        last = self._last_mask
        if last is not None and last[0] == key:
            return last[1]
        positions = mx.arange(length)
        if causal:
            mask = positions[None] <= (offset - rows + mx.arange(rows))[:, None]
        else:
            mask = (positions < offset)[None]
        mask = mask[None, None]
        self._last_mask = (key, mask)
        return mask

    def explain(self, *, graphs: bool = False, file: TextIO | None = None) -> None:
        """Print the routing counts, then every signature with its remarks (and rewritten graph)."""
        out = file if file is not None else sys.stdout
        declined = ", ".join(f"{n} x {r}" for r, n in self.declined.most_common()) or "none"
        through = [f"{m} ({HELPER})" for m in self.modules] + [f"{m} ({vlm.NAME})" for m in self.qsa_modules]
        print(f"optimize({self._original_class.__name__}): routed {self.routed} attention call(s) through "
              f"{', '.join(through)}; declined: {declined}", file=out)  # fmt: skip
        for compiled in self._compiled():
            if compiled is not None:
                compiled.explain(graphs=graphs, file=out)

    def restore(self) -> None:
        """Undo :func:`optimize`: the model's own class, the clients' functions where no other model still routes."""
        with LOCK:
            if self._restored:
                return
            self._restored = True
            for module, cls in self._entered:
                module.__class__ = cls
            for owner, name in _patched(self):
                unpatch(owner, name)

    def __enter__(self) -> OptimizedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "restored" if self._restored else "active"
        name = self._original_class.__name__
        return f"<OptimizedModel {name} ({state}): {self.traces} trace(s), {self.routed} routed>"


def _unroutable(keys: Any, values: Any, cache: Any, mask: Any, sinks: Any, fetched: dict, masks: dict) -> str | None:
    """Why a call cannot take the program (None when it can): odd masks, caches, k/v not provably the cache's,
    sinks on a quantized cache."""
    if isinstance(mask, str) and mask != "causal":
        return f"string mask {mask!r}"
    if cache is None:
        return None
    if batched.is_batch(cache):
        return batched.unroutable(keys, values, cache, mask, fetched, masks)
    if type(cache) not in classes(MLX_LM_CACHES, *ROUTABLE):
        return f"{type(cache).__name__}: {CACHES}"
    reason = fetch_reason(keys, values, cache, fetched)
    if reason is not None:
        return reason
    n = _rows(keys)
    if mask is not None and not isinstance(mask, str) and mask.shape[-1] != n:
        return f"the mask covers {mask.shape[-1]} keys, the helper has {n}"
    reason = _prefix_reason(keys, cache)
    if reason is None and sinks is not None and _quantized(cache):
        return QUANTIZED_SINKS
    return reason


def _rows(keys: Any) -> int:
    """The rows of a cache's keys: an array's, or a quantized cache's (words, scales, biases)."""
    return (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2]


def _prefix_reason(keys: Any, cache: Any) -> str | None:
    """None when ``keys`` (the cache's last fetch) are its buffer's first ``keys.shape[2]`` rows, by the cache's
    own ``update_and_fetch``; else why not."""
    rotating, chunked = classes(MLX_LM_CACHES, "RotatingKVCache", "ChunkedKVCache")
    n, length = _rows(keys), _rows(cache.keys)
    if type(cache) is rotating:  # keys_and_values: the buffer, or its first offset rows while it is longer
        held = keys is cache.keys or n == cache.offset < length
    elif type(cache) is chunked:  # keys_and_values: the buffer's first offset - start_position rows
        held = n == cache.offset - cache.start_position <= length
    else:  # KVCache, QuantizedKVCache: the buffer's first offset rows
        held = n == cache.offset <= length
    if held:
        return None
    return f"{type(cache).__name__}: the keys ({n} rows) are not the buffer's valid prefix ({length} rows)"


def _quantized(cache: Any) -> bool:
    """Whether a routable cache holds its keys quantized: a QuantizedKVCache's (words, scales, biases)."""
    return cache is not None and isinstance(cache.keys, (tuple, list))


def _words(array: Any) -> Any:
    """A program argument: packed uint32 words as int32 of the same bits (the IR's type), the rest as they are."""
    import mlx.core as mx

    return array.view(mx.int32) if array.dtype == mx.uint32 else array


def _pad_last(mask: Any, count: int) -> Any:
    """``mask`` extended by ``count`` masked-out keys: False for bool masks, -inf for additive ones."""
    import mlx.core as mx

    fill = False if mask.dtype == mx.bool_ else float("-inf")
    return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, count)], constant_values=fill)


def optimize(
    model: Any,
    pipeline: str | Sequence[Pass] | None = None,
    *,
    strict: bool = False,
    max_signatures: int = MAX_SIGNATURES,
    min_keys: int | None = None,
) -> OptimizedModel:
    """Run ``model``'s attention (an mlx-lm model, or mlx-vlm's Qwen4-Exp) through attnpass programs.

    Modules calling mlx-lm's ``scaled_dot_product_attention`` get :func:`attention`'s programs,
    modules calling mlx-vlm's ``dispatch_qsa_attention`` the QSA gather programs of :mod:`.vlm`.
    ``mlx_lm.generate``, ``stream_generate`` and speculative decoding work
    unchanged. ``pipeline``, ``strict`` and ``max_signatures`` are as for
    :func:`attnpass.backends.mlx.compile` (for QSA calls every ``qsa-gather`` of the
    pipeline is given ``selection_input``). A call of mlx-lm's helper whose program would get fewer key rows
    than ``min_keys`` runs the helper (declined, :data:`SHORT_CONTEXT` or :data:`QUANTIZED_TIE`); None is
    :data:`MIN_KEYS` per dtype on CPU (measured: a short context's program costs more than the helper) and 0
    elsewhere; 0 routes every depth (the exactness tests' tiny contexts). Returns an :class:`OptimizedModel`;
    its ``restore()``, or leaving ``with optimize(model):``, undoes the change.
    Raises ``TypeError`` when ``model`` is not an ``mlx.nn.Module``, ``ValueError``
    when it is already optimized or none of its modules calls either function, or ``min_keys`` is not an
    int >= 0 or None.
    """
    from mlx import nn

    if not isinstance(model, nn.Module):
        hint = " (mlx_lm.load returns (model, tokenizer): pass the model)" if isinstance(model, tuple) else ""
        raise TypeError(
            f"optimize: expected an mlx-lm model (an mlx.nn.Module such as mlx_lm.load(path)[0]), "
            f"got {type(model).__name__} {_short(model)}{hint}"
        )
    # mlx-vlm's generate calls a VLM's language_model directly: it enters the optimized call as well
    inner = getattr(model, "language_model", None)
    entered = [model] + ([inner] if isinstance(inner, nn.Module) else [])
    for module in entered:
        if getattr(type(module), "_attnpass_optimized", None) is not None:
            raise ValueError(f"{type(module).__name__} is already optimized; restore() it first")
    names = sorted({type(m).__module__ for m in model.modules()})
    base = sys.modules.get("mlx_lm.models.base")  # a module calling mlx-lm's helper has imported it
    helpers = () if base is None else (getattr(base, HELPER), route)
    routed = [n for n in names if getattr(sys.modules.get(n), HELPER, None) in helpers]
    qsa_routed = vlm.routed_modules(names, route_qsa)
    if not routed and not qsa_routed:
        raise ValueError(
            f"optimize: no module of {type(model).__name__} ({', '.join(names)}) calls "
            f"mlx_lm.models.base.{HELPER} or mlx-vlm's {vlm.NAME}; its attention cannot be routed"
        )
    if min_keys is not None:
        require_int("optimize", "min_keys", min_keys, minimum=0, meaning="or None: MIN_KEYS on CPU")
    options = {"strict": strict, "max_signatures": max_signatures}
    compiled = qsa = quantized = qsa_quantized = None
    bounds: Bounds = {}
    if routed:
        frontend = MLXFrontend()
        table = MIN_KEYS if frontend.device() == "cpu" else {}
        short = _too_short(False, min_keys, table, bounds)
        compiled = CompiledFunction(
            attention, frontend, pipeline=pipeline, **options, name="attnpass.backends.mlx.compile",
            decline=lambda graph: _kept_fused(graph) or short(graph),
        )  # fmt: skip
        quantized = CompiledFunction(
            quantized_attention, MLXFrontend(), pipeline=pipeline, **options, name="attnpass.backends.mlx.compile",
            decline=_too_short(True, min_keys, table, bounds),
        )  # fmt: skip
    if qsa_routed:
        qsa = vlm.programs(pipeline, **options)
        qsa_quantized = vlm.programs(pipeline, **options, fn=vlm.qsa_quantized_attention)
    optimized = OptimizedModel(model, compiled, routed, qsa, qsa_routed, quantized, qsa_quantized, bounds)
    with LOCK:
        for owner, name, replace in _patches(optimized):
            patch(owner, name, replace)
        for module in entered:
            cls = type(module)
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            namespace["_attnpass_optimized"] = optimized
            for entry in ENTRY_POINTS:
                if hasattr(cls, entry):
                    namespace[entry] = _entered(optimized, getattr(cls, entry))
            optimized._entered.append((module, cls))
            module.__class__ = type(cls.__name__, (cls,), namespace)
    return optimized


def _entered(optimized: OptimizedModel, method: Any) -> Any:
    """``method`` run with ``optimized`` active (its attention routed, its caches' fetches recorded)."""

    def entered(self: Any, *args: Any, **kwargs: Any) -> Any:
        with optimized.active():
            return method(self, *args, **kwargs)

    entered.__name__ = entered.__qualname__ = method.__name__
    return entered


def _patches(optimized: OptimizedModel) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replace)`` for every client function and recorder ``optimized`` needs."""
    found: list[tuple[Any, str, Any]] = [(sys.modules[n], HELPER, lambda _: route) for n in optimized.modules]
    if optimized.modules:
        from mlx_lm.models.cache import BatchKVCache

        found += [(cls, "update_and_fetch", record_fetch) for cls in classes(MLX_LM_CACHES, *ROUTABLE)]
        found.append((BatchKVCache, "update_and_fetch", batched.record_fetch))
        found.append((BatchKVCache, "make_mask", batched.record_mask))
    found += [(sys.modules[n], vlm.NAME, lambda _: route_qsa) for n in optimized.qsa_modules]
    if optimized.qsa_modules:
        from mlx_vlm.models.cache import BatchKVCache as VLMBatchKVCache
        from mlx_vlm.models.cache import KVCache as VLMKVCache
        from mlx_vlm.models.cache import QuantizedKVCache as VLMQuantizedKVCache
        from mlx_vlm.models.qwen4_exp.language import QSAKVCache, QSAQuantizedKVCache, Qwen4ExpQSAIndexer

        found += [(cls, "update_and_fetch", record_fetch) for cls in (VLMKVCache, VLMQuantizedKVCache)]
        found.append((VLMBatchKVCache, "update_and_fetch", batched.record_fetch))
        found += [(cls, "update_indexer", vlm.buffered_indexer) for cls in (QSAKVCache, QSAQuantizedKVCache)]
        found.append((Qwen4ExpQSAIndexer, "select_from_projected", vlm.record_selection))
    return found


def _patched(optimized: OptimizedModel) -> list[tuple[Any, str]]:
    return [(owner, name) for owner, name, _ in _patches(optimized)]


def _short(value: Any) -> str:
    """``repr(value)`` on one line, cut to 60 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "CACHES", "DECLINES", "FUSED", "MIN_KEYS", "NOT_FETCHED", "QUANTIZED_TIE",
    "SHORT_CONTEXT", "OptimizedModel", "attention",
    "buffer_rows", "optimize", "quantized_attention", "route", "route_qsa",
]  # fmt: skip
