"""MLA absorption: attention over per-head up-projections of one latent -> attention in the latent space.

Pattern (docs/mla.md): ``sdpa(q, k, v)`` with ``k = matmul(c, W_uk)`` and ``v = matmul(c, W_uv')`` for one
latent ``c`` ``[B, 1, T, R]`` (or ``broadcast_to`` of it to the heads), ``q`` ``[B, H, L, Dn]``, ``k``/``v``
``[B, H, T, Dn|Dv]``, read by nothing else; either projection may be a ``quantized_matmul`` of packed weights
(mlx-lm's ``QuantizedMultiLinear``), whose transposed use is the same op with ``transpose`` flipped.
Rewrite: ``q_lat = matmul(q, W_ukᵀ)`` ``[B, H, L, R]``, ``o = sdpa(q_lat, c, c)`` (one KV head, the same
mask, sinks, causal kind, window, soft-cap and the scale written out: ``None`` was ``1/sqrt(Dn)``),
``out = matmul(o, W_uv')`` ``[B, H, L, Dv]``. The scores
``q·W_uk·c_t`` and the output ``W_uv'·Σ p_t c_t`` are the same sums in another order: the same function,
not bit-exact (measured bound: docs/mla.md, "Numerics").

Cost (multiply-adds, :func:`mla_flops`): absorbed ``H·L·T_eff·2R + H·L·R·(Dn+Dv)``, expanded
``H·T·R·(Dn+Dv) + H·L·T_eff·(Dn+Dv)``, with ``T_eff = K`` when the mask is a token selection ``dsa-gather``
takes (same promises: ``selection_input``, ``rows_have_keys``), else ``T``. It applies when ``L`` is below
``crossover_factor`` times the model's crossover (:func:`mla_crossover`); the factor is measured per device
(:data:`~..analysis.devices.DEVICES`). ``enabled=None`` reads ``ATTNPASS_MLA_ABSORB`` at each run. One remark
per sdpa, with its figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import Graph, Node
from attnpass.ir.dialects.attention import effective_scale

from ..analysis.token_selection import TokenSelection, check_promises, match_token_selection
from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_MLA_ABSORB"


def mla_flops(rows: int, heads: int, kv_len: int, attended: int, rank: int, dn: int, dv: int) -> tuple[int, int]:
    """(absorbed, expanded) multiply-adds of one MLA attention call (the module docstring's model)."""
    absorbed = heads * rows * attended * 2 * rank + heads * rows * rank * (dn + dv)
    expanded = heads * kv_len * rank * (dn + dv) + heads * rows * attended * (dn + dv)
    return absorbed, expanded


def mla_crossover(kv_len: int, attended: int, rank: int, dn: int, dv: int) -> float:
    """The query rows at which both forms cost the same multiply-adds (inf: absorbed is always cheaper)."""
    per_row = attended * (2 * rank - dn - dv) + rank * (dn + dv)
    return math.inf if per_row <= 0 else kv_len * rank * (dn + dv) / per_row


PROJECTIONS = ("matmul", "quantized_matmul")  # c @ W, and c @ W (or Wᵀ) from packed words, scales and biases


@dataclass(frozen=True)
class _Match:
    latent: str
    k: Node  # the projection to K, applied transposed to q
    v: Node  # the projection to V, applied as is to the attention output
    scale: float
    figures: dict


def _latent(graph: Graph, name: str) -> str:
    """The one-head latent behind ``name``: the source of a ``broadcast_to`` along the heads only."""
    node = graph.node(name)
    if node.op == "broadcast_to":
        source = graph.node(node.inputs[0]).type.shape
        shape = node.type.shape
        if len(source) == 4 and source[1] == 1 and (source[0], *source[2:]) == (shape[0], *shape[2:]):
            return node.inputs[0]
    return name


def _swap_last(rw: Rewriter, w: str) -> str:
    """``w`` with its last two axes swapped (the input of a transpose that did exactly that)."""
    rank = rw.type(w).rank
    perm = (*range(rank - 2), rank - 1, rank - 2)
    node = rw.graph.node(w)
    if node.op == "transpose" and tuple(node.attrs["perm"]) == perm:
        return node.inputs[0]
    return rw.transpose(w, perm, f"{w}_t")


@register_pass
@dataclass(frozen=True)
class MLAAbsorb(SwitchedPass):
    """Attend in the latent space where the expansion of K and V over the whole cache costs more."""

    name: ClassVar[str] = "mla-absorb"
    env_var: ClassVar[str] = ENV_VAR
    crossover_factor: float = 1.0
    selection_input: str | None = None
    rows_have_keys: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.crossover_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf:
            raise ValueError(f"MLAAbsorb: crossover_factor must be a finite number > 0, got {f!r}")
        check_promises("MLAAbsorb", self.selection_input, self.rows_have_keys)

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rule = Rule("mla-absorb", "sdpa", self._match, _rewrite, _describe)
        return bool(apply_rules(graph, [rule], remarks, decline_all=self.disabled()))

    def _match(self, graph: Graph, node: Node) -> _Match | Decline:
        """The latent and weights, or why K and V are kept expanded (with the figures)."""
        q, k, v = graph.node(node.q), graph.node(node.k), graph.node(node.v)
        if k.op not in PROJECTIONS or v.op not in PROJECTIONS:
            return Decline(
                "not_latent",
                f"k is {k.op} {k.name} and v is {v.op} {v.name}: not matmul(latent, W_uk) and matmul(latent, W_uv) "
                "(or quantized_matmul)",
            )
        latent_k, latent_v = _latent(graph, k.inputs[0]), _latent(graph, v.inputs[0])
        if latent_k != latent_v:
            return Decline("not_latent", f"k projects {latent_k} and v projects {latent_v}: not one shared latent")
        latent = graph.node(latent_k).type
        (b, h, rows, dn), t, dv = q.type.shape, k.type.shape[2], v.type.shape[3]
        if latent.rank != 4 or latent.shape[0] != b or latent.shape[1] not in (1, h) or k.type.shape[1] != h:
            return Decline(
                "shape_mismatch",
                f"latent {latent_k} is {latent} and k is {k.type} under q {q.type}: the absorbed form needs a "
                f"latent [B, 1 or H, T, R] with B={b} and k with the query heads H={h}",
            )
        for x in (k, v):
            others = sorted({u.name for u in graph.users(x.name)} - {node.name})
            if others or x.name in graph.outputs:
                return Decline(
                    "other_readers",
                    f"{x.name} is also read by {', '.join(others) or 'the graph outputs'}: the expansion stays",
                )
        rank = latent.shape[3]
        selection = match_token_selection(
            graph, node, selection_input=self.selection_input, rows_have_keys=self.rows_have_keys
        )
        attended = selection.top_k if isinstance(selection, TokenSelection) else t
        absorbed, expanded = mla_flops(rows, h, t, attended, rank, dn, dv)
        model = mla_crossover(t, attended, rank, dn, dv)
        crossover = model * self.crossover_factor
        figures = {
            "rows": rows, "heads": h, "kv_len": t, "attended": attended, "rank": rank, "dn": dn, "dv": dv,
            "latent_heads": latent.shape[1], "selection": isinstance(selection, TokenSelection),
            "crossover_model": model, "crossover_factor": self.crossover_factor, "crossover": crossover,
            "absorbed_flops": absorbed, "expanded_flops": expanded,
        }  # fmt: skip
        if not rows < crossover:
            return Decline(
                "little_gain",
                f"expansion kept: {rows} query rows >= crossover {crossover:.1f} (FLOP model {model:.1f} x device "
                f"factor {self.crossover_factor:g}; T={t}, T_eff={attended}, R={rank}, Dn={dn}, Dv={dv}): "
                f"absorbed {absorbed} vs expanded {expanded} multiply-adds",
                data=figures,
            )
        return _Match(latent_k, k, v, effective_scale(node.attrs["scale"], dn), figures)


def _describe(m: _Match) -> tuple[str, dict]:
    f = m.figures
    attended = f"T_eff=K={f['attended']} (a token selection dsa-gather takes)" if f["selection"] else "T_eff=T"
    return (
        f"absorbed: {f['rows']} query rows < crossover {f['crossover']:.1f} (FLOP model {f['crossover_model']:.1f} "
        f"x device factor {f['crossover_factor']:g}; T={f['kv_len']}, {attended}, R={f['rank']}, Dn={f['dn']}, "
        f"Dv={f['dv']}, H={f['heads']}): absorbed {f['absorbed_flops']} vs expanded {f['expanded_flops']} "
        f"multiply-adds; q·W_ukᵀ [B, H, L, {f['rank']}], one sdpa over the latent {m.latent} as K and V, then "
        f"·W_uv; not bit-exact: the same sums in another order (bound: docs/mla.md, Numerics)"
    ), f


def _project(rw: Rewriter, x: str, by: Node, *, transposed: bool, hint: str) -> str:
    """``x`` through the weights of projection ``by`` (``c @ W``), or through their transpose."""
    if by.op == "quantized_matmul":
        attrs = {**by.attrs, "transpose": by.attrs["transpose"] != transposed}
        return rw.op("quantized_matmul", {**by.operands, "x": x}, attrs, hint)
    return rw.op("matmul", [x, _swap_last(rw, by.b) if transposed else by.b], hint=hint)


def _rewrite(rw: Rewriter, m: _Match) -> None:
    """q into the latent space, one sdpa over the latent, the output up-projected."""
    node = rw.anchor
    q_lat = _project(rw, node.q, m.k, transposed=True, hint="q_latent")
    operands = {**node.operands, "q": q_lat, "k": m.latent, "v": m.latent}
    out = rw.op("sdpa", operands, {**node.attrs, "scale": m.scale}, "sdpa_latent")
    rw.replace_matched(_project(rw, out, m.v, transposed=False, hint="mla_out"))


__all__ = ["ENV_VAR", "MLAAbsorb", "mla_crossover", "mla_flops"]
