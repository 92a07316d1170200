"""What a remark states, measured on the graphs before and after its pass, not compared with wording.

:func:`check_remarks` parses every remark of a kind listed in :data:`CHECKED` and checks each number it
states against the graphs: bytes against :meth:`Graph.input_nbytes` and the inputs' shapes and dtypes
(``numpy`` itemsizes, not ``TensorType.nbytes``), counts against the nodes the rewrite left, widths
against the operands of the new calls, visible cells against the mask the numpy reference computes. A
remark of a checked kind whose wording no longer parses fails too: a reworded remark needs its check
reworded. It returns how many remarks it checked, so a test can require that its graphs exercised it.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from attnpass.backends import run
from attnpass.ir import DType, Graph, Node, TensorType
from attnpass.lowering import lower
from attnpass.passes import Pass, PassManager, Remark
from attnpass.passes.rewrites.qsa_pool_cache import XLA_ROW_REDUCTION_ELEMENTS
from tests.fuzz.choices import Choices
from tests.fuzz.families import FAMILIES, Case

UNITS = {"streamed": "bytes per call", "resident": "bytes of device memory"}


def nbytes(t: TensorType | str) -> int:
    """Bytes of a tensor type, from its shape and numpy's itemsize (independent of ``TensorType.nbytes``)."""
    return math.prod(t.shape) * np.dtype(t.dtype.numpy).itemsize


@dataclass
class _Context:
    """What a check may need besides the graphs: the pass (its options), the inputs, bytes saved per role."""

    pass_: Pass | None
    arrays: Mapping[str, np.ndarray] | None
    saved: Counter = field(default_factory=Counter)

    def option(self, name: str):
        assert self.pass_ is not None, f"checking this remark needs the pass (its {name})"
        return getattr(self.pass_, name)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _new(before: Graph, after: Graph, op: str) -> list[Node]:
    return [n for n in after.nodes() if n.op == op and n.name not in before]


def _live(graph: Graph) -> set[str]:
    return graph.ancestors(list(graph.outputs))


def _role_deltas(before: Graph, after: Graph) -> dict[str, int]:
    return {role: before.input_nbytes(role) - after.input_nbytes(role) for role in UNITS}


# ---------------------------------------------------------------------- dce

DCE_INPUT = re.compile(
    r"graph input (?P<name>\S+?):(?P<type>\S+) \((?P<role>\w+)\) is never read: it leaves the signature, "
    r"saving (?P<bytes>\d+) (?P<unit>bytes per call|bytes of device memory)"
)
DCE_SUMMARY = re.compile(r"removed (?P<count>\d+) dead node\(s\): (?P<listed>.*?)(, \.\.\. \(\+(?P<more>\d+) more\))?")


def _dce_input(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    name, role = m["name"], m["role"]
    assert name in before.inputs and name not in after.inputs and r.node == name
    assert str(before.node(name).type) == m["type"] and before.input_role(name) == role
    assert not before.users(name) or name not in _live(before), f"{name} is read"
    assert int(m["bytes"]) == nbytes(before.node(name).type) and m["unit"] == UNITS[role]
    ctx.saved[role] += int(m["bytes"])


def _dce_summary(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    removed = [n.name for n in before.nodes() if n.op != "input" and n.name not in after]
    listed = m["listed"].split(", ")
    assert int(m["count"]) == len(removed) == len(listed) + int(m["more"] or 0)
    assert listed == removed[: len(listed)] and not set(removed) & _live(before)


def _dce_after(before: Graph, after: Graph, ctx: _Context) -> None:
    assert _live(after) == {n.name for n in after.nodes()}, "dce left dead nodes"
    assert _role_deltas(before, after) == {role: ctx.saved[role] for role in UNITS}


# ---------------------------------------------------------------------- narrow-inputs

NARROWED = re.compile(
    r"read only through the slice \[(?P<window>[^\]]*)\]: input (?P<name>\S+?):(?P<before>\S+) narrowed to "
    r"(?P<after>\S+) \((?P<role>\w+)\), (?P<a>\d+) -> (?P<b>\d+) (?P<unit>bytes per call|bytes of device memory)"
)
NOT_ONLY_SLICES = re.compile(r"it is read by (?P<ops>.*), not only through slices")
SLICES_DIFFER = re.compile(r"its (?P<n>\d+) slices differ in bounds \((?P<distinct>\d+) distinct\)")
WHOLE_SLICE = re.compile(r"its slice covers the whole input")


def _window(text: str) -> tuple[slice, ...]:
    return tuple(slice(*(int(x) for x in part.split(":"))) for part in text.split(", "))


def _narrowed(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    name, role = m["name"], m["role"]
    old, new = before.node(name).type, after.node(name).type
    assert str(old) == m["before"] and str(new) == m["after"] and after.input_role(name) == role
    assert before.inputs.index(name) == after.inputs.index(name)
    assert np.empty(old.shape, np.int8)[_window(m["window"])].shape == new.shape
    assert int(m["a"]) == nbytes(old) and int(m["b"]) == nbytes(new) and m["unit"] == UNITS[role]
    readers = before.users(name)
    assert readers and all(n.op == "slice" and n.type == new for n in readers)
    bounds = {tuple(zip(*(n.attrs[k] for k in ("start", "stop", "step")))) for n in readers}
    assert bounds == {tuple((w.start, w.stop, w.step or 1) for w in _window(m["window"]))}
    ctx.saved[role] += int(m["a"]) - int(m["b"])


def _narrow_declined(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    readers = before.users(r.node)
    if m.re is WHOLE_SLICE:
        assert readers and all(n.op == "slice" and n.type == before.node(r.node).type for n in readers)
    elif "ops" in m.re.groupindex:
        assert m["ops"] == ", ".join(sorted({n.op for n in readers if n.op != "slice"}))
    else:
        bounds = {tuple(n.attrs[k] for k in ("start", "stop", "step")) for n in readers}
        assert int(m["n"]) == len(readers) and int(m["distinct"]) == len(bounds) > 1


def _narrow_after(before: Graph, after: Graph, ctx: _Context) -> None:
    assert _role_deltas(before, after) == {role: ctx.saved[role] for role in UNITS}


# ---------------------------------------------------------------------- head-chunk

CHUNKED = re.compile(
    r"q_len\*gqa = (?P<product>\d+) > (?P<budget>\d+) \(q_len (?P<s>\d+), gqa (?P<gqa>\d+)\): (?P<calls>\d+) subcalls "
    r"with heads_per_chunk (?P<hpc>\d+) \((?P<sizes>[\d+]+) per KV group, (?P<hkv>\d+) KV group\(s\)\), one-head K/V "
    r"slices, concat in head order; (?P<mask>no mask|the mask broadcasts over heads and passes unchanged to every "
    r"subcall|per-head mask sliced per chunk along its head axis .*?)"
    r"(?P<sinks>; sinks \[Hq\] sliced per chunk \(one logit per query head\))?\Z"
)
FITS = re.compile(
    r"q_len\*gqa = (?P<product>\d+) <= (?P<budget>\d+) \(q_len (?P<s>\d+), gqa (?P<gqa>\d+)\): fits the fused budget"
)


def _shapes(graph: Graph, node: str) -> tuple[tuple[int, ...], ...]:
    return tuple(graph.node(i).type.shape for i in graph.node(node).inputs)


def _chunked(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    (_b, hq, s, _d), (_b2, hkv, *_), _v, *rest = _shapes(before, r.node)
    anchor = before.node(r.node)
    has_sinks = anchor.sinks is not None
    mask = [] if anchor.mask is None else [rest[0]]
    assert (m["sinks"] is not None) == has_sinks, "sinks stated iff the sdpa has them"
    budget = int(m["budget"])
    assert budget == ctx.option("budget")
    assert (int(m["s"]), int(m["gqa"]), int(m["hkv"])) == (s, hq // hkv, hkv)
    assert int(m["product"]) == s * hq // hkv > budget
    concat = after.node(next(n.name for n in _new(before, after, "concat") if n.name.startswith(f"{r.node}_heads")))
    calls = [after.node(c) for c in concat.inputs]
    assert all(c.op == "sdpa" for c in calls) and len(calls) == int(m["calls"]) and concat.attrs["axis"] == 1
    heads = [after.node(c.inputs[0]).type.shape[1] for c in calls]
    starts = [after.node(c.inputs[0]).attrs["start"][1] if after.node(c.inputs[0]).op == "slice" else 0 for c in calls]
    assert sum(heads) == hq and starts == [sum(heads[:i]) for i in range(len(heads))], "not in head order"
    assert max(heads) == int(m["hpc"]) and max(heads) * s <= budget, "a subcall exceeds the budget"
    kv = [c.inputs[1] for c in calls]
    assert len(set(kv)) == hkv and all(after.node(k).type.shape[1] == 1 for k in kv)
    assert "+".join(str(h) for h, k in zip(heads, kv) if k == kv[0]) == m["sizes"]
    if has_sinks:  # call i reads sinks[h0:h1], its own heads' logits
        sinks = [after.node(c.sinks) for c in calls]
        assert all(x.op == "slice" and x.inputs[0] == anchor.sinks for x in sinks)
        assert [(x.attrs["start"][0], x.attrs["stop"][0]) for x in sinks] == [(a, a + h) for a, h in zip(starts, heads)]
    if m["mask"] == "no mask":
        assert not mask and all(len(c.inputs) == 3 + has_sinks for c in calls)
    elif m["mask"].startswith("the mask broadcasts"):
        assert all(c.mask == anchor.mask for c in calls) and mask[0][-3:-2] != (hq,)
    else:
        assert [after.node(c.mask).type.shape[-3] for c in calls] == heads


def _fits(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    (_b, hq, s, _d), (_b2, hkv, *_), *_rest = _shapes(before, r.node)
    assert (int(m["s"]), int(m["gqa"])) == (s, hq // hkv) and int(m["product"]) == s * hq // hkv <= int(m["budget"])
    assert int(m["budget"]) == ctx.option("budget")
    assert r.node in after and after.node(r.node).op == "sdpa"


# ---------------------------------------------------------------------- qsa-gather

GATHERED = re.compile(
    r"gather: top (?P<top>\d+) blocks x ratio (?P<ratio>\d+) \+ (?P<tail>\d+) tail = (?P<cells>\d+) cells, "
    r"W=(?P<width>\d+) \(pad_multiple=(?P<pad>\d+)\); attention width n_kv=(?P<n_kv>\d+) -> (?P<width2>\d+) "
    r"\(n_kv >= (?P<factor>[\d.]+)\*W\); (?P<streams>\d+) stream\(s\) x (?P<rows>\d+) row\(s\), "
    r"one qsa_gather each of K and V \[B\*S, Hkv, W, D\] and one sdpa over (?P<batched>\d+) row\(s\); "
    r"visibility: (?P<vis>.*); the masked path is now dead \(run dce\)"
)


def _ancestor(graph: Graph, name: str, op: str) -> Node:
    (found,) = [graph.node(n) for n in graph.ancestors([name]) if graph.node(n).op == op]
    return found


def _gathered(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    anchor = before.node(r.node)
    (b, _hq, s, _d), (_b, hkv, t, dk), *_ = _shapes(before, r.node)
    select = _ancestor(before, r.node, "qsa_select")
    top, ratio, cells, width = int(m["top"]), int(m["ratio"]), int(m["cells"]), int(m["width"])
    assert (top, ratio) == (select.attrs["top_k_blocks"], select.attrs["ratio"])
    assert int(m["tail"]) == ratio - 1 and cells == top * ratio + ratio - 1
    pad = int(m["pad"])
    assert pad == ctx.option("pad_multiple") and float(m["factor"]) == ctx.option("min_depth_factor")
    assert width == int(m["width2"]) and width % pad == 0 and cells <= width < cells + pad
    assert int(m["n_kv"]) == t >= float(m["factor"]) * width
    assert (int(m["streams"]), int(m["rows"])) == (b, s)
    calls = _new(before, after, "sdpa")
    assert int(m["batched"]) == b * s and len(calls) == 1
    kv = [after.node(x) for x in calls[0].inputs[1:3]]  # K and V: each one qsa_gather of every row's cells
    assert [x.op for x in kv] == ["qsa_gather"] * 2 and kv[0].inputs[1] == kv[1].inputs[1]
    assert [x.inputs[0] for x in kv] == list(anchor.inputs[1:3])
    assert kv[0].type.shape == (b * s, hkv, width, dk)
    assert r.node not in _live(after), "the masked sdpa is still live"
    if ctx.arrays is not None:  # the masked path's visible cells per row: at most the stated count
        qmask = _ancestor(before, anchor.mask, "qsa_mask")
        visible = _evaluate(before, qmask.name, ctx.arrays).reshape(b, s, t).sum(-1)
        assert visible.max() <= cells, f"a row sees {visible.max()} cells, the remark says {cells}"


def _evaluate(graph: Graph, name: str, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    g = graph.copy()
    g.set_outputs([name])
    g.remove_dead()
    return np.asarray(run(lower(g, "numpy"), **{n: arrays[n] for n in g.inputs}))


# ---------------------------------------------------------------------- qsa-pool-cache

POOL_CACHE = re.compile(
    r"(?P<what>pooled keys|block keys (?P<keys>\S+)) \(qsa_pool of (?P<raw>\S+)\) now come from the new resident "
    r"input (?P<cache>\S+?):(?P<type>\S+), (?P<cache_bytes>[\d,]+) bytes, whose next value is output #(?P<output>\d+); "
    r"per step (?P<blocks>\d+) block\(s\) of (?P<ratio>\d+) rows \((?P<read>[\d,]+) bytes\) are pooled and written "
    r"instead of all (?P<t>[\d,]+) rows of (?P=raw) \((?P<raw_bytes>[\d,]+) bytes\), written with one "
    r"(?P<write>dynamic_update_slice|put_along_axis of all (?P<written>\d+) rows' blocks \(chained updates made XLA "
    r"copy the cache\)): (?:(?P<saved>[\d,]+) bytes no longer read|the pooling no longer reads the other "
    r"(?P<pool_saved>[\d,]+) bytes, but (?P=raw) is still read by (?P<others>[^;]*)); "
    r"(?:(?P<n_ops>\d+) row-wise op\(s\) "
    r"\((?P<ops>[^)]*)\)|no op) up to the block keys (?:(?P<still>\S+ still run over all (?P<all>[\d,]+) blocks)|run "
    r"on the new block\(s\) only, not on (?P<not_on>[\d,]+)(?: \(each new block is replayed as row 0 of "
    r"\[(?P<pb>\d+), (?P<pp>\d+)\] rows, the rest zeros, so that XLA's CPU row reduction rounds it as over all "
    r"\[(?P<kb>\d+), (?P<knb>[\d,]+)\] blocks: XLA_ROW_REDUCTION_ELEMENTS\))?); start the cache with "
    r"QSAPoolCache\(\)\.prefill\(graph\) and feed it back \(Graph\.state_pairs\)"
)


def _pool_cache(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    scores = before.node(r.node)
    keys = before.node(scores.inputs[1])
    pool = _ancestor(before, keys.name, "qsa_pool")
    raw, cache = before.node(m["raw"]), m["cache"]
    assert pool.inputs[0] == raw.name and raw.op == "input"
    assert m["keys"] in (None, keys.name)
    stored = pool if m["keys"] is None else keys
    # the cache: a new resident state input of the stored value's shape
    assert cache not in before and cache in after.inputs and after.input_role(cache) == "resident"
    assert str(after.node(cache).type) == m["type"] and after.node(cache).type.shape == stored.type.shape
    assert _int(m["cache_bytes"]) == nbytes(after.node(cache).type)
    assert (cache, int(m["output"])) in after.state_pairs()
    writer = after.node(after.outputs[int(m["output"])])
    blocks = _int(m["blocks"])
    (positions,) = {before.node(n.inputs[1]).type.shape for n in before.users(r.node) if n.op == "qsa_select"}
    assert blocks == math.prod(positions)
    assert writer.op == m["write"].split()[0] and len(_new(before, after, writer.op)) == 1
    assert m["written"] is None or int(m["written"]) == blocks
    # what the step reads of the raw keys: one new pool per block, over `ratio` rows gathered by take
    ratio = pool.attrs["ratio"]
    assert _int(m["ratio"]) == ratio and _int(m["t"]) == raw.type.shape[1] and _int(m["raw_bytes"]) == nbytes(raw.type)
    pools = _new(before, after, "qsa_pool")
    assert len(pools) == blocks and all(after.node(p.inputs[0]).type.shape[-2] == ratio for p in pools)
    live, others = _live(after), set(m["others"].split(", ")) if m["others"] else set()
    reads, frontier = [], [u for u in after.users(raw.name) if u.name in live and u.name not in others]
    while frontier:  # raw's live readers: slices (a stream's view) down to the takes of a block's rows
        node = frontier.pop()
        assert node.op in ("slice", "take"), f"{raw.name} is still read by {node.op} {node.name}"
        reads += [node] if node.op == "take" else []
        frontier += [u for u in after.users(node.name) if u.name in live] if node.op == "slice" else []
    assert sum(nbytes(n.type) for n in reads) == _int(m["read"]) and len(reads) == blocks
    assert _int(m["saved"] or m["pool_saved"]) == nbytes(raw.type) - _int(m["read"])
    assert others == {u.name for u in before.users(raw.name) if u.name != pool.name and u.name in _live(before)}
    assert others <= {u.name for u in after.users(raw.name)}, "a reader the remark names no longer reads the raw keys"
    # the ops between the pool and the block keys
    chain = (before.ancestors([keys.name]) & before.descendants([pool.name])) - {pool.name}
    assert int(m["n_ops"] or 0) == len(chain)
    assert (m["ops"] or "") == ", ".join(sorted({before.node(n).op for n in chain}))
    n_blocks = stored.type.shape[1]
    if m["still"] is not None:  # store=pooled: the chain runs on the whole cache
        assert _int(m["all"]) == n_blocks and m["still"].startswith(keys.name)
        assert all(n in live and after.node(n).type.shape[1] == n_blocks for n in chain)
        return
    assert _int(m["not_on"]) == n_blocks and not chain & live, "the whole-cache chain still runs"
    replayed = after.descendants([p.name for p in pools]) - {writer.name}
    sums = [after.node(n) for n in replayed if after.node(n).op == "sum"]
    if m["pb"] is None:
        assert not sums or all(after.node(s.inputs[0]).type.shape[:2] == (1, 1) for s in sums)
        return
    padded, whole = (int(m["pb"]), int(m["pp"])), (int(m["kb"]), _int(m["knb"]))
    assert whole == keys.type.shape[:2] and sums
    for s in sums:  # each one-block reduction runs over the padded rows, in the regime of the whole cache's
        x = after.node(s.inputs[0]).type.shape
        assert x[:2] == padded
        big = math.prod(x) >= XLA_ROW_REDUCTION_ELEMENTS
        assert big == (math.prod(whole) * x[-1] >= XLA_ROW_REDUCTION_ELEMENTS), (x, whole)


# ---------------------------------------------------------------------- raise-attention

RAISED = re.compile(
    r"softmax\(q·kᵀ·scale \+ mask\)·v -> sdpa: q (?P<q>\S+) \([\w-]+\), k (?P<k>\S+) \([\w-]+\), "
    r"v (?P<v>[^\s·/]+)(?P<v_steps>(?:[·/][^ ]+)*) \([\w-]+\); "
    r"(?P<hq>\d+) query heads over (?P<hkv>\d+) KV heads "
    r"\(GQA (?P<gqa>\d+)\); S=(?P<s>\d+) T=(?P<t>\d+) D=(?P<d>\d+); scale (?P<scale>\S+); mask (?P<mask>.*?)"
    r"(?P<rounding>; rounding: the source computes q·kᵀ in (?P<qk>\w+), the softmax in (?P<sm>\w+), "
    r"P·V in (?P<pv>\w+)"
    r"(?:; .*)?; sdpa\((?P<dtype>\w+)\) rounds as its target does)?"
    r"(?P<fills>(?:; fill \S+ masks exactly while every row's highest unmasked score is >= \S+)*)"
    r"(?:; logit_softcap (?P<softcap>\S+))?(?:; sinks (?P<sinks>.+))?"
)
FILL = re.compile(r"; fill (\S+) masks exactly while every row's highest unmasked score is >= (\S+)")
STEP = re.compile(r"([·/])([^·/]+)")


def _raised(before: Graph, after: Graph, r: Remark, m: re.Match, ctx: _Context) -> None:
    (call,) = [n for n in _new(before, after, "sdpa") if n.name.startswith(f"{r.node}_sdpa")]
    (b, hq, s, d), (_b, hkv, t, dk), (_b2, _h, _t, dv), *mask = _shapes(after, call.name)
    assert (int(m["hq"]), int(m["hkv"]), int(m["gqa"])) == (hq, hkv, hq // hkv) and hq % hkv == 0
    assert (int(m["s"]), int(m["t"]), int(m["d"])) == (s, t, d) == (s, t, dk)
    assert float(m["scale"]) == float(f"{call.attrs['scale']:g}") and call.attrs["causal"] == "none"
    assert (m["mask"] == "none") == (not mask)
    for role, operand in zip("qkv", call.inputs):  # each operand is computed from the root the remark names
        assert m[role] in after.ancestors([operand]) | {operand}, f"{role} does not read {m[role]}"
    if call.type.dtype is not DType.float32:
        assert m["rounding"], "a half-precision sdpa without its rounding clause"
    if m["rounding"]:
        assert m["dtype"] == m["pv"] == call.type.dtype.short
        pv = before.node(r.node) if r.node in before else None
        if pv is not None:  # q·kᵀ: the one matmul the probabilities come from
            probs = [before.node(n) for n in before.ancestors([pv.inputs[0]])]
            (qk,) = [n for n in probs if n.op == "matmul"]
            exps = {n.name for n in probs if n.op == "exp"}  # the softmax: fused, or its normalizing div
            (sm,) = [n for n in probs if n.op == "softmax" or n.op == "div" and exps & before.ancestors([n.name])]
            assert (m["qk"], m["sm"], m["pv"]) == (qk.type.dtype.short, sm.type.dtype.short, pv.type.dtype.short)
    cap = call.attrs.get("logit_softcap")
    assert (m["softcap"] is None) == (cap is None) and (cap is None or float(m["softcap"]) == float(f"{cap:g}"))
    assert (m["sinks"] is not None) == (call.sinks is not None), "sinks stated iff the sdpa has them"
    for fill, bound in FILL.findall(m["fills"]):  # exp(fill - m) is 0 in float64 once m >= fill + 1024
        assert m["mask"] != "none" and float(bound) == float(fill) + 1024, (fill, bound)
        assert float(bound) <= -(2**24 if call.type.dtype is not DType.float16 else 31728), bound  # docs §1.2
    v_path = [after.node(n) for n in after.ancestors([call.inputs[2]]) if n not in before]
    for op, factor in STEP.findall(m["v_steps"]):  # each scale the remark puts on v is applied to v
        kind = "mul" if op == "·" else "div"
        constants = {c for n in v_path if n.op == kind for c in _constants(after, n)}
        assert float(factor) in {float(f"{c:g}") for c in constants}, f"v is not {kind} by {factor}"


def _constants(graph: Graph, node: Node) -> list[float]:
    return [float(graph.node(i).attrs["value"][0]) for i in node.inputs if graph.node(i).op == "constant"]


# ---------------------------------------------------------------------- dispatch

Check = Callable[..., None]
CHECKED: dict[tuple[str, str], list[tuple[re.Pattern, Check]]] = {
    ("dce", "applied"): [(DCE_INPUT, _dce_input), (DCE_SUMMARY, _dce_summary)],
    ("narrow-inputs", "applied"): [(NARROWED, _narrowed)],
    ("narrow-inputs", "declined"): [(p, _narrow_declined) for p in (NOT_ONLY_SLICES, SLICES_DIFFER, WHOLE_SLICE)],
    ("head-chunk", "applied"): [(CHUNKED, _chunked)],
    ("head-chunk", "declined"): [(FITS, _fits)],
    ("qsa-gather", "applied"): [(GATHERED, _gathered)],
    ("qsa-pool-cache", "applied"): [(POOL_CACHE, _pool_cache)],
    ("raise-attention", "applied"): [(RAISED, _raised)],
}
AFTER: dict[str, Callable[[Graph, Graph, _Context], None]] = {"dce": _dce_after, "narrow-inputs": _narrow_after}
# the reason codes of declines whose words are not parsed (each precondition's decline is tested where it is)
UNPARSED_DECLINES = frozenset({"interface", "unused", "too_many_rows", "no_candidates"})


def check_remarks(
    before: Graph,
    after: Graph,
    remarks: list[Remark],
    pass_: Pass | None = None,
    arrays: Mapping[str, np.ndarray] | None = None,
) -> int:
    """Check every measurable claim of ``remarks`` (``pass_``'s, run on ``before``) against ``before``/``after``.

    ``arrays`` (inputs by name) lets the checks evaluate values too. Returns the number of remarks checked.
    """
    checked, ctx = 0, _Context(pass_, arrays)
    for r in remarks:
        patterns = CHECKED.get((r.pass_name, r.kind))
        if patterns is None or (r.kind == "declined" and r.reason in UNPARSED_DECLINES):
            continue
        matches = [(p.fullmatch(r.message), check) for p, check in patterns]
        found = [(m, check) for m, check in matches if m]
        if r.pass_name == "raise-attention" and r.rule != "attention":
            continue  # canonicalize's and the softmax rule's rewrites: checked by the differential tests
        assert found, f"remark of a checked kind no longer parses (update tests/passes/claims.py): {r}"
        m, check = found[0]
        try:
            check(before, after, r, m, ctx)
        except Exception as exc:  # a name the graphs lack, an attribute that is not there: the claim is wrong too
            raise AssertionError(f"{r}\n  does not hold: {type(exc).__name__}: {exc}") from exc
        checked += 1
    passes = {r.pass_name for r in remarks}
    for name, check_after in AFTER.items():
        if name in passes:
            check_after(before, after, ctx)
    return checked


def fuzzed(families: tuple[str, ...], n: int) -> list[Case]:
    """The first ``n`` graphs (seeds 0..n-1) of each of the fuzzer's ``families``, with their inputs."""
    return [FAMILIES[f](Choices(random.Random(seed))) for f in families for seed in range(n)]


def audit(
    pass_: Pass, cases: list[Case], before: Callable[[Graph], Graph] = lambda g: g, anchor: str | None = None
) -> Counter:
    """Run ``pass_`` on each case's graph (through ``before`` first) and check its remarks; counts per remark kind.

    ``anchor``: the op of the pass's rule; each node of that op (the candidates) gets exactly one remark.
    """
    counts: Counter = Counter()
    for case in cases:
        graph = before(case.graph)
        result = PassManager([pass_]).run(graph)
        candidates = sorted(n.name for n in graph.nodes() if n.op == anchor)
        if candidates:
            assert sorted(r.node for r in result.remarks) == candidates, "not one remark per candidate"
        counts["checked"] += check_remarks(graph, result.graph, result.remarks, pass_, case.arrays)
        counts.update(r.kind for r in result.remarks)
    return counts
