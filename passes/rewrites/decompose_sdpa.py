"""Device-aware attention strategy: keep the fused ``sdpa`` or decompose it into a GQA-folded form.

The decomposed form of ``sdpa(q[B,Hq,S,D], k[B,Hkv,T,D], v[B,Hkv,T,Dv], mask)`` with ``G = Hq / Hkv``,
computed in float32 (half operands cast first, the result cast back)::

    scores = (k @ (q.reshape(B, Hkv, G*S, D) * scale)^T)^T  # one matmul per KV head, K read once
    scores = c * tanh(scores / c)                           # logit_softcap c, when set
    scores = where(mask, scores, lowest) | scores + mask     # viewed as [B, Hkv, G, S, T]
    out    = softmax(scores) @ v -> reshape(B, Hq, S, Dv)   # sinks: softmax(concat([sink, scores]))[..., 1:]

It is the fused call's math with each KV group's query heads folded into the rows of one matmul, so K/V
are never repeated per query head; a bool mask fills with float32's lowest finite value as the fused
kernels do (a row without keys is the mean of V), an additive one is added (docs/semantics.md §4).

On MLX's CPU (``device="cpu"``, ``target="mlx"``) the fused call is MLX's fallback, whose ops the
decomposition then repeats in the inputs' dtype (``q * scale`` with the scale in that dtype, ``q @ k^T``, the
dtype's lowest as the fill, the sinks cast to that dtype as the softmax's first column, a precise softmax,
``@ v``; no other cast), GQA-folded: the fused call's bits, and no float32 copy of K and V. A call with a
softcap (MLX's call has none), or an additive mask of another dtype, keeps the float32 form. The sink column
comes first in every form, as in MLX's fallback: MLX's CPU softmax sums the row's exponentials in order, so a
sink appended last rounds the denominator differently (its float32 probabilities 1-4 steps off).

Per ``device`` (the remark of every ``sdpa`` says which strategy and why; it names the backend when
``target`` is ``"mlx"`` or ``"jax"``): ``"cpu"`` decomposes calls with at most ``max_q_len`` rows (no
fused CPU kernel; MLX's CPU fallback repeats K/V per query head, docs/semantics.md §4); ``"metal"`` keeps
what MLX's fused Metal vector kernel serves (:mod:`..analysis.devices`) and decomposes the other
decode-shaped calls; ``"gpu"`` and ``"tpu"`` keep every call. Calls with a ``causal`` attribute, a window
or more than ``max_q_len`` rows stay fused on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node, require_int
from attnpass.ir.dialects.attention import effective_scale, sdpa_variants

from ..analysis.devices import DEVICES, METAL_VECTOR_BUDGET, METAL_VECTOR_MAX_ROWS, metal_vector_serves
from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

TARGETS = ("mlx", "jax")
UNREACHABLE = {("metal", "jax"): "the metal strategy is MLX's Metal kernel model", ("tpu", "mlx"): "MLX has no TPU"}
# Why the fused call stays on a GPU, and why CPU decode is decomposed, per target (None: any target)
GPU_FUSED = {
    "jax": "jax.nn.dot_product_attention lowers to XLA's or cuDNN's fused attention on GPU",
    "mlx": "mx.fast.scaled_dot_product_attention runs MLX's own CUDA attention (not measured here)",
    None: "each GPU target runs its own fused attention call (not measured here)",
}
CPU_UNFUSED = {
    "jax": "XLA has no fused CPU attention kernel",
    "mlx": "MLX has no fused CPU attention kernel; its CPU fallback broadcasts K/V to every query head",
    None: "no fused attention kernel on CPU",
}


@dataclass(frozen=True)
class _Plan:
    reason: str
    fused_rounding: bool  # each step as MLX's CPU fallback rounds it, in the inputs' dtype (else in float32)
    dtype: str  # the dtype the decomposition computes in

    def describe(self) -> tuple[str, dict[str, str]]:
        """The remark: the reason, with the rounding (``fused``: MLX's CPU fallback's own ops) and the dtype."""
        return self.reason, {"rounding": "fused" if self.fused_rounding else "float32", "dtype": self.dtype}


def _mask_keeps_dtype(graph: Graph, node: Node) -> bool:
    """Whether ``node``'s mask has no dtype of its own (none, bool, or the queries' dtype), so the scores keep
    theirs: without a softcap, the decomposition can then round as MLX's CPU fallback does."""
    mask = node.mask
    return mask is None or graph.node(mask).type.dtype in (DType.bool, graph.node(node.q).type.dtype)


def _metal_vector_kernel(q_len: int, gqa: int, d: int, dv: int, kv_len: int) -> str | None:
    """Why MLX's Metal vector kernel serves this call, or None when it takes the unfused fallback."""
    if metal_vector_serves(q_len, gqa, d, dv, kv_len):
        return (
            f"q_len {q_len} <= {METAL_VECTOR_MAX_ROWS}, q_len*gqa = {q_len * gqa} <= {METAL_VECTOR_BUDGET}, "
            f"head dims {d}/{dv}: MLX's fused vector kernel"
        )
    return None


QUANTIZED_LOWERING = (
    "kept: its lowering is already GQA-folded, the query heads of each kv head the rows of one "
    "quantized_matmul over the packed keys and one over the packed values (K/V never dequantized as a whole)"
)
QUANTIZED_FLOAT32 = (
    "quantized_sdpa: precision float32 (device cpu): MLX's CPU quantized_matmul adds {dtype} products one by one "
    "in {dtype}; q, the scales and biases are widened to float32 exactly and every step runs in float32, the "
    "result rounded once to {dtype} (the packed words and the GQA fold as they were)"
)


@register_pass
@dataclass(frozen=True)
class DecomposeSDPA(Pass):
    """Per ``device``, rewrite decode-shaped ``sdpa`` into GQA-folded matmul/softmax, or keep it fused: on MLX's
    CPU (``device="cpu"``, ``target="mlx"``) in the fused call's own rounding, elsewhere in float32."""

    name: ClassVar[str] = "decompose-sdpa"
    device: str = "cpu"
    max_q_len: int = 8
    target: str | None = None
    # on CPU, a half-float quantized_sdpa computed in float32: faster with MLX's CPU kernel, not the model's bits
    widen_quantized: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"DecomposeSDPA: device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.target is not None and self.target not in TARGETS:
            raise ValueError(f"DecomposeSDPA: target must be one of {', '.join(TARGETS)} or None, got {self.target!r}")
        if (self.device, self.target) in UNREACHABLE:
            raise ValueError(
                f"DecomposeSDPA: device {self.device!r} with target {self.target!r}: "
                f"{UNREACHABLE[self.device, self.target]}"
            )
        require_int("DecomposeSDPA", "max_q_len", self.max_q_len)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rule = Rule("decompose-sdpa", "sdpa", self._match, _rewrite, _Plan.describe)
        widened = self._quantized_float32(graph, remarks)
        for node in graph.nodes():
            if node.op == "quantized_sdpa" and node.name not in widened:
                remarks.declined(node.name, f"quantized_sdpa: {QUANTIZED_LOWERING}", node.loc, reason="already_done")
        return bool(apply_rules(graph, [rule], remarks)) or bool(widened)

    def _quantized_float32(self, graph: Graph, remarks: Remarks) -> frozenset[str]:
        """With ``widen_quantized`` on CPU, a half-float ``quantized_sdpa`` computes in float32 (``precision``):
        MLX's CPU kernel sums half-float products in half floats, several times slower; the result is not the
        model's own bits, so it is an explicit choice. Returns the new nodes."""
        if self.device != "cpu" or not self.widen_quantized:
            return frozenset()
        changed: set[str] = set()
        for node in list(graph.nodes()):
            dtype = node.type.dtype
            if node.op != "quantized_sdpa" or dtype is DType.float32 or node.attrs["precision"] == "float32":
                continue
            rw = Rewriter(graph, node)
            attrs = {**node.attrs, "precision": "float32"}
            out = rw.op("quantized_sdpa", node.operands, attrs, f"{node.name}_f32")
            rw.replace_matched(out)
            remarks.applied(out, QUANTIZED_FLOAT32.format(dtype=dtype.value), node.loc)
            changed.add(out)
        return frozenset(changed)

    def _match(self, graph: Graph, node: Node) -> _Plan | Decline:
        q, k, v = (graph.node(name).type.shape for name in (node.q, node.k, node.v))
        (_b, hq, s, d), (_bk, hkv, t, _dk), dv = q, k, v[3]
        gqa = hq // hkv
        on = f"device {self.device}" + (f", target {self.target}" if self.target else "")
        head = f"strategy fused ({on}): "
        if self.device == "gpu":
            return Decline("fused_kernel_serves", head + GPU_FUSED[self.target])
        if self.device == "tpu":
            return Decline("fused_kernel_serves", head + "XLA compiles jax.nn.dot_product_attention for the TPU itself")
        if node.attrs["causal"] != "none":
            return Decline(
                "unsupported_variant",
                head + f"causal={node.attrs['causal']!r} stays with the fused call (no [S, T] constant)",
            )
        if node.attrs["window"] is not None:
            window = tuple(node.attrs["window"])
            return Decline(
                "unsupported_variant", head + f"window={window} stays with the fused call (no [S, T] constant)"
            )
        if s > self.max_q_len:
            return Decline(
                "too_many_rows",
                head + f"q_len {s} > max_q_len={self.max_q_len}: prefill-shaped, the score plane dominates",
            )
        variants = sdpa_variants(node)
        fused_rounding = (
            self.device == "cpu"
            and self.target == "mlx"
            and node.attrs["logit_softcap"] is None  # MLX's fused call has no softcap: nothing to repeat
            and _mask_keeps_dtype(graph, node)
        )
        rows = f"GQA-folded: the {gqa}*{s} query rows of each of {hkv} KV heads in one matmul over its {t} keys "
        dtype = graph.node(node.q).type.dtype.value if fused_rounding else "float32"
        if fused_rounding:
            sink = ", the sink column first" if node.sinks is not None else ""
            folded = rows + (
                f"(q @ k^T){sink}, precise softmax, @ v, in {dtype}: MLX's CPU fallback's own ops, bit for bit"
            )
        else:
            folded = rows + "(k @ q^T), softmax, @ v, in float32"
        if self.device == "metal":
            served = _metal_vector_kernel(s, gqa, d, dv, t)
            if served is not None:
                return Decline("fused_kernel_serves", head + served)
            why = f"q_len {s}, gqa {gqa}, head dims {d}/{dv}: MLX's Metal vector kernel does not serve it"
        else:
            why = CPU_UNFUSED[self.target]
        extra = f"; {variants} written out (a sink: one more softmax column, dropped before @ v)" if variants else ""
        return _Plan(f"strategy decomposed ({on}): {why}; {folded}{extra}", fused_rounding, dtype)


def _rewrite(rw: Rewriter, plan: _Plan) -> None:
    """The GQA-folded form: in float32, or with ``plan.fused_rounding`` in the inputs' dtype with each op the one
    MLX's CPU fallback of the fused call runs (``q * scale`` with the scale in that dtype, ``q @ k^T``, the mask,
    the sinks as the first column, a precise softmax, ``@ v``). The fold only makes the query heads of a KV head
    rows of one matmul, and MLX's CPU matmul computes each row alone, so that form is the fused call's, bit for
    bit (tests/passes/rewrites/test_decompose_sdpa.py), without a float32 copy of K and V."""
    node = rw.anchor
    dtype = rw.type(node.q).dtype if plan.fused_rounding else DType.float32
    q, k, v = (rw.cast(x, dtype, f"{x}_f32") for x in (node.q, node.k, node.v))
    (b, hq, s, d), (_bk, hkv, t, _dk) = rw.type(q).shape, rw.type(k).shape
    g, dv = hq // hkv, rw.type(v).shape[3]
    scale = effective_scale(node.attrs["scale"], d)
    folded = rw.op("mul", [rw.reshape(q, (b, hkv, g * s, d), "q_folded"), rw.scalar(scale, dtype, "scale")])
    if plan.fused_rounding:  # MLX's fallback's product
        scores = rw.op("matmul", [folded, rw.transpose(k, (0, 1, 3, 2), "k_t")], hint="scores")
    else:  # k @ q^T, then the small [T, G*S] result transposed: K is read in its own layout (q @ k^T made XLA
        # transpose all of K first, twice as slow at decode)
        scores_t = rw.op("matmul", [k, rw.transpose(folded, (0, 1, 3, 2), "q_t")], hint="scores_t")
        scores = rw.transpose(scores_t, (0, 1, 3, 2), "scores")
    cap = node.attrs["logit_softcap"]
    if cap is not None:
        c = rw.scalar(cap, dtype, "cap")
        capped = rw.op("tanh", [rw.op("div", [scores, c], hint="scores")], hint="scores")
        scores = rw.op("mul", [capped, c], hint="scores")
    mask, sinks = node.mask, node.sinks
    if mask is not None:
        scores = _masked(rw, rw.reshape(scores, (b, hkv, g, s, t), "scores"), mask, hkv, g, dtype)
    if sinks is not None:  # one more softmax column per query head, first as in MLX's fallback, dropped before @ v
        sink = rw.reshape(rw.cast(sinks, dtype, "sinks"), (1, hkv, g, 1, 1), "sinks")
        column = rw.broadcast(sink, (b, hkv, g, s, 1), "sinks")
        scores = rw.concat([column, rw.reshape(scores, (b, hkv, g, s, t), "scores")], 4, "scores")
    probs = rw.op("softmax", [scores], {"axis": -1, "precise": plan.fused_rounding}, "probs")
    if sinks is not None:
        probs = rw.slice_axis(probs, 4, 1, t + 1, hint="probs")
    out = rw.op("matmul", [rw.reshape(probs, (b, hkv, g * s, t), "probs"), v], hint="attended")
    rw.replace_matched(rw.cast(rw.reshape(out, (b, hq, s, dv), "attended"), node.type.dtype, f"{node.name}_out"))


def _masked(rw: Rewriter, scores: str, mask: str, hkv: int, g: int, dtype: DType) -> str:
    """Scores ``[B, Hkv, G, S, T]`` of ``dtype`` with the sdpa mask applied (bool: the dtype's lowest where False;
    additive: added, cast to the dtype)."""
    shape = rw.type(mask).shape
    mb, mh, ms, mt = (1,) * (4 - len(shape)) + shape
    mask = rw.reshape(mask, (mb, 1, 1, ms, mt) if mh == 1 else (mb, hkv, g, ms, mt), "mask_folded")
    if rw.type(mask).dtype is DType.bool:
        # finite, as the fused kernels fill: a row with no key is the mean of V, not NaN
        lowest = rw.scalar(float(dtype.finfo.min), dtype, "lowest")
        return rw.op("where", [mask, scores, lowest], hint="scores")
    return rw.op("add", [scores, mask if rw.type(mask).dtype is dtype else rw.cast(mask, dtype)], hint="scores")


__all__ = ["DecomposeSDPA", "TARGETS"]
