"""Random valid graphs with inputs inside their ops' contracts, built from a :class:`~tests.fuzz.choices.Choices`.

Families (each a function ``Choices -> Case``; the first option of every
draw is the simplest):

- ``sdpa``: one call with GQA, every mask form (none, bool, additive) and
  broadcast (rank 0 to 4, each axis whole or 1, per-head or not), each
  causal kind (so bottom-right rows with no key too), a structured ``window``
  (left, right, chunk; rows it leaves without keys too), sinks and logit
  soft-capping, scales, ``Dv != D``,
  masks read through a slice of a padded input, rows that attend no key;
- ``chain``: one to three calls feeding each other (or sharing K/V), with
  dead branches and an unused input;
- ``decomposed``: ``softmax(q·kᵀ·scale + mask)·v`` written with matmuls as
  MLX, JAX and hand-written code spell it: q/k/v in ``[B, H, S, D]`` or
  ``[B, S, H, D]``, GQA by folding q or repeating K/V, scales on q, k or the
  scores, additive biases and bool masks filled with ``-inf`` or the dtype's
  min, the softmax fused or spelled out, and near misses (softmax over the
  wrong axis, a scale on v or on the probabilities, tiled K/V heads);
- ``qsa``: decode-shaped masked QSA (``qsa_select``/``qsa_mask``, with block
  scores given or computed by ``qsa_pool``/``qsa_block_scores`` from a
  resident or streamed raw-key cache) with tied
  scores, every tail length, depths around ``min_depth_factor * W``, every
  visibility form, and padded visibility masks read through a slice;
- ``mla``: MLA attention as mlx-lm computes more than one query row (K and V
  up-projected from one latent, possibly broadcast to the heads, a second
  latent or another reader of K as near misses), with no mask, an additive
  one, or DSA's token selection (``where(put_along_axis(False, idx, True),
  scores, fill)`` or the bool selection) whose indices are the input ``idx``
  (distinct, every row keeping a cell above the fill: what the option pools'
  ``selection_input=idx`` and ``rows_have_keys`` promise), ``idx_dup`` (repeats,
  never promised) or an ``argpartition`` of scores; fills at ``finfo.min``,
  ``-inf`` or above (a near miss); causal kinds the gather cannot carry;
- ``partial``: attention normalised after P·V (``(exp(s - m)·v) / sum(exp(s - m))``, the max subtracted or
  not) and two or three partial attentions over their own keys combined by their log-sum-exps (MaxText's max
  and sum, ``Σ exp(lse_i - lse)·o_i``, split-kv's ``Σ w_i·o_i / Σ w_i``), GQA in MaxText's grouped 5-d layout
  or by repeated K/V, rows first or heads first, scales on q or the scores, bool (finite or ``-inf`` fills)
  and additive masks, and look-alikes: a division by another sum, a product with another exp, a sum plus one,
  weights that do not sum to one, parts reading the same keys, other queries or another scale.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np

from attnpass.ir import DType, Graph, TensorType
from attnpass.ir.core.builder import Builder

from .choices import Choices

F32, F16, BF16, I32, BOOL = DType.float32, DType.float16, DType.bfloat16, DType.int32, DType.bool
MESH = {"x": 2, "y": 1}  # declared on every graph, so shard-attention's options name real axes (placement only)
FLOATS = (F32, BF16, F16)


@dataclass
class Case:
    """A graph and its inputs (by name); ``family`` names the generator."""

    family: str
    graph: Graph
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class _Maker:
    """A graph under construction plus an input-value generator seeded from the choices."""

    def __init__(self, c: Choices, name: str) -> None:
        self.c = c
        self.graph = Graph(name)
        self.b = Builder(self.graph)
        self.rng = np.random.default_rng(c.int(0, 2**16))
        self.arrays: dict[str, np.ndarray] = {}

    def input(
        self, name: str, shape: tuple[int, ...], dtype: DType, values: np.ndarray | None = None, role: str = "streamed"
    ) -> str:
        self.graph.add_input(name, TensorType(tuple(shape), dtype), role)
        if values is None:
            values = self.rng.uniform(-1.0, 1.0, shape) if dtype.is_float else self.rng.random(shape) < 0.5
        self.arrays[name] = np.asarray(values).astype(dtype.numpy)
        return name

    def const(self, value: float, dtype: DType) -> str:
        return self.b.scalar(value, dtype, "c")

    def case(self, family: str, outputs: list[str]) -> Case:
        self.graph.set_outputs(outputs)
        self.graph.set_mesh(MESH)
        return Case(family, self.graph.verify(), self.arrays)


# ----------------------------------------------------------------------------- masks


def _mask_shape(c: Choices, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape broadcasting to ``full`` = [B, Hq, S, T]: rank 0-4, each kept axis whole or 1."""
    rank = c.pick([2, 4, 3, 1, 0])
    return tuple(n if c.flag(0.75) else 1 for n in full[4 - rank :])


def _mask_values(m: _Maker, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Bool (density and rows with no key drawn) or additive (finite biases, -inf, rows of -inf)."""
    c, rng = m.c, m.rng
    if dtype is BOOL:
        keep = np.asarray(rng.random(shape) < c.pick([0.7, 0.3, 1.0, 0.0]))
        if len(shape) >= 2 and c.flag(0.3):
            keep[..., rng.integers(shape[-2]), :] = False  # a row that attends no key
        return np.asarray(keep)
    bias = np.asarray(rng.normal(0.0, c.pick([1.0, 0.0, 4.0]), shape))
    bias[rng.random(shape) < c.pick([0.0, 0.3, 0.9])] = -np.inf
    if len(shape) >= 2 and c.flag(0.2):
        bias[..., rng.integers(shape[-2]), :] = -np.inf  # NaN on every path
    return bias


def _mask_input(m: _Maker, name: str, shape: tuple[int, ...], dtype: DType) -> str:
    """An input of ``shape``, or a padded input read through one slice (what narrow-inputs narrows)."""
    if not shape or not m.c.flag(0.25):
        return m.input(name, shape, dtype, _mask_values(m, shape, dtype))
    axis, extra = m.c.int(0, len(shape) - 1), m.c.int(1, 3)
    padded = tuple(n + extra if a == axis else n for a, n in enumerate(shape))
    start = m.c.int(0, extra)
    x = m.input(f"{name}_padded", padded, dtype, _mask_values(m, padded, dtype))
    return m.b.slice_axis(x, axis, start, start + shape[axis], hint=name)


# ----------------------------------------------------------------------------- sdpa and chains


def _sdpa(m: _Maker, tag: str, q: str | None, kv: tuple[str, str] | None, dims: dict) -> str:
    c, b = m.c, m.b
    bsz, hq, hkv, s, t, d, dv, dtype = (dims[k] for k in ("b", "hq", "hkv", "s", "t", "d", "dv", "dtype"))
    if q is None:
        q = m.input(f"q{tag}", (bsz, hq, s, d), dtype)
    if kv is None:
        role = c.pick(["streamed", "resident"])
        kv = (
            m.input(f"k{tag}", (bsz, hkv, t, d), dtype, role=role),
            m.input(f"v{tag}", (bsz, hkv, t, dv), dtype, role=role),
        )
    operands = {"q": q, "k": kv[0], "v": kv[1]}
    kind = c.pick([None, BOOL, dtype])
    if kind is not None:
        operands["mask"] = _mask_input(m, f"mask{tag}", _mask_shape(c, (bsz, hq, s, t)), kind)
    attrs = {"scale": c.pick([None, 0.125, 0.3, 1.0, 2.0]), "causal": c.pick(["none", "top_left", "bottom_right"])}
    if c.flag(0.3):  # a structured mask (docs/semantics.md §1.4); right only without causality
        right = c.pick([None, 0, 1, 3]) if attrs["causal"] == "none" else None
        window = (c.pick([None, 1, 2, 4]), right, c.pick([None, 2, 3, 5]))
        attrs["window"] = None if window == (None, None, None) else window
    if c.flag(0.2):  # sinks and logit soft-capping (docs/semantics.md §1.3)
        attrs["logit_softcap"] = c.pick([None, 1.0, 5.0])
        if c.flag(0.5):
            operands["sinks"] = m.input(f"sinks{tag}", (hq,), dtype)
    return b.op("sdpa", operands, attrs, f"attn{tag}")


def _dims(c: Choices) -> dict:
    hkv = c.pick([1, 2, 3])
    d = c.pick([8, 4, 16])
    return {
        "b": c.int(1, 2), "hkv": hkv, "hq": hkv * c.pick([1, 2, 4, 12, 3, 6, 8]), "s": c.int(1, 9),
        "t": c.int(1, 12), "d": d, "dv": c.pick([4, 8]) if c.flag(0.25) else d, "dtype": c.pick(FLOATS, (4, 1, 1)),
    }  # fmt: skip


def sdpa_family(c: Choices) -> Case:
    m = _Maker(c, "sdpa")
    return m.case("sdpa", [_sdpa(m, "", None, None, _dims(c))])


def chain_family(c: Choices) -> Case:
    """Calls feeding each other (q of the next = output of the last) or sharing K/V; dead values; extra outputs."""
    m = _Maker(c, "chain")
    dims = _dims(c)
    outs = [_sdpa(m, "0", None, None, dims)]
    first = m.graph.node(outs[0]).inputs
    for i in range(1, c.int(1, 3)):
        square = dims["d"] == dims["dv"]  # the output can be the next q, and K/V fit the next call
        feed, share = square and c.flag(0.7), square and c.flag(0.4)
        outs.append(_sdpa(m, str(i), outs[-1] if feed else None, (first[1], first[2]) if share else None, dims))
    if c.flag(0.3):  # a dead branch: dce's work
        m.b.op("exp", [outs[0]], hint="dead")
    if c.flag(0.3):
        m.input("unused", (2, 3), F32)
    keep = [o for o in outs if c.flag(0.5)] or [outs[-1]]
    return m.case("chain", keep if outs[-1] in keep else keep + [outs[-1]])


# ----------------------------------------------------------------------------- decomposed attention


def _to_bhsd(m: _Maker, x: str, layout: str) -> str:
    return m.b.transpose(x, (0, 2, 1, 3), "bhsd") if layout == "bshd" else x


def _scaled(m: _Maker, x: str, factor: float, dtype: DType, how: str) -> str:
    if factor == 1.0:
        return x
    if how == "div":
        return m.b.op("div", [x, m.const(1.0 / factor, dtype)], hint="scaled")
    return m.b.op("mul", [x, m.const(factor, dtype)], hint="scaled")


def _softmax(m: _Maker, x: str, axis: int, dtype: DType) -> str:
    """``softmax`` fused, or spelled ``exp(x - max) / sum`` with the reductions kept (optionally clamped)."""
    c, b = m.c, m.b
    if not c.flag(0.5):
        return b.op("softmax", [x], {"axis": axis, "precise": c.flag(0.2)})
    keep = c.flag(0.5)
    peak = b.op("max", [x], {"axes": (axis,), "keepdims": keep})
    shape = list(m.graph.node(x).type.shape)
    shape[axis] = 1
    peak = b.reshape(peak, shape, "peak")
    if c.flag(0.3):
        peak = b.op("maximum", [peak, m.const(-math.inf, dtype)], hint="clamped")
    e = b.op("exp", [b.op("sub", [x, peak])])
    total = b.reshape(b.op("sum", [e], {"axes": (axis,), "keepdims": keep}), shape, "total")
    return b.op("div", [e, total], hint="probs")


def decomposed_family(c: Choices) -> Case:
    """softmax(q·kᵀ·scale + mask)·v with matmuls; see the module docstring for the spellings and near misses."""
    m = _Maker(c, "decomposed")
    b = m.b
    dtype = c.pick(FLOATS, (4, 1, 1))
    hkv, group = c.pick([1, 2, 3]), c.pick([1, 2, 4, 3])
    bsz, hq, s, t, d, dv = c.int(1, 2), hkv * group, c.int(1, 6), c.int(1, 8), c.pick([8, 4, 16]), c.pick([8, 4])
    q_layout, kv_layout = c.pick(["bhsd", "bshd"]), c.pick(["bhsd", "bshd"])

    def root(name: str, heads: int, rows: int, width: int, layout: str) -> str:
        shape = (bsz, heads, rows, width) if layout == "bhsd" else (bsz, rows, heads, width)
        return _to_bhsd(m, m.input(name, shape, dtype), layout)

    q, k, v = root("q", hq, s, d, q_layout), root("k", hkv, t, d, kv_layout), root("v", hkv, t, dv, kv_layout)
    scale = c.pick([1 / math.sqrt(d), 0.5, 1.0, 0.3])
    q_part = c.pick([1.0, math.sqrt(scale), scale])
    q = _scaled(m, q, q_part, dtype, "mul")
    k = _scaled(m, k, scale / q_part if c.flag(0.3) else 1.0, dtype, "mul")
    score_scale = scale / q_part if m.graph.node(k).op != "mul" else 1.0
    gqa = c.pick(["repeat", "fold", "tile"], (6, 3, 1)) if group > 1 else "none"
    if gqa in ("repeat", "tile"):  # K/V broadcast to every query head, repeated (sdpa's GQA) or tiled (not)

        def expand(x: str, width: int) -> str:
            axis = 2 if gqa == "repeat" else 1
            five = b.reshape(x, (bsz, hkv, 1, t, width) if axis == 2 else (bsz, 1, hkv, t, width), "kv5")
            full = (bsz, hkv, group, t, width) if axis == 2 else (bsz, group, hkv, t, width)
            return b.reshape(b.broadcast(five, full, "kv_rep"), (bsz, hq, t, width), "kv_heads")

        k, v = expand(k, d), expand(v, dv)
    folded = gqa == "fold"
    if folded:
        q = b.reshape(q, (bsz, hkv, group * s, d), "q_fold")
    if c.flag(0.8):
        scores = b.op("matmul", [q, b.transpose(k, (0, 1, 3, 2), "kT")], hint="scores")
    else:  # (k·qᵀ)ᵀ
        scores = b.transpose(b.op("matmul", [k, b.transpose(q, (0, 1, 3, 2), "qT")]), (0, 1, 3, 2), "scores")
    if folded:
        scores = b.reshape(scores, (bsz, hq, s, t), "scores4")
    mask_kind = c.pick([None, "additive", "bool"])
    mask_first = mask_kind == "additive" and c.flag(0.2)  # (s + m) * scale: the mask is scaled too
    if mask_first:
        scores = b.op("add", [scores, _mask_input(m, "mask", _mask_shape(c, (bsz, hq, s, t)), dtype)], hint="biased")
    scores = _scaled(m, scores, score_scale, dtype, c.pick(["mul", "div"]))
    if mask_kind == "additive" and not mask_first:
        scores = b.op("add", [scores, _mask_input(m, "mask", _mask_shape(c, (bsz, hq, s, t)), dtype)], hint="biased")
    elif mask_kind == "bool":
        low = float(ml_dtypes.finfo(dtype.numpy).min)
        fill = c.pick([-math.inf, low, -1e4, 0.0])
        mask = _mask_input(m, "mask", _mask_shape(c, (bsz, hq, s, t)), BOOL)
        scores = b.op("where", [mask, scores, m.const(fill, dtype)], hint="masked")
    near_miss = c.pick([None, "softmax-axis", "scale-v", "scale-p", "bias-after"], (12, 1, 1, 1, 1))
    probs = _softmax(m, scores, 2 if near_miss == "softmax-axis" else 3, dtype)
    if near_miss == "scale-p":
        probs = _scaled(m, probs, 0.5, dtype, "mul")
    if near_miss == "bias-after":
        probs = b.op("add", [probs, m.input("late", (s, t), dtype)], hint="late_bias")
    if near_miss == "scale-v":
        v = _scaled(m, v, 0.5, dtype, "mul")
    if folded:
        probs = b.reshape(probs, (bsz, hkv, group * s, t), "p_fold")
    out = b.op("matmul", [probs, v], hint="pv")
    out = b.reshape(out, (bsz, hq, s, dv), "out")
    if c.flag(0.5):  # back to [B, S, H*Dv] as a model's output projection reads it
        out = b.reshape(b.transpose(out, (0, 2, 1, 3), "out_t"), (bsz, s, hq * dv), "out_flat")
    return m.case("decomposed", [out])


# ----------------------------------------------------------------------------- QSA decode


def qsa_family(c: Choices) -> Case:
    """Masked QSA decode attention; depth drawn around the gather threshold ``2 * W``."""
    m = _Maker(c, "qsa")
    b, rng = m.b, m.rng
    dtype = c.pick(FLOATS, (4, 1, 1))
    ratio, top_k = c.pick([2, 4, 3, 1]), c.int(1, 4)
    width = top_k * ratio + ratio - 1
    t = max(ratio, 2 * width + c.pick([0, -1, 1, ratio, -ratio, width, -width, 2 * width]))
    bsz, rows, hkv, d = c.int(1, 2), c.pick([1, 2], (4, 1)), c.pick([1, 2]), c.pick([8, 4])
    hq = hkv * c.pick([1, 2, 4])
    n_blocks = t // ratio if c.flag(0.8) else c.int(1, t // ratio)
    q = m.input("q", (bsz, hq, rows, d), dtype)
    k = m.input("k_cache", (bsz, hkv, t, d), dtype, role="resident")
    v = m.input("v_cache", (bsz, hkv, t, d), dtype, role="resident")
    late = rng.integers(max(0, t - 2 * ratio), t, (bsz, rows))
    positions = np.where(rng.random((bsz, rows)) < c.pick([0.8, 0.2]), late, rng.integers(0, t, (bsz, rows)))
    pos = m.input("positions", (bsz, rows), I32, positions)
    if c.flag(0.7):  # block scores given: ties from small integers, signed zeros
        values = rng.integers(0, c.pick([3, 2, 100]), (bsz, rows, n_blocks)).astype(np.float32)
        values *= np.where(rng.random(values.shape) < 0.5, 1.0, -1.0)
        scores = m.input("block_scores", (bsz, rows, n_blocks), F32, values)
    else:  # computed by the indexer ops; a resident raw-key cache is what qsa-pool-cache caches the pooling of
        raw = m.input("raw_keys", (bsz, n_blocks * ratio, 4), dtype, role=c.pick(["resident", "streamed"]))
        scores = b.op(
            "qsa_block_scores", [m.input("idx_q", (bsz, rows, 2, 4), dtype), b.op("qsa_pool", [raw], {"ratio": ratio})]
        )
    sel = b.op("qsa_select", [scores, pos], {"ratio": ratio, "top_k_blocks": top_k})
    keep = b.op("qsa_mask", [sel, pos], {"ratio": ratio, "kv_len": t})
    form = c.pick(["where", "none", "logical_and", "where-zero"], (5, 3, 1, 1))
    mask = keep
    if form != "none":
        vis_dtype = BOOL if form == "logical_and" else dtype
        shape = c.pick([(bsz, 1, rows, t), (t,), (rows, t), (bsz, hq, rows, t)])
        if c.flag(0.3) and vis_dtype is not BOOL:  # the runtime's padded f16 mask, sliced to its rows and cast
            padded = m.input("mask", (bsz, rows + 2, t), F16, _mask_values(m, (bsz, rows + 2, t), F16))
            sliced = b.slice_axis(padded, 1, 0, rows, hint="mask_rows")
            vis = b.cast(b.reshape(sliced, (bsz, 1, rows, t), "mask4"), dtype, "mask_cast")
        else:
            vis = m.input("vis", shape, vis_dtype, _mask_values(m, shape, vis_dtype))
        if form == "logical_and":
            mask = b.op("logical_and", [keep, vis] if c.flag() else [vis, keep])
        else:
            mask = b.op("where", [keep, vis, m.const(0.0 if form == "where-zero" else -math.inf, dtype)], hint="attend")
    out = b.op(
        "sdpa",
        {"q": q, "k": k, "v": v, "mask": mask},
        {"scale": c.pick([None, 0.25]), "causal": c.pick(["none", "bottom_right"], (9, 1))},
    )
    return m.case("qsa", [out])


# ----------------------------------------------------------------------------- MLA and DSA


def _selection(m: _Maker, bsz: int, rows: int, t: int, top_k: int, visible: np.ndarray) -> str:
    """i32 ``[B, 1, L, K]`` token indices: ``idx`` (distinct, one visible cell first), ``idx_dup`` or argpartition."""
    c, rng = m.c, m.rng
    kind = c.pick(["idx", "argpartition", "idx_dup"], (6, 2, 1))
    if kind == "argpartition":  # mlx-lm's indexer: argpartition(scores)[..., -K:]
        scores = m.input("index_scores", (bsz, 1, rows, t), F32)
        order = m.b.op("argpartition", [scores], {"kth": t - top_k, "axis": -1})
        return m.b.slice_axis(order, 3, t - top_k, t, hint="top_k")
    picks = np.empty((bsz, 1, rows, top_k), np.int32)
    for i in np.ndindex(bsz, rows):
        first = rng.choice(np.flatnonzero(visible[i[1]]))
        row = np.concatenate([[first], rng.permutation(np.setdiff1d(np.arange(t), [first]))[: top_k - 1]])
        if kind == "idx_dup":
            row[-1] = first  # a repeat of the visible cell: the row keeps its key
        picks[i[0], 0, i[1]] = rng.permutation(row)
    return m.input(kind, picks.shape, I32, picks)


def mla_family(c: Choices) -> Case:
    """Expanded MLA attention over one latent, plain or with DSA's token selection; see the module docstring."""
    m = _Maker(c, "mla")
    b, rng = m.b, m.rng
    dtype = c.pick(FLOATS, (4, 1, 1))
    bsz, h, rows, t = c.int(1, 2), c.pick([2, 1, 4]), c.pick([3, 1, 2, 5, 9]), c.pick([16, 8, 24])
    r, dn, dv = c.pick([8, 4, 16]), c.pick([4, 8]), c.pick([4, 8])
    latent = m.input("latent", (bsz, 1, t, r), dtype, role="resident")
    q = m.input("q", (bsz, h, rows, dn), dtype)
    w_uk = m.input("w_uk", (h, r, dn), dtype, rng.uniform(-1, 1, (h, r, dn)) / np.sqrt(dn))
    w_uv = m.input("w_uv", (h, dv, r), dtype, rng.uniform(-1, 1, (h, dv, r)) / np.sqrt(r))
    c_k = c_v = b.broadcast(latent, (bsz, h, t, r), "latent_heads") if c.flag(0.2) else latent
    if c.flag(0.1):  # near miss: V from another latent
        c_v = m.input("latent_v", (bsz, 1, t, r), dtype)
    k = b.op("matmul", [c_k, w_uk], hint="k")
    v = b.op("matmul", [c_v, b.transpose(w_uv, (0, 2, 1), "w_uv_t")], hint="v")
    operands = {"q": q, "k": k, "v": v}
    visible = np.arange(t)[None, :] <= max(0, t - rows) + np.arange(rows)[:, None]  # [L, T]: causal, last rows
    lowest = float(dtype.finfo.min)
    form = c.pick(["dsa", "none", "additive", "bool"], (5, 2, 2, 1))
    scores = rng.normal(0.0, 0.5, (bsz, h, rows, t))
    if form == "additive":
        operands["mask"] = m.input("mask", scores.shape, dtype, np.where(visible, scores, lowest))
    elif form != "none":
        idx = _selection(m, bsz, rows, t, c.pick([4, 2, t - 1, t]), visible)
        base = b.op("constant", [], {"value": (False,), "shape": (bsz, 1, rows, t), "dtype": BOOL})
        mask = b.op("put_along_axis", [base, idx, b.scalar(True, BOOL, "true")], {"axis": -1}, "selection")
        if form == "dsa":  # an argpartition may pick hidden cells only: then every cell keeps its score
            values = scores if m.graph.node(idx).op != "input" else np.where(visible, scores, lowest)
            fill = m.const(c.pick([lowest, -math.inf, -1e4]), dtype)
            mask = b.op("where", [mask, m.input("mask", scores.shape, dtype, values), fill], hint="sparse_mask")
        operands["mask"] = mask
    attrs = {"scale": c.pick([0.25, None]), "causal": c.pick(["none", "bottom_right"], (9, 1))}
    out = b.op("sdpa", operands, attrs, "attn")
    return m.case("mla", [out, k] if c.flag(0.1) else [out])


# ----------------------------------------------------------------------------- deferred normalisation, combines

NEAR_MISSES = ("other-sum", "other-exp", "plus-one", "weights", "overlap", "other-q", "other-scale")


@dataclass(frozen=True)
class PartialSpec:
    """One ``partial`` graph: parts over ``lens`` keys each (one part: a deferred normalisation; more: a combine in
    ``form`` maxtext, lse or split), GQA ``grouped`` in MaxText's [B, Hkv, G, S, T] layout or by repeated K/V,
    ``rows_first`` ([B, S, ...] as MaxText moves them), the scale on q or on the scores (``divide``: as a
    division), a ``mask`` ("bool" with ``fill``, "additive" or None), a look-alike ``near`` (NEAR_MISSES)."""

    dtype: DType = F32
    batch: int = 1
    hkv: int = 2
    group: int = 2
    rows: int = 3
    d: int = 8
    dv: int = 8
    lens: tuple[int, ...] = (7,)
    scale: float = 0.25
    on_q: bool = False
    divide: bool = False
    grouped: bool = True
    rows_first: bool = False
    with_max: bool = True
    mask: str | None = None
    fill: float = -math.inf
    form: str = "maxtext"
    near: str | None = None
    flatten: bool = False


def build_partial(m: _Maker, spec: PartialSpec) -> str:
    """The output of the graph ``spec`` describes, built in ``m`` (inputs q, k<i>, v<i>, mask<i>, q_other)."""
    b, dtype, c = m.b, spec.dtype, m.c
    bsz, hkv, group, s, d, dv = spec.batch, spec.hkv, spec.group, spec.rows, spec.d, spec.dv
    hq, five = hkv * group, (bsz, hkv, group, s)  # the row axes of a grouped value; else [B, Hq, S]
    q = m.input("q", (bsz, hq, s, d), dtype)

    def attend(i: int, q: str, k: str, v: str, t: int, factor: float) -> tuple[str, str | None, str]:
        """(P·V unnormalised, row max or None, row sum) of one part."""
        if spec.on_q:
            q = _scaled(m, q, factor, dtype, "mul")
        if spec.grouped:
            folded = b.reshape(q, (bsz, hkv, group * s, d), "q_fold")
            scores = b.reshape(b.op("matmul", [folded, b.transpose(k, (0, 1, 3, 2), "kT")]), (*five, t), "s5")
        else:
            kk = b.reshape(b.broadcast(b.reshape(k, (bsz, hkv, 1, t, d), "k5"), (bsz, hkv, group, t, d), "k_rep"),
                           (bsz, hq, t, d), "k_heads")  # fmt: skip
            scores = b.op("matmul", [q, b.transpose(kk, (0, 1, 3, 2), "kT")], hint="scores")
        if not spec.on_q:
            scores = _scaled(m, scores, factor, dtype, "div" if spec.divide else "mul")
        shape = m.graph.node(scores).type.shape
        if spec.mask == "bool":
            mask = _mask_input(m, f"mask{i}", tuple(n if c.flag(0.7) else 1 for n in shape[-2:]), BOOL)
            scores = b.op("where", [mask, scores, m.const(spec.fill, dtype)], hint="masked")
        elif spec.mask == "additive":
            scores = b.op("add", [scores, _mask_input(m, f"mask{i}", shape[-2:], dtype)], hint="biased")
        peak = b.op("max", [scores], {"axes": (-1,), "keepdims": True}, "peak") if spec.with_max else None
        shifted = scores if peak is None else b.op("sub", [scores, peak], hint="shifted")
        e = b.op("exp", [shifted], hint="e")
        total = b.op("sum", [e], {"axes": (-1,), "keepdims": True}, "total")
        if spec.near == "other-exp" and i == 0:  # P·V of exp(s - m - 1)
            e = b.op("exp", [b.op("sub", [shifted, m.const(1.0, dtype)], hint="shifted_more")], hint="e_other")
        if spec.near == "other-sum" and i == 0:  # the sum of exp(2s - m)
            other = b.op("exp", [b.op("add", [shifted, scores], hint="doubled")], hint="e_doubled")
            total = b.op("sum", [other], {"axes": (-1,), "keepdims": True}, "total_other")
        if spec.grouped:
            pv = b.op("matmul", [b.reshape(e, (bsz, hkv, group * s, t), "e_fold"), v], hint="pv")
            pv = b.reshape(pv, (*five, dv), "pv5")
        else:
            vv = b.reshape(b.broadcast(b.reshape(v, (bsz, hkv, 1, t, dv), "v5"), (bsz, hkv, group, t, dv), "v_rep"),
                           (bsz, hq, t, dv), "v_heads")  # fmt: skip
            pv = b.op("matmul", [e, vv], hint="pv")
        if spec.rows_first:  # MaxText moves the rows before the heads: [B, S, Hkv, G, .]
            perm = (0, 3, 1, 2, 4) if spec.grouped else (0, 2, 1, 3)
            pv, total = (b.transpose(x, perm, "rows_first") for x in (pv, total))
            peak = None if peak is None or len(spec.lens) == 1 else b.transpose(peak, perm, "rows_first")
        return pv, peak, total

    outs, keys = [], []
    for i, t in enumerate(spec.lens):
        if spec.near == "overlap" and keys:  # the first part's keys from the second on: they overlap
            t = m.graph.node(keys[0][0]).type.shape[2]
            k, v = (b.slice_axis(x, 2, min(1, t - 1), t, hint="overlap") for x in keys[0])
        else:
            k, v = m.input(f"k{i}", (bsz, hkv, t, d), dtype), m.input(f"v{i}", (bsz, hkv, t, dv), dtype)
        keys.append((k, v))
        qi = m.input("q_other", (bsz, hq, s, d), dtype) if spec.near == "other-q" and i == 1 else q
        factor = spec.scale * (2.0 if spec.near == "other-scale" and i == 1 else 1.0)
        outs.append(attend(i, qi, k, v, m.graph.node(k).type.shape[2], factor))

    def add(xs: list[str]) -> str:
        return functools.reduce(lambda x, y: b.op("add", [x, y], hint="acc"), xs)

    if len(outs) == 1:
        pv, _peak, total = outs[0]
        if spec.near == "plus-one":
            total = b.op("add", [total, m.const(1.0, dtype)], hint="total_plus_one")
        out = b.op("div", [pv, total], hint="out")
    elif spec.form == "maxtext" and spec.with_max:  # exp(m_i - M) / S · u_i with S = Σ exp(m_i - M)·l_i
        peak = functools.reduce(lambda x, y: b.op("maximum", [x, y], hint="global_max"), [o[1] for o in outs])
        weights = [b.op("exp", [b.op("sub", [o[1], peak])], hint="w") for o in outs]
        total = add([b.op("mul", [w, o[2]], hint="weighed_sum") for w, o in zip(weights, outs)])
        if spec.near == "plus-one":
            total = b.op("add", [total, m.const(1.0, dtype)], hint="total_plus_one")
        out = add([b.op("mul", [b.op("div", [w, total]), o[0]], hint="term") for w, o in zip(weights, outs)])
    else:  # normalised parts and their log-sum-exps: Σ exp(lse_i - lse)·o_i, or Σ w_i·o_i / Σ w_i
        normed = [b.op("div", [o[0], o[2]], hint="o") for o in outs]
        logs = [b.op("log", [o[2]], hint="log_sum") for o in outs]
        lses = [x if o[1] is None else b.op("add", [o[1], x], hint="lse") for x, o in zip(logs, outs)]
        peak = functools.reduce(lambda x, y: b.op("maximum", [x, y], hint="lse_max"), lses)
        weights = [b.op("exp", [b.op("sub", [x, peak])], hint="w") for x in lses]
        if spec.form == "split" or spec.near == "weights":
            out = add([b.op("mul", [w, o], hint="term") for w, o in zip(weights, normed)])
            if spec.near != "weights":  # Σ w_i·o_i without dividing by Σ w_i: a look-alike
                out = b.op("div", [out, add(weights)], hint="out")
        else:
            lse = b.op("add", [peak, b.op("log", [add(weights)])], hint="lse_all")
            out = add(
                [b.op("mul", [b.op("exp", [b.op("sub", [x, lse])]), o], hint="term") for x, o in zip(lses, normed)]
            )
    if spec.flatten:  # as an output projection reads it
        shape = m.graph.node(out).type.shape
        out = b.reshape(out, (shape[0], math.prod(shape[1:-1]), shape[-1]), "out_flat")
    return out


def partial_family(c: Choices) -> Case:
    """Deferred normalisation and log-sum-exp combines of partial attentions; see the module docstring."""
    m = _Maker(c, "partial")
    dtype = c.pick(FLOATS, (4, 1, 1))
    parts = c.pick([1, 2, 3], (4, 4, 1))
    near = c.pick([None, *NEAR_MISSES], (16, *(1,) * len(NEAR_MISSES)))
    d = c.pick([8, 4])
    low = float(ml_dtypes.finfo(dtype.numpy).min)
    spec = PartialSpec(
        dtype=dtype, batch=c.int(1, 2), hkv=c.pick([1, 2]), group=c.pick([1, 2, 3]), rows=c.int(1, 5), d=d,
        dv=c.pick([8, 4]), lens=tuple(c.int(1, 6) for _ in range(parts)), scale=c.pick([1 / math.sqrt(d), 0.5, 1.0]),
        on_q=c.flag(0.5), divide=c.flag(0.5), grouped=c.flag(0.6), rows_first=c.flag(0.4),
        with_max=c.flag(0.8) or (parts > 1 and near is None), mask=c.pick([None, "bool", "additive"], (2, 3, 1)),
        fill=c.pick([low, -math.inf, -1e30 if dtype is F32 else low], (3, 1, 2)), form=c.pick(["maxtext", "lse", "split"]),
        near=near, flatten=c.flag(0.5),
    )  # fmt: skip
    return m.case("partial", [build_partial(m, spec)])


FAMILIES: dict[str, Callable[[Choices], Case]] = {
    "sdpa": sdpa_family,
    "chain": chain_family,
    "decomposed": decomposed_family,
    "qsa": qsa_family,
    "mla": mla_family,
    "partial": partial_family,
}
