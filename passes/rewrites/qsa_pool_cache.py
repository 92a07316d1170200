"""QSA pooled-key cache: a resident f32 cache of the indexer's block keys, pooling only the newest block(s).

Anchored at ``qsa_block_scores(idx_q, block_keys)``, the pass finds the ``qsa_pool`` of the raw key cache
that ``block_keys`` derives from and rewrites the step (docs/qsa.md, docs/semantics.md §3.7) to

- read the stored value from a new resident f32 input ``[B, NB, D]``, the cache: ``store="keys"``
  (default) stores ``block_keys``, so the row-wise ops between the pool and it (RMSNorm, RoPE) run on
  the new blocks only; ``store="pooled"`` stores the pooled keys and those ops still run on every block;
- per stream and row at position ``p``: pool the ``r`` raw rows of block ``p // r`` (and replay the ops up
  to ``block_keys`` on that block) and write it at ``[b, p // r]``, one ``dynamic_update_slice`` for one
  row, one ``put_along_axis`` for several;
- return the updated cache as a graph output paired with the new input (state,
  :meth:`attnpass.ir.Graph.state_pairs`); :meth:`QSAPoolCache.prefill` builds its first value.

Exact, bit for bit: only ``qsa_select`` reads the scores and it ignores invisible blocks; every visible
block is complete and was written by the same ops on the same rows. Where XLA on CPU rounds a row
reduction differently by operand size, the replay's sums run over a zero-padded block in the whole cache's
regime (:data:`XLA_ROW_REDUCTION_ELEMENTS`); its other ops run on the block's row alone (docs/qsa.md).
The caller keeps cell ``c`` of the raw cache at position ``c`` and writes each step's rows there before the step.

Preconditions (each decline says which failed): the raw keys are a resident ``[B, T, D]`` input read whole
with ``T % r == 0``; the ops up to ``block_keys`` are row-wise and read by nothing else; the scores feed
only ``qsa_select`` with the pool's ratio and one ``[B, S]`` positions value, ``S <= max_rows``.
``enabled=None`` reads ``ATTNPASS_QSA_POOL_CACHE`` when the pass runs (false/off/no/0 keep the pooling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node, TensorType, get_op, require_int
from attnpass.ir.core.builder import Builder

from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_QSA_POOL_CACHE"
CACHE_DTYPE = DType.float32
BLOCK_AXIS = 1  # every value of the chain is [B, NB, *]
STORES = ("pooled", "keys")


@dataclass(frozen=True)
class _Match:
    pool: Node
    raw: Node
    keys: Node  # the block_keys operand
    chain: tuple[Node, ...]  # the ops after the pool up to and including ``keys``, topologically ordered
    stored: Node  # what the cache holds: the pool, or ``keys``
    positions: str
    streams: int
    rows: int
    cache: str  # the new state input's name
    output: int  # the position of its next value among the outputs
    replay_rows: tuple[int, int]  # the leading shape the one-block replay of the chain runs over (zero-padded)
    raw_readers: tuple[str, ...]  # live readers of the raw keys besides the pool: they still read them afterwards


def _row_wise(graph: Graph, node: Node, n_blocks: int) -> str | None:
    """Why ``node`` (a [B, NB, *] value of the chain) may mix block rows, or None when it works row by row."""
    rank = node.type.rank
    if rank != 3 or node.type.shape[BLOCK_AXIS] != n_blocks:
        return f"{node.name} is {node.type}, not [B, {n_blocks}, D] with one row per block"
    family = get_op(node.op).family
    if node.op in ("sum", "max"):
        if not node.attrs["keepdims"] or {a % rank for a in node.attrs["axes"]} != {2}:
            return f"{node.name} = {node.op}[axes={node.attrs['axes']}] does not reduce only the last axis keeping dims"
    elif node.op == "slice":
        start, stop, step = (node.attrs[k][:2] for k in ("start", "stop", "step"))
        source = graph.node(node.inputs[0]).type.shape[:2]
        if start != (0, 0) or stop != source or step != (1, 1):
            return f"{node.name} slices the stream or block axis"
    elif node.op == "concat":
        if node.attrs["axis"] % rank != 2:
            return f"{node.name} concatenates along axis {node.attrs['axis']}, not the last"
    elif family != "elementwise" and node.op != "cast":
        return f"{node.name} ({node.op}) is not known to act on each block row separately"
    return None  # broadcasting to [B, NB, *] aligns every operand: one row per block, or one row for all


@register_pass
@dataclass(frozen=True)
class QSAPoolCache(SwitchedPass):
    """Replace per-step pooling of the whole raw key cache by a resident f32 block-key cache (state)."""

    name: ClassVar[str] = "qsa-pool-cache"
    env_var: ClassVar[str] = ENV_VAR
    max_rows: int = 8
    store: str = "keys"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("QSAPoolCache", "max_rows", self.max_rows)
        if self.store not in STORES:
            raise ValueError(f"QSAPoolCache: store must be one of {', '.join(STORES)}, got {self.store!r}")

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rule = Rule("qsa-pool-cache", "qsa_block_scores", self._match, _rewrite, _describe)
        return bool(apply_rules(graph, [rule], remarks, decline_all=self.disabled()))

    def prefill(self, graph: Graph) -> Graph:
        """The graph that builds the initial caches from ``graph`` (before this pass) in one call.

        It computes each stored value (pooled keys or ``block_keys``) over the whole raw cache, cast to f32,
        with the same ops as ``graph``; output ``i`` is named like, and is the first value of,
        the ``i``-th state input this pass adds (``dict(zip(prefill.outputs, results))``).
        """
        out = graph.copy()
        out.name = f"{graph.name}_prefill"
        caches = []
        for node in graph.nodes():
            if node.op == "qsa_block_scores" and isinstance(m := self._match(graph, node), _Match):
                name = out.fresh_name(m.cache)
                caches.append(out.add_node("cast", [m.stored.name], {"dtype": CACHE_DTYPE}, name=name, loc=m.pool.loc))
        if not caches:
            raise ValueError(f"{self.name}: graph {graph.name} has no pooled block keys to cache")
        out.set_outputs(caches)
        out.remove_dead()
        return out.verify()

    # ------------------------------------------------------------------ check

    def _match(self, graph: Graph, anchor: Node) -> _Match | Decline:
        keys = graph.node(anchor.block_keys)
        pools = [graph.node(n) for n in graph.ancestors([keys.name]) if graph.node(n).op == "qsa_pool"]
        if len(pools) != 1:
            found = "no qsa_pool" if not pools else f"{len(pools)} qsa_pool nodes"
            return _kept("qsa_form", f"the block keys {keys.name} derive from {found} (need exactly one)")
        pool = pools[0]
        raw = graph.node(pool.raw_keys)
        ratio = pool.attrs["ratio"]
        if raw.op != "input" or raw.attrs["role"] != "resident":
            what = f"a {raw.attrs['role']} input" if raw.op == "input" else f"computed by {raw.op}"
            return _kept(
                "qsa_form", f"the raw keys {raw.name} are {what}, not a resident input holding the whole history"
            )
        if raw.type.rank != 3:
            return _kept("shape_mismatch", f"the raw keys {raw.name}:{raw.type} are not [B, T, D]")
        (b, t, _d), n_blocks = raw.type.shape, raw.type.shape[1] // ratio
        if t % ratio:
            return _kept(
                "not_divisible",
                f"n_kv={t} of {raw.name} is not a multiple of ratio {ratio}: a row in the trailing partial block "
                "would write over the last whole block",
                n_kv=t,
                ratio=ratio,
            )
        cone = (graph.ancestors([keys.name]) & graph.descendants([pool.name])) - {pool.name}
        chain = tuple(n for n in graph.nodes() if n.name in cone)
        for node in (pool, *chain):
            readers = {u.name for u in graph.users(node.name)} - cone
            if node.name == keys.name:
                readers.discard(anchor.name)
            if node.name in graph.outputs:
                readers.add("the graph outputs")
            if readers:
                listed = ", ".join(sorted(readers))
                return _kept(
                    "other_readers", f"{node.name} is also read by {listed}, which would still need every block"
                )
        for node in chain:
            why = _row_wise(graph, node, n_blocks)
            if why is not None:
                return _kept("not_row_wise", why)
        selects = graph.users(anchor.name)
        readers = {s.op for s in selects} | ({"the graph outputs"} if anchor.name in graph.outputs else set())
        if readers != {"qsa_select"} or any(s.block_scores != anchor.name for s in selects):
            listed = ", ".join(sorted(readers)) or "nothing"
            return _kept(
                "other_readers",
                f"the scores are read by {listed}, not only qsa_select (which ignores invisible blocks)",
            )
        if any(s.attrs["ratio"] != ratio for s in selects):
            return _kept("qsa_form", f"a qsa_select reading the scores has a ratio other than the pool's {ratio}")
        positions = {s.positions for s in selects}
        if len(positions) > 1:
            return _kept("qsa_form", f"the qsa_select nodes read different positions: {', '.join(sorted(positions))}")
        (pos,) = positions
        streams, rows = graph.node(pos).type.shape
        if streams != b:
            why = f"positions {pos} have {streams} stream(s), the raw keys {raw.name} {b}"
            return _kept("shape_mismatch", why, streams=streams, raw_streams=b)
        if rows > self.max_rows:
            why = f"prefill-shaped: {rows} query rows per stream > max_rows={self.max_rows}"
            return _kept("too_many_rows", why, rows=rows, max_rows=self.max_rows)
        cache = graph.fresh_name(f"{raw.name}_blocks")
        stored = pool if self.store == "pooled" else keys
        replay = (1, 1) if stored is pool else _xla_reduction_rows(graph, chain, keys)
        live = graph.ancestors(list(graph.outputs))
        others = tuple(sorted(u.name for u in graph.users(raw.name) if u.name != pool.name and u.name in live))
        return _Match(pool, raw, keys, chain, stored, pos, streams, rows, cache, len(graph.outputs), replay, others)


def _kept(reason: str, why: str, **figures: object) -> Decline:
    """A decline with code ``reason`` whose words start with "in-graph pooling kept: ", and its figures."""
    return Decline(reason, f"in-graph pooling kept: {why}", data=figures)


# ---------------------------------------------------------------------- rewrite


def _rewrite(rw: Rewriter, m: _Match) -> None:
    """Pool and transform one block per (stream, row), write it into the cache, score against the cache."""
    graph, raw, ratio = rw.graph, m.raw.name, m.pool.attrs["ratio"]
    cache = graph.add_input(m.cache, TensorType(m.stored.type.shape, CACHE_DTYPE), "resident", rw.anchor.loc)

    def int32s(values: tuple[int, ...], hint: str) -> str:
        return rw.op("constant", [], {"value": values, "shape": (len(values),), "dtype": DType.int32}, hint)

    r, zero = rw.scalar(ratio, DType.int32, "ratio"), int32s((0,), "zero")
    last = rw.scalar(m.raw.type.shape[1] // ratio - 1, DType.int32, "last_block")
    offsets = int32s(tuple(range(ratio)), "in_block")
    values: list[list[str]] = []  # [stream][row] -> the new block's stored value [1, 1, D]
    blocks: list[list[str]] = []  # [stream][row] -> its block id [1]
    for b in range(m.streams):
        values.append([])
        blocks.append([])
        for s in range(m.rows):
            p = rw.reshape(rw.pick(m.positions, {0: b, 1: s}), (1,), "row_position")
            block = rw.op("minimum", [rw.op("floor_divide", [p, r]), last], hint="new_block")
            cells = rw.op("add", [rw.op("mul", [block, r]), offsets], hint="new_cells")
            rows = rw.op("take", [rw.pick(raw, {0: b}), cells], {"axis": 1}, f"{raw}_new")
            values[b].append(rw.cast(_replay(rw, m, rows, block, b), CACHE_DTYPE))
            blocks[b].append(block)
    if m.streams * m.rows == 1:
        start = rw.concat([int32s((0,), "stream"), blocks[0][0], zero], 0, "cache_at")
        current = rw.op("dynamic_update_slice", [cache, values[0][0], start], hint=f"{cache}_next")
    else:  # one write of every row's block: chained updates made XLA copy the whole cache (see module docstring)
        new = rw.concat([rw.concat(v, 1, "new_blocks") for v in values], 0, "new_blocks")
        ids = rw.concat([rw.reshape(rw.concat(i, 0), (1, m.rows, 1)) for i in blocks], 0, "new_block_ids")
        ids = rw.broadcast(ids, rw.type(new).shape, "new_block_ids")
        current = rw.op("put_along_axis", [cache, ids, new], {"axis": BLOCK_AXIS}, hint=f"{cache}_next")
    graph.set_outputs([*graph.outputs, current])
    graph.pair_state(cache, m.output)
    graph.replace_all_uses(m.stored.name, rw.cast(current, m.stored.type.dtype, "stored"))
    graph.prune([m.stored.name])  # the whole-cache pool (and, storing keys, the ops after it)
    rw.replace_matched(rw.op("qsa_block_scores", list(graph.node(rw.anchor.name).inputs), hint="block_scores"))


def _replay(rw: Rewriter, m: _Match, rows: str, block: str, stream: int) -> str:
    """The stored value of one block from its raw rows ``[1, r, D]``: pooled (then the chain up to block_keys).

    Storing the block keys, each ``sum`` of the chain (and what it reads) runs over the new block padded with
    zero rows to :func:`_xla_reduction_rows` (row ``[0, 0]`` is the block), its row ``[0, 0]`` picked right after
    it; every other op runs on the block's row ``[1, 1, *]`` alone, as the whole-cache chain computes each row.
    """
    pooled = rw.op("qsa_pool", [rows], m.pool.attrs, "pooled_new")
    if m.stored is m.pool:
        return pooled
    chain = {n.name: n for n in m.chain}
    row_needs, wide_needs = _replay_needs(m, chain)
    row = {m.pool.name: pooled}
    wide = {m.pool.name: _pad_rows(rw, pooled, m.replay_rows)} if m.pool.name in wide_needs else {}
    outside: dict[str, str] = {}

    def replayed(node: Node, values: dict[str, str], lead: tuple[int, int], hint: str) -> str:
        for i in node.inputs:
            if i not in chain and i != m.pool.name and i not in outside:
                outside[i] = _block_row(rw, i, block, stream)
        attrs = dict(node.attrs)
        if node.op == "slice":
            attrs["start"] = (0, 0, *attrs["start"][2:])
            attrs["stop"] = (*lead, *attrs["stop"][2:])
        return rw.op(node.op, [values[i] if i in values else outside[i] for i in node.inputs], attrs, hint)

    for node in m.chain:
        if node.name in wide_needs:
            wide[node.name] = replayed(node, wide, m.replay_rows, f"{node.name}_new")
        if node.name in row_needs:
            if node.op == "sum":
                row[node.name] = rw.pick(wide[node.name], {0: 0, 1: 0}, f"{node.name}_new_row")
            else:
                row[node.name] = replayed(node, row, (1, 1), f"{node.name}_new_row")
    return row[m.stored.name]


def _replay_needs(m: _Match, chain: dict[str, Node]) -> tuple[set[str], set[str]]:
    """The chain values the one-block replay computes on the row, and those it computes padded (what a sum reads)."""
    row: set[str] = set()
    wide: set[str] = set()
    todo = [m.stored.name]
    while todo:
        name = todo.pop()
        if name in row:
            continue
        row.add(name)
        node = chain.get(name)
        if node is None:
            continue
        if node.op == "sum":
            wide_todo = [name]
            while wide_todo:
                w = wide_todo.pop()
                if w not in wide:
                    wide.add(w)
                    wide_todo += [i for i in chain[w].inputs if i in chain or i == m.pool.name] if w in chain else []
        else:
            todo += [i for i in node.inputs if i in chain or i == m.pool.name]
    return row, wide


# XLA on CPU emits a row reduction (``sum`` over the last axis) one way when its operand has fewer than this
# many elements and another way from this many on: the two round a row's sum differently (measured with
# jax 0.10.2 and 0.12.1 at last-axis sizes 16..256: the switch sits at rows * D = 4,096 elements, e.g. 32 rows
# of 128). Within one regime a row's bits depend on the operand's shape only, not on the row's place or its
# neighbours. numpy and MLX reduce each row alike at any row count, so the padding changes nothing there.
# Only the sums (and what they read) run padded: jax 0.12.1 vectorized an elementwise loop over the padded
# block without the FMA its scalar loops contract (RoPE's x1 * cos - x2 * sin), so the block's keys differed in
# the last bit from the whole cache's; on the one row every op rounds as on each row of the whole cache.
XLA_ROW_REDUCTION_ELEMENTS = 4096


def _xla_reduction_rows(graph: Graph, chain: tuple[Node, ...], keys: Node) -> tuple[int, int]:
    """The leading shape ``[B', P']`` the one-block replay's sums run over, so XLA rounds them as it rounds all blocks.

    The whole-cache chain (the re-pooling step, the prefill) reduces ``[B, NB, D]``. When that is below
    :data:`XLA_ROW_REDUCTION_ELEMENTS` for some ``sum`` of the chain, the replay uses that very shape; otherwise
    ``[1, P']`` with ``P' * D`` at the threshold for every ``sum``, in the same regime as ``[B, NB, D]``.
    A chain without a ``sum`` needs no padding. This depends on XLA's CPU emitter (a heuristic, not a
    contract): the decode-loop tests check it bit for bit at the model's indexer dims and at small dims.
    """
    dims = [graph.node(n.inputs[0]).type.shape[-1] for n in chain if n.op == "sum"]
    if not dims:
        return (1, 1)
    b, nb = keys.type.shape[:2]
    need = max(-(-XLA_ROW_REDUCTION_ELEMENTS // max(d, 1)) for d in dims)
    return (b, nb) if b * nb < need else (1, need)


def _pad_rows(rw: Rewriter, row: str, padded: tuple[int, int]) -> str:
    """``row`` [1, 1, D] as row [0, 0] of a [B', P', D] value whose other rows are zeros (a zero pad XLA keeps)."""
    t = rw.type(row)
    zero = rw.scalar(0, t.dtype, "zero_row")
    b, p = padded
    if p > 1:
        row = rw.concat([row, rw.broadcast(zero, (1, p - 1, *t.shape[2:]))], 1, "padded_new")
    if b > 1:
        row = rw.concat([row, rw.broadcast(zero, (b - 1, p, *t.shape[2:]))], 0, "padded_new")
    return row


def _block_row(rw: Builder, name: str, block: str, stream: int) -> str:
    """Operand ``name`` (outside the chain) as the chain's one-block replay reads it.

    Aligned right to ``[B, NB, *]``: its stream ``stream`` where it has one per stream, its row
    ``block`` where it has one per block (through a static slice: the slice's source row), else as is.
    """
    t = rw.type(name)
    lead = 3 - t.rank
    if lead == 0 and t.shape[0] > 1:
        name = rw.pick(name, {0: stream})
    axis = BLOCK_AXIS - lead
    if axis < 0 or rw.type(name).shape[axis] == 1:
        return name
    node = rw.graph.node(name)
    if node.op != "slice":
        return rw.op("take", [name, block], {"axis": axis}, f"{name}_row")
    start, stop, step = (list(node.attrs[k]) for k in ("start", "stop", "step"))
    index = rw.op("mul", [block, rw.scalar(step[axis], DType.int32, "step")]) if step[axis] != 1 else block
    index = rw.op("add", [index, rw.scalar(start[axis], DType.int32, "start")]) if start[axis] else index
    row = rw.op("take", [node.inputs[0], index], {"axis": axis}, f"{node.inputs[0]}_row")
    start[axis], stop[axis], step[axis] = 0, 1, 1
    if (tuple(start), tuple(stop), tuple(step)) == ((0,) * len(start), rw.type(row).shape, (1,) * len(start)):
        return row
    return rw.op("slice", [row], {"start": tuple(start), "stop": tuple(stop), "step": tuple(step)}, f"{name}_row")


def _padding(m: _Match) -> str:
    b, p = m.replay_rows
    if (b, p) == (1, 1):
        return ""
    return (
        f" (each new block's sums run over it as row 0 of [{b}, {p}] rows, the rest zeros, so that XLA's CPU row "
        f"reduction rounds them as over all [{m.keys.type.shape[0]}, {m.keys.type.shape[1]:,}] blocks: "
        "XLA_ROW_REDUCTION_ELEMENTS; the other ops run on its row alone)"
    )


def _write(m: _Match) -> str:
    if m.streams * m.rows == 1:
        return "one dynamic_update_slice"
    return f"one put_along_axis of all {m.streams * m.rows} rows' blocks (chained updates made XLA copy the cache)"


def _describe(m: _Match) -> tuple[str, dict]:
    ratio, raw = m.pool.attrs["ratio"], m.raw.type
    cache = TensorType(m.stored.type.shape, CACHE_DTYPE)
    read = m.streams * m.rows * ratio * raw.shape[2] * raw.dtype.itemsize
    ops = f"{len(m.chain)} row-wise op(s) ({', '.join(sorted({n.op for n in m.chain}))})" if m.chain else "no op"
    blocks = m.stored.type.shape[1]
    after = (
        f"{ops} up to the block keys {m.keys.name} still run over all {blocks:,} blocks"
        if m.stored is m.pool
        else f"{ops} up to the block keys run on the new block(s) only, not on {blocks:,}{_padding(m)}"
    )
    what = "pooled keys" if m.stored is m.pool else f"block keys {m.keys.name}"
    saved = (
        f"{raw.nbytes - read:,} bytes no longer read"
        if not m.raw_readers
        else f"the pooling no longer reads the other {raw.nbytes - read:,} bytes, but {m.raw.name} is still read by "
        f"{', '.join(m.raw_readers)}"
    )
    figures = {
        "store": "pooled" if m.stored is m.pool else "keys", "keys": m.keys.name, "raw": m.raw.name,
        "cache": m.cache, "cache_type": str(cache), "cache_bytes": cache.nbytes, "output": m.output,
        "blocks": m.streams * m.rows, "ratio": ratio, "read_bytes": read, "raw_rows": raw.shape[1],
        "raw_bytes": raw.nbytes, "saved_bytes": raw.nbytes - read, "raw_readers": m.raw_readers,
        "write": "dynamic_update_slice" if m.streams * m.rows == 1 else "put_along_axis",
        "chain_ops": sorted({n.op for n in m.chain}), "chain_length": len(m.chain), "cache_blocks": blocks,
        "replay_rows": m.replay_rows, "key_blocks": m.keys.type.shape[:2],
    }  # fmt: skip
    return (
        f"{what} (qsa_pool of {m.raw.name}) now come from the new resident input {m.cache}:{cache}, "
        f"{cache.nbytes:,} bytes, whose next value is output #{m.output}; per step {m.streams * m.rows} block(s) of "
        f"{ratio} rows ({read:,} bytes) are pooled and written instead of all {raw.shape[1]:,} rows of {m.raw.name} "
        f"({raw.nbytes:,} bytes), written with {_write(m)}: {saved}; {after}; "
        "start the cache with "
        "QSAPoolCache().prefill(graph) and feed it back (Graph.state_pairs)"
    ), figures


__all__ = ["ENV_VAR", "STORES", "QSAPoolCache"]
