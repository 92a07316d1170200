"""shard-attention: annotate attention so that a device mesh runs it without moving K/V.

Options name mesh axes declared on the graph (``Graph.set_mesh``, ``attnpass run --mesh``): ``heads`` splits
the KV heads (the axis size must divide the KV-head count, so every device holds whole KV groups), ``batch`` the
streams, ``seq`` the keys (via split-kv, one shard per device; not combined with ``batch``). One remark per
attention: applied, with what each device holds (KV heads, streams, keys, and the bytes per device of each
K/V root that is a graph input), or declined with the precondition that failed.

Forms: a plain ``sdpa`` (annotated on its operands and, through layout ops that keep every sharded dimension
whole, on the values that hold the bytes; any other layout op declines, naming the dimension it breaks), a
head-chunked attention under ``heads`` (regrouped into one sdpa per chunk position over all KV groups) and a
gathered QSA attention. The indexer stays unannotated: each device computes the selection itself. Values that
read annotated ones elementwise or through whole-dimension layout ops inherit their sharding (one ``analysis``
remark). In full: docs/passes.md, "shard-attention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from attnpass.ir import Graph, Node, format_slice
from attnpass.ir.core.sharding import Sharding, format_sharding, normalize_sharding
from attnpass.ir.dialects.attention import sdpa_variants

from ..analysis.quantized_attention import NOT_CARRIED, decline_quantized
from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules
from .split_kv import Labels, Place, SplitPlan, gathers_qsa_cells, is_split_partial, match_split, rewrite_split

QKV_LABELS = ("batch", "heads", None, None)
PROPAGATING = frozenset({"add", "sub", "mul", "div", "maximum", "cast", "concat"})
BACKWARD = frozenset(
    {"slice", "take", "cast", "transpose", "reshape", "broadcast_to", "dynamic_update_slice", "qsa_gather"}
)


@dataclass(frozen=True)
class _Plan:
    """One attention to shard: what to annotate, how to rewrite, and the remark."""

    q: str
    k: str
    v: str
    mask: str | None
    chunks: tuple[tuple[int, int], ...] | None  # head-chunk regroup: query-head offsets within a KV group
    split: SplitPlan | None
    values: tuple[tuple[str, Sharding], ...]  # existing values and their new annotations
    message: str


@register_pass
@dataclass(frozen=True)
class ShardAttention(Pass):
    """Annotate attention for a device mesh: KV heads (``heads``), streams (``batch``) and keys (``seq``)."""

    name: ClassVar[str] = "shard-attention"
    heads: str | None = None
    batch: str | None = None
    seq: str | None = None

    def __post_init__(self) -> None:
        named = [a for a in (self.heads, self.batch, self.seq) if a is not None]
        if not named:
            raise ValueError("ShardAttention: name at least one mesh axis (heads=, batch= or seq=)")
        if len(set(named)) != len(named):
            raise ValueError(f"ShardAttention: heads, batch and seq must be different mesh axes, got {named}")

    def _axis(self, label: str) -> str | None:
        """The mesh axis of a dimension label ("heads", "batch", "shard"), None when not sharded."""
        return {"heads": self.heads, "batch": self.batch, "shard": self.seq}[label]

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rules = [
            Rule("head-chunked", "concat", self._match_group, self._rewrite, lambda p: p.message),
            Rule("sdpa", "sdpa", self._match_sdpa, self._rewrite, lambda p: p.message),
        ]
        decline_quantized(graph, remarks, NOT_CARRIED.format(self.name))
        hits = apply_rules(graph, rules, remarks)
        inherited = _propagate(graph) if hits else 0
        if inherited:
            remarks.analysis(
                None,
                f"{inherited} value(s) inherited the sharding of what they read elementwise, concatenate, "
                "transpose or reshape",
                reason="sharding_propagated",
            )
        return bool(hits)

    # ------------------------------------------------------------------ matching

    def _size(self, graph: Graph, label: str) -> int:
        axis = self._axis(label)
        return 1 if axis is None else graph.mesh_axes[axis]

    def _undeclared(self, graph: Graph) -> Decline | None:
        missing = [a for a in (self.heads, self.batch, self.seq) if a is not None and a not in graph.mesh_axes]
        if not missing:
            return None
        declared = ", ".join(f"{a}={n}" for a, n in graph.mesh_axes.items()) or "none"
        return Decline(
            "mesh_axis_missing",
            f"mesh axis {', '.join(missing)} is not declared on the graph (mesh: {declared}); "
            "declare it with Graph.set_mesh or attnpass run --mesh AXIS=SIZE",
        )

    def _match_sdpa(self, graph: Graph, node: Node) -> _Plan | Decline | None:
        if self.heads is not None and _chunk_subcalls(graph, _sole_user(graph, node)) is not None:
            return None  # a head-chunk subcall: decided with its group at the concat
        if is_split_partial(graph, node):
            return Decline(
                "already_done", "a split-KV partial (its sdpa_lse companion reads the same operands): already split"
            )
        variants = sdpa_variants(node)
        if variants:
            return Decline("unsupported_variant", f"{variants}: shard-attention does not carry them")
        return self._undeclared(graph) or self._plan(graph, node, node.q, node.k, node.v, node.mask, None, node)

    def _match_group(self, graph: Graph, node: Node) -> _Plan | Decline | None:
        if self.heads is None:
            return None
        calls = _chunk_subcalls(graph, node)
        if calls is None:
            return None
        variants = sdpa_variants(calls[0])
        if variants:
            return Decline("unsupported_variant", f"{variants}: shard-attention does not carry them")
        group = _head_chunk_group(graph, node, calls)
        if isinstance(group, Decline):
            return group
        (q, k, v, mask), chunks = group
        return self._undeclared(graph) or self._plan(graph, node, q, k, v, mask, chunks, calls[0])

    def _plan(
        self,
        graph: Graph,
        anchor: Node,
        q: str,
        k: str,
        v: str,
        mask: str | None,
        chunks: tuple[tuple[int, int], ...] | None,
        call: Node,
    ) -> _Plan | Decline:
        """Preconditions and the annotations of one attention (a plain sdpa, or a head-chunked group)."""
        b, hq, _s, _d = graph.node(q).type.shape
        hkv = graph.node(k).type.shape[1]
        h, nb, ns = (self._size(graph, label) for label in ("heads", "batch", "shard"))
        if hkv % h:
            return Decline(
                "not_divisible",
                f"heads: mesh axis {self.heads} has {h} devices but the attention has {hkv} KV head(s): {h} does "
                f"not divide {hkv}, so a device would hold part of a KV group (GQA groups are not split; "
                "shard the keys with seq= instead)",
            )
        stray = next((x for x in (graph.node(k), graph.node(v)) if gathers_qsa_cells(graph, x)), None)
        if stray is not None:
            return Decline(
                "gather_form",
                f"{stray.name} gathers the QSA cells by {stray.op}, not by qsa_gather (qsa-gather's form), so the "
                "caches it reads cannot keep streams and KV heads on their devices",
            )
        gathered = graph.node(k).op == "qsa_gather"
        streams = graph.node(graph.node(k).x).type.shape[0] if gathered else b  # gathered: [B*S, ...]
        split = None
        if ns > 1:
            if nb > 1:
                return Decline(
                    "sharding_conflict",
                    f"seq over {self.seq} and batch over {self.batch}: the T-shards share the leading dimension "
                    "with the streams, and an annotation names one mesh axis per dimension",
                )
            split = match_split(graph, call, ns)
            if isinstance(split, Decline):
                return Decline(split.reason, f"seq: {split.message}")
            if chunks is not None:  # the regrouped calls read K/V whole
                split = replace(split, k_source=k, v_source=v)
        kv_labels: Labels = ("batch", "heads", "shard" if split else None, None)
        wanted: list[tuple[str, Labels]] = [(q, QKV_LABELS)]
        if split is not None and split.cells is not None:
            wanted += [(split.k_source, kv_labels), (split.v_source, kv_labels)]
        else:
            wanted += [(k, kv_labels), (v, kv_labels)]
        values: dict[str, Sharding] = {}
        roots: list[str] = []  # where K's and V's chains end: the values that hold their bytes
        for i, (value, labels) in enumerate(wanted):
            chain = self._chain(graph, value, labels, strict=i > 0)
            if isinstance(chain, Decline):
                return chain
            values.update(chain[0])
            if i and chain[0]:
                roots.append(chain[1])
        if streams % nb:
            return Decline(
                "not_divisible",
                f"batch: mesh axis {self.batch} has {nb} devices, which does not divide {streams} stream(s)",
            )
        if mask is not None:
            mask_sharding = self._sharding(_mask_labels(graph.node(mask).type.shape, b, hq, split))
            if mask_sharding is not None:
                values[mask] = mask_sharding
        for value, sharding in values.items():
            held = graph.node(value).sharding
            if held is not None and held != sharding:
                return Decline(
                    "sharding_conflict",
                    f"{value} is already sharded {format_sharding(held)}; "
                    f"this attention needs {format_sharding(sharding)}",
                )
        out = self._sharding(QKV_LABELS)
        if (
            chunks is None
            and split is None
            and anchor.sharding == out
            and all(graph.node(n).sharding == s for n, s in values.items())
        ):
            return Decline("already_done", "already sharded as planned")
        rows = b // streams if gathered else None
        message = self._describe(graph, anchor, hkv, hq, streams, chunks, split, rows, values, roots)
        return _Plan(q, k, v, mask, chunks, split, tuple(values.items()), message)

    def _chain(
        self, graph: Graph, value: str, labels: Labels, strict: bool = True
    ) -> tuple[dict[str, Sharding], str] | Decline:
        """``value`` and what it reads through layout ops (:func:`_source_sharding`), each with the sharding
        that lays its elements out on the devices as ``value``'s are, and the last of them: the value that
        holds the bytes (a graph input, or the computed value the chain ends at). An op that cannot pass the
        sharding on declines (``strict``: K and V, whose bytes are the point) or ends the chain (the query)."""
        sharding = self._sharding(labels)
        if sharding is None:
            return {}, value
        out, node = {value: sharding}, graph.node(value)
        while node.op in BACKWARD:
            source = _source_sharding(graph, node, sharding)
            if isinstance(source, str) and not strict:
                break
            if isinstance(source, str):
                return Decline("sharding_blocked", f"{value} is read through {node.op} {node.name}: {source}")
            sharding, node = source, graph.node(node.inputs[0])
            out[node.name] = sharding
        return out, node.name

    def _sharding(self, labels: Labels) -> Sharding | None:
        return normalize_sharding([self._axis(label) if label else None for label in labels])

    def _describe(
        self,
        graph: Graph,
        anchor: Node,
        hkv: int,
        hq: int,
        b: int,
        chunks: tuple[tuple[int, int], ...] | None,
        split: SplitPlan | None,
        rows: int | None,
        values: dict[str, Sharding],
        roots: list[str],
    ) -> str:
        """The remark: what each device holds, counted from the annotations placed on K's and V's roots."""
        held = {a for root in roots for a in values[root] if a is not None}
        split_over = {a: graph.mesh_axes[a] if a in held else 1 for a in (self.heads, self.batch, self.seq) if a}
        parts = []
        if rows is not None and split is None:
            parts.append(
                f"gathered QSA attention over {b} stream(s) x {rows} row(s): each qsa_gather keeps streams and "
                "KV heads array axes, so every device gathers its rows from its own part of the caches"
            )
        if chunks is not None:
            sizes = "+".join(str(stop - start) for start, stop in chunks)
            parts.append(
                f"regrouped {len(anchor.inputs)} head-chunk subcalls ({sizes} per KV group, {hkv} KV groups) into "
                f"{len(chunks)} sdpa over all KV groups (same query rows per KV head as each chunk), so the KV-head "
                "axis stays an array axis"
            )
        if self.heads is not None:
            h = split_over[self.heads]
            parts.append(
                f"KV heads over {self.heads}: {hkv}/{h} = {hkv // h} KV head(s) per device with their "
                f"{hq // h} query head(s) (whole GQA groups)"
            )
            sharded = values[roots[0]] if roots else ()
            if self.heads in sharded:  # fewer heads on K's root than the sdpa reads: repeated (repeat_kv)
                held_heads = graph.node(roots[0]).type.shape[sharded.index(self.heads)]
                if held_heads < hkv:
                    parts[-1] += (
                        f", repeated {hkv // held_heads}x from {roots[0]}'s {held_heads}: {held_heads // h} of "
                        f"them per device"
                    )
        if self.batch is not None:
            nb = split_over[self.batch]
            parts.append(f"streams over {self.batch}: {b}/{nb} = {b // nb} per device")
        if split is not None and self.seq is not None:
            ns = split_over[self.seq]
            parts.append(
                f"keys over {self.seq}: {split.describe()}; each device holds {split.kv_len // ns} of "
                f"{split.kv_len} keys and only the combine crosses devices"
            )
        if roots:
            parts.append("K/V per device: " + "; ".join(_holding(graph, r, values[r]) for r in dict.fromkeys(roots)))
        parts.append(f"annotated {', '.join(f'{n}{format_sharding(s)}' for n, s in values.items())}")
        return "; ".join(parts)

    # ------------------------------------------------------------------ rewriting

    def _place(self, graph: Graph) -> Place:
        def place(value: str, labels: Labels) -> None:
            sharding = self._sharding(labels)
            if sharding is not None:
                graph.set_sharding(value, sharding)

        return place

    def _rewrite(self, rw: Rewriter, plan: _Plan) -> None:
        graph, place = rw.graph, self._place(rw.graph)
        for value, sharding in plan.values:
            graph.set_sharding(value, sharding)
        if plan.chunks is not None:
            rw.replace_matched(self._regroup(rw, plan, place), prune=True)
        elif plan.split is not None:
            rw.replace_matched(rewrite_split(rw, plan.split, place), prune=True)
        else:
            rw.annotate_matched(self._sharding(QKV_LABELS) or ())

    def _regroup(self, rw: Rewriter, plan: _Plan, place: Place) -> str:
        """One sdpa per chunk position over all KV groups: ``q[B, Hkv, G, S, D][:, :, a:b]`` against whole K/V."""
        b, hq, s, d = rw.type(plan.q).shape
        hkv = rw.type(plan.k).shape[1]
        name = rw.anchor.name
        grouped = rw.reshape(plan.q, (b, hkv, hq // hkv, s, d), f"{name}_q_groups")
        place(grouped, ("batch", "heads", None, None, None))
        call = rw.graph.node(rw.anchor.inputs[0])
        outs = []
        for i, (start, stop) in enumerate(plan.chunks or ()):
            width = stop - start
            chunk = rw.slice_axis(grouped, 2, start, stop, hint=f"{name}_q{i}")
            place(chunk, ("batch", "heads", None, None, None))
            chunk = rw.reshape(chunk, (b, hkv * width, s, d), f"{name}_q{i}")
            place(chunk, QKV_LABELS)
            operands = {"q": chunk, "k": plan.k, "v": plan.v, "mask": plan.mask}
            out = rw.op("sdpa", operands, call.attrs, f"{name}_c{i}")
            place(out, QKV_LABELS)
            if plan.split is not None:
                inner = Rewriter(rw.graph, rw.graph.node(out))
                split = match_split(rw.graph, inner.anchor, plan.split.shards)
                assert isinstance(split, SplitPlan), split  # the group's first call passed the same checks
                out = rewrite_split(inner, split, place)
                inner.replace_matched(out)
            dv = rw.type(out).shape[3]
            out = rw.reshape(out, (b, hkv, width, s, dv), f"{name}_c{i}")
            place(out, ("batch", "heads", None, None, None))
            outs.append(out)
        heads = rw.concat(outs, 2, f"{name}_groups")
        place(heads, ("batch", "heads", None, None, None))
        out = rw.reshape(heads, (b, hq, s, rw.type(heads).shape[4]), f"{name}_regrouped")
        place(out, QKV_LABELS)
        return out


def _sole_user(graph: Graph, node: Node) -> Node | None:
    users = graph.users(node.name)
    return users[0] if len(users) == 1 and node.name not in graph.outputs else None


def _chunk_subcalls(graph: Graph, concat: Node | None) -> list[Node] | None:
    """The sdpa operands of a concat along the head axis (head-chunk's output), else None."""
    if concat is None or concat.op != "concat" or concat.type.rank != 4 or concat.attrs["axis"] % 4 != 1:
        return None
    calls = [graph.node(i) for i in concat.inputs]
    return calls if all(c.op == "sdpa" for c in calls) else None


def _head_range(graph: Graph, value: str) -> tuple[str, int, int]:
    """``(source, start, stop)`` when ``value`` is ``source[:, start:stop]`` (or ``source`` itself)."""
    node = graph.node(value)
    if node.op == "slice":
        source = graph.node(node.inputs[0]).type.shape
        start, stop, step = node.attrs["start"], node.attrs["stop"], node.attrs["step"]
        if all((start[d], stop[d], step[d]) == (0, n, 1) for d, n in enumerate(source) if d != 1) and step[1] == 1:
            return node.inputs[0], start[1], stop[1]
    return value, 0, node.type.shape[1]


def _head_chunk_group(
    graph: Graph, concat: Node, calls: list[Node]
) -> tuple[tuple[str, str, str, str | None], tuple[tuple[int, int], ...]] | Decline:
    """The whole attention ``(Q, K, V, mask)`` behind head-chunk's subcalls and the chunk offsets per KV group."""
    first = calls[0]
    sources, offsets = set(), {}
    position = 0
    for call in calls:
        if call.attrs != first.attrs or (call.mask, call.sinks) != (first.mask, first.sinks):
            return Decline(
                "not_head_chunked",
                f"not one head-chunked attention: {call.name} and {first.name} differ in scale, causal or mask "
                "(a per-head mask sliced per chunk is not regrouped)",
            )
        q, h0, h1 = _head_range(graph, call.q)
        (k, j0, j1), (v, v0, v1) = (_head_range(graph, x) for x in (call.k, call.v))
        if (j0, j1) != (v0, v1) or j1 - j0 != 1 or h0 != position:
            return Decline(
                "not_head_chunked",
                f"not one head-chunked attention: {call.name} reads query heads {h0}:{h1} and K/V heads {j0}:{j1}",
            )
        sources.add((q, k, v))
        offsets.setdefault(j0, []).append((h0, h1))
        position = h1
    if len(sources) != 1:
        return Decline("not_head_chunked", "not one head-chunked attention: the subcalls read different q, k or v")
    ((q, k, v),) = sources
    hq, hkv = graph.node(q).type.shape[1], graph.node(k).type.shape[1]
    group = hq // hkv
    local = {j: tuple((h0 - j * group, h1 - j * group) for h0, h1 in chunks) for j, chunks in offsets.items()}
    chunks = local.get(0, ())
    if position != hq or sorted(local) != list(range(hkv)) or any(c != chunks for c in local.values()):
        return Decline(
            "not_head_chunked",
            f"not one head-chunked attention: the chunks of {concat.name} are not the same in every KV group",
        )
    if any(not 0 <= start < stop <= group for start, stop in chunks):
        return Decline(
            "not_head_chunked", f"not one head-chunked attention: a chunk of {concat.name} spans two KV groups"
        )
    return (q, k, v, first.mask), chunks


def _source_sharding(graph: Graph, node: Node, sharding: Sharding) -> Sharding | str:
    """The sharding of ``node``'s first operand that puts every element it passes to ``node`` on the devices
    ``sharding`` puts it on, or why there is none (the end of a :meth:`ShardAttention._chain` message).

    A sharded dimension must reach the operand whole (slice, take), permuted (transpose), as a dimension of the
    same row-major stride (reshape: the block ``i`` of ``size`` blocks is then the same elements; a merged
    dimension carries it on its outer part), or from an operand dimension it does not repeat (broadcast_to).
    A ``dynamic_update_slice`` passes it to its buffer (a cache the step writes into).
    """
    source = graph.node(node.inputs[0])
    src, dst = source.type.shape, node.type.shape
    sharded = [(d, axis) for d, axis in enumerate(sharding) if axis is not None]
    mesh = graph.mesh_axes
    if node.op in ("cast", "dynamic_update_slice"):
        return sharding
    if node.op == "slice":
        bounds = zip(node.attrs["start"], node.attrs["stop"], node.attrs["step"], src)
        cut = [d for d, (lo, hi, st, n) in enumerate(bounds) if sharding[d] and (lo, hi, st) != (0, n, 1)]
        if cut:
            return (
                f"it takes [{format_slice(node)}] of {source.name}, which cuts dimension {cut[0]} (to be sharded over "
                f"{sharding[cut[0]]}); per-stream or per-head slices cannot stay on one device of an SPMD program"
            )
        return sharding
    if node.op == "qsa_gather":  # [B*S, H, W, D] from [B, H, T, D]: B the outer part of B*S, H as it is
        if sharding[2]:
            return f"it gathers {source.name} along T (dimension 2, to be sharded over {sharding[2]})"
        return sharding
    if node.op == "take":
        axis = node.attrs["axis"] % source.type.rank
        if graph.node(node.inputs[1]).type.rank != 1 or sharding[axis]:
            return f"it gathers {source.name} along dimension {axis}, a dimension to be sharded"
        return sharding
    out: list[str | None] = [None] * len(src)
    if node.op == "transpose":
        for d, p in enumerate(node.attrs["perm"]):
            out[p] = sharding[d]
        return tuple(out)
    lead = len(dst) - len(src)
    for e, axis in sharded:
        size = mesh[axis]
        if node.op == "broadcast_to":
            d = e - lead
            if d < 0 or src[d] != dst[e]:
                return (
                    f"it repeats {source.name} {list(src)} along dimension {e} (to be sharded over {axis}): "
                    f"every device would need all of {source.name}"
                )
        else:  # reshape: the dimension of src with the same row-major prefix, of a size the axis divides
            prefix = math.prod(dst[:e])
            kept = [d for d, n in enumerate(src) if math.prod(src[:d]) == prefix and n % size == 0 and out[d] is None]
            kept.sort(key=lambda d: (src[d] != dst[e], src[d] == 1))  # the same size first, then not a unit dim
            if not kept:
                return (
                    f"it reshapes {source.name} {list(src)} -> {list(dst)}, where dimension {e} (to be sharded over "
                    f"{axis} of size {size}) is not the outer part of a dimension of {source.name} that {size} divides"
                )
            d = kept[0]
        out[d] = axis
    return tuple(out)


def _holding(graph: Graph, root: str, sharding: Sharding) -> str:
    """What one device holds of ``root`` under ``sharding``: its bytes when it is a graph input, else that it is
    computed (so no input's bytes are split by annotating it)."""
    node = graph.node(root)
    if node.op != "input":
        return f"{root} is computed ({node.op}), not a graph input: annotated {format_sharding(sharding)}"
    blocks = math.prod(graph.mesh_axes[a] for a in sharding if a is not None)
    kind = "state" if graph.is_state(root) else "graph input"
    return (
        f"{root} ({kind} {node.type}, placed {format_sharding(sharding)}): "
        f"{node.type.nbytes // blocks:,} of {node.type.nbytes:,} bytes per device"
    )


def _mask_labels(shape: tuple[int, ...], b: int, hq: int, split: SplitPlan | None) -> Labels:
    """The dimension labels of an sdpa mask: streams, per-head rows, and keys when they are split."""
    bm, hm, _sm, tm = (1,) * (4 - len(shape)) + shape
    labels = (
        "batch" if bm == b else None,
        "heads" if hm == hq else None,
        None,
        "shard" if split is not None and split.cells is None and tm == split.kv_len else None,
    )
    return labels[4 - len(shape) :]


def _propagate(graph: Graph) -> int:
    """Give unannotated elementwise readers and concatenations of equally sharded values that sharding, and
    transposes and reshapes of a sharded value theirs where each sharded dimension stays whole."""
    count = 0
    for node in graph.nodes():
        if node.sharding is not None:
            continue
        if node.op in ("transpose", "reshape"):
            sharding = _relaid(graph, node)
            if sharding is not None:
                graph.set_sharding(node.name, sharding)
                count += 1
            continue
        if node.op not in PROPAGATING:
            continue
        operands = [graph.node(i) for i in node.inputs]
        shaped = [o for o in operands if o.type.shape == node.type.shape or node.op == "concat"]
        shardings = {o.sharding for o in shaped}
        if len(shardings) != 1 or any(o.type.rank and o not in shaped for o in operands):
            continue
        (sharding,) = shardings
        if sharding is None or (node.op == "concat" and sharding[node.attrs["axis"] % node.type.rank]):
            continue
        graph.set_sharding(node.name, sharding)
        count += 1
    return count


def _relaid(graph: Graph, node: Node) -> Sharding | None:
    """The sharding of a transpose or reshape of a sharded value, None when a sharded dimension is not kept
    whole (a reshape keeps dimension ``d`` as ``e`` when both have the same size and the same row-major
    prefix product, so every element keeps its coordinate along it)."""
    source = graph.node(node.inputs[0])
    held = source.sharding
    if held is None or len(held) != source.type.rank:
        return None
    if node.op == "transpose":
        return normalize_sharding([held[p] for p in node.attrs["perm"]])
    src, dst = source.type.shape, node.type.shape
    out: list[str | None] = [None] * len(dst)
    for d, axis in enumerate(held):
        if axis is None:
            continue
        prefix = math.prod(src[:d])
        kept = [e for e in range(len(dst)) if dst[e] == src[d] and math.prod(dst[:e]) == prefix and out[e] is None]
        if not kept:
            return None
        out[kept[0]] = axis
    return normalize_sharding(out)


__all__ = ["ShardAttention"]
