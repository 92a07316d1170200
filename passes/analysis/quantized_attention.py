"""Raise mlx-lm's attention over a quantized KV cache to ``quantized_sdpa`` (a rule of ``raise-attention``).

mlx-lm's ``quantized_scaled_dot_product_attention`` computes, over K and V held as
(packed words, scales, biases)::

    q = q * scale
    s = quantized_matmul(q, K, transpose=True)            # GQA: q [B, Hkv, G, S, D], K [B, Hkv, 1, T, .]
    s = where(mask, s, finfo(dtype).min)  or  s + mask     # optional
    out = quantized_matmul(softmax(s, precise=True), V, transpose=False)

:func:`match_quantized_attention` starts at the ``P·V`` quantized_matmul and
checks exactly that structure, op by op: the scores are a quantized_matmul
with the keys (same group size and bits), the softmax normalises the key axis
in at least float32, a bool mask fills with the dtype's lowest finite value,
q is split ``[B, Hq, S, D] -> [B, Hkv, G, S, D]`` (query head ``h = hkv * G + g``)
and each of the six K/V arrays is a ``[B, Hkv, T, .]`` root with a unit axis
inserted at 2 (and broadcast to G), so query head ``h`` reads kv head ``h // G``.
A scale is taken from ``mul`` by a splat only (``q * c`` rounds as
quantized_sdpa's ``q * scale``; a division would not). Anything else declines
with the reason and the node. The rewrite is exact: ``quantized_sdpa`` is
defined as these ops (docs/semantics.md §1.5).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnpass.ir import DType, Graph, Node, get_op

from ..infra.base import Remarks
from ..infra.rewrite import Decline, Rewriter
from .chains import scalar_constant


@dataclass(frozen=True)
class QuantizedAttention:
    """A proven quantized attention: its operands and attributes, and how the mask reaches [B, Hq, S, T]."""

    pv: Node
    q: str
    kv: tuple[str, ...]  # kq, ks, kb, vq, vs, vb
    mask: str | None
    mask_steps: tuple[tuple[str, tuple[int, ...]], ...]  # ("broadcast" | "reshape", shape): mask to [B, Hq, S, T]
    scale: float
    group_size: int
    bits: int
    heads: tuple[int, int]  # Hq, Hkv

    @property
    def summary(self) -> str:
        hq, hkv = self.heads
        mask = "none" if self.mask is None else "yes"
        return (
            f"{hq} query heads on {hkv} kv heads, {self.bits}-bit K/V in groups of {self.group_size}, "
            f"scale {self.scale:g}, mask {mask}"
        )

    @property
    def figures(self) -> dict:
        """What :attr:`summary` states, by name (Remark.data)."""
        hq, hkv = self.heads
        return {"q_heads": hq, "kv_heads": hkv, "bits": self.bits, "group_size": self.group_size, "scale": self.scale,
                "mask": self.mask}  # fmt: skip


def _kv_root(graph: Graph, value: str, lead: tuple[int, int], groups: int, folded: bool) -> str | Decline:
    """The ``[B, Hkv, T, .]`` root of one K/V operand: itself (no GQA), or a reshape inserting a unit axis at 2,
    broadcast to ``groups`` there."""
    if not folded:
        shape = graph.node(value).type.shape
        return (
            value
            if shape[:2] == lead
            else Decline("shape_mismatch", f"{value} {list(shape)} does not lead with q's [B, H] {list(lead)}")
        )
    node = graph.node(value)
    if node.op == "broadcast_to":
        node = graph.node(node.inputs[0])
    root = graph.node(node.inputs[0]) if node.op == "reshape" else None
    if root is None or root.type.rank != 4 or node.type.shape != root.type.shape[:2] + (1,) + root.type.shape[2:]:
        return Decline(
            "shape_mismatch",
            f"{value} is not a [B, Hkv, T, .] array with a unit axis inserted at 2 (mlx-lm's GQA form)",
        )
    if root.type.shape[:2] != lead:
        return Decline(
            "shape_mismatch", f"{root.name} {list(root.type.shape)} does not lead with [B, Hkv] = {list(lead)}"
        )
    return root.name


def match_quantized_attention(graph: Graph, pv: Node) -> QuantizedAttention | Decline | None:
    """``quantized_matmul(softmax(scores), V)`` proven mlx-lm's quantized attention, or why not (None: no softmax)."""
    if pv.attrs["transpose"] or graph.node(pv.x).op != "softmax":
        return None
    soft = graph.node(pv.x)
    dtype = soft.type.dtype
    if soft.attrs["axis"] not in (-1, soft.type.rank - 1):
        return Decline(
            "axes_mismatch", f"the softmax normalises axis {soft.attrs['axis']}, not the key axis", soft.name
        )
    if not soft.attrs["precise"] and dtype is not DType.float32:
        return Decline(
            "inexact", f"a {dtype.value} softmax without precise=True (quantized_sdpa's runs in float32)", soft.name
        )
    x = graph.node(soft.x)
    mask = None
    if x.op == "where":
        cond, scores_name, fill = x.inputs
        lowest = float(dtype.finfo.min)
        if graph.node(cond).type.dtype is not DType.bool or scalar_constant(graph, fill) != lowest:
            return Decline(
                "mask_form", f"not where(bool mask, scores, {lowest:g}) (mlx-lm's fill, the dtype's lowest)", x.name
            )
        mask, x = cond, graph.node(scores_name)
    elif x.op == "add":
        operands = [graph.node(i) for i in x.inputs]
        found = [i for i, n in enumerate(operands) if n.op == "quantized_matmul" and n.attrs["transpose"]]
        if not found or operands[1 - found[0]].type.dtype is not dtype:
            return Decline("mask_form", f"not scores + an additive mask in {dtype.value}", x.name)
        mask, x = operands[1 - found[0]].name, operands[found[0]]
    if x.op != "quantized_matmul" or not x.attrs["transpose"]:
        return Decline(
            "not_attention", "the softmax's scores are not a quantized_matmul with the keys (transpose=True)", x.name
        )
    attrs = {k: pv.attrs[k] for k in ("group_size", "bits")}
    if {k: x.attrs[k] for k in attrs} != attrs:
        return Decline(
            "shape_mismatch", f"the scores' quantization {x.attrs} differs from the values' {pv.attrs}", x.name
        )
    folded = x.type.rank == 5
    qv = graph.node(x.x)
    if folded:
        if qv.op != "reshape":
            return Decline("shape_mismatch", "the grouped queries are not a reshape of [B, Hq, S, D]", qv.name)
        b, hkv, groups, s, d = qv.type.shape
        qv = graph.node(qv.inputs[0])
        if qv.type.shape != (b, hkv * groups, s, d):
            return Decline(
                "shape_mismatch",
                f"{qv.name} {list(qv.type.shape)} is not split into [B, Hkv, G, S, D] heads-major",
                qv.name,
            )
    elif x.type.rank == 4:
        b, hkv, s, d = qv.type.shape
        groups = 1
    else:
        return Decline(
            "shape_mismatch",
            f"scores of rank {x.type.rank}: mlx-lm's are [B, H, S, T] or, GQA, [B, Hkv, G, S, T]",
            x.name,
        )
    kv = []
    for value in (x.wq, x.scales, x.biases, pv.wq, pv.scales, pv.biases):
        root = _kv_root(graph, value, (b, hkv), groups, folded)
        if isinstance(root, Decline):
            return root
        kv.append(root)
    scale, q = 1.0, qv.name
    if qv.op == "mul":
        for i in (0, 1):
            c = scalar_constant(graph, qv.inputs[i])
            if c is not None and graph.node(qv.inputs[1 - i]).type == qv.type:
                scale, q = c, qv.inputs[1 - i]
                break
    steps: tuple[tuple[str, tuple[int, ...]], ...] = ()
    source = None if mask is None else graph.node(mask)
    source = graph.node(source.inputs[0]) if source is not None and source.op == "broadcast_to" else source
    if source is not None and not folded:
        mask = source.name  # broadcasts to the scores [B, H, S, T] as it did
    elif source is not None:
        lifted = (1,) * (5 - source.type.rank) + source.type.shape
        if lifted[1] == lifted[2] == 1:  # one mask for every head: drop the unit group axis
            mask, steps = source.name, (("reshape", (lifted[0], 1, lifted[3], lifted[4])),)
        else:  # per head: the mask over the scores' [B, Hkv, G, S, T], unfolded to [B, Hq, S, T]
            steps = (("broadcast", x.type.shape), ("reshape", (b, hkv * groups, s, x.type.shape[-1])))
    heads = (hkv * groups, hkv)
    return QuantizedAttention(pv, q, tuple(kv), mask, steps, scale, attrs["group_size"], attrs["bits"], heads)


def rewrite_quantized_attention(rw: Rewriter, m: QuantizedAttention) -> None:
    name = m.pv.name
    operands = dict(zip(get_op("quantized_sdpa").required, (m.q, *m.kv)))
    if m.mask is not None:
        mask = m.mask
        for step, shape in m.mask_steps:
            mask = (rw.broadcast if step == "broadcast" else rw.reshape)(mask, shape, f"{name}_mask")
        operands["mask"] = mask
    attrs = {"scale": m.scale, "group_size": m.group_size, "bits": m.bits}
    out = rw.op("quantized_sdpa", operands, attrs, f"{name}_qsdpa")
    rw.replace_matched(rw.reshape(out, m.pv.type.shape, f"{name}_out"), prune=True)


def decline_quantized(graph: Graph, remarks: Remarks, message: str) -> None:
    """One declined remark per ``quantized_sdpa``: the pass does not carry quantized K/V operands, and why."""
    for node in graph.nodes():
        if node.op == "quantized_sdpa":
            remarks.declined(node.name, f"quantized_sdpa: {message}", node.loc, reason="quantized_operands")


NOT_CARRIED = "{} does not carry quantized K/V (packed words, scales and biases); the call is left as it is"

__all__ = [
    "NOT_CARRIED", "QuantizedAttention", "decline_quantized", "match_quantized_attention", "rewrite_quantized_attention",
]  # fmt: skip
