"""Compile per input signature: the driver behind ``backends.mlx.compile`` and ``backends.jax.jit``.

On the first call with a new signature (the shapes and dtypes of the array
arguments and the values of the static ones) the function is imported
(``from_mlx`` / ``from_jax``), the pipeline rewrites the graph, the result is
lowered to the backend's target and wrapped in the backend's compiler
(``mx.compile`` / ``jax.jit``); later calls with that signature go straight to
the compiled program. A pipeline may remove unread inputs (``dce``) but not
retype or add any: the program is always called with the function's own
arguments.

Failures: with ``strict=False`` a signature whose import, pipeline, lowering or
first compiled call fails runs the original function from then on, and one
:class:`FallbackWarning` per signature (again only if it was evicted and comes
back) names the stage and the reason; with ``strict=True`` the call raises
:class:`SpecializationError`. When the import fails, the original function runs
on the call's arguments first: if it fails too, the mistake is the caller's and
its own error propagates, with no warning and nothing cached.

The cache holds at most ``max_signatures`` signatures and evicts the least
recently used (an evicted signature is rebuilt, and counted as a trace, when it
comes back). It is thread-safe: one thread builds a signature while the others
that need it wait, and calls with other signatures proceed.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import sys
import threading
import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence, TextIO

from attnpass.ir import AttnpassError, DType, Graph, ImportedGraph, TensorType, require_int
from attnpass.ir.core.arguments import argument_error, describe, require_choice
from attnpass.ir.core.types import short_repr
from attnpass.ir.frontends.importing import graph_name
from attnpass.lowering import Program, lower
from attnpass.passes import (
    Decline, Pass, PassManager, PassResult, Remark, default_pipeline, format_pipeline, parse_pipeline,
)  # fmt: skip

MAX_SIGNATURES = 64
RAISE = "raise-attention"  # imported graphs hold attention as primitives: raise it to sdpa before anything else
NUMERICS = ("pipeline", "source")  # whatever the pipeline computes (docs/numerics.md), or the function's own bits
SOURCE_EXACT = ("canonicalize", "dce")  # the passes numerics="source" allows: they keep every bit, on every target
SUMMARY_AFTER = 8  # explain() prints the summary form past this many signatures


def wrapper_pipeline(device: str, target: str | None = None) -> list[Pass]:
    """The pipeline a wrapper runs when given none: ``raise-attention``, then the device's default pipeline.

    ``device`` is ``"cpu"``, ``"metal"``, ``"gpu"`` or ``"tpu"``, ``target`` the wrapper's backend
    (``"mlx"``, ``"jax"``: decompose-sdpa's remarks name it). The device part is
    :func:`attnpass.passes.default_pipeline` with ``keep_signature=True``: the passes that
    would add or retype inputs (``qsa-pool-cache``, ``narrow-inputs``) are left out, since
    the program is called with the function's own arguments.
    """
    return parse_pipeline(RAISE) + default_pipeline(device, keep_signature=True, target=target)


def numerics_passes(where: str, numerics: str, pipeline: str | Sequence[Pass] | None) -> list[Pass] | None:
    """The passes of ``numerics="source"`` (:data:`SOURCE_EXACT`, or ``pipeline`` when it holds only those; an
    ArgumentError naming any other); None for ``"pipeline"`` (the wrapper's own choice)."""
    require_choice(where, "numerics", numerics, NUMERICS)
    if numerics == "pipeline":
        return None
    passes = parse_pipeline(",".join(SOURCE_EXACT)) if pipeline is None else as_passes(pipeline)
    changing = [p.name for p in passes if p.name not in SOURCE_EXACT]
    if changing:
        raise argument_error(
            where, "pipeline", format_pipeline(passes), f"only {' and '.join(SOURCE_EXACT)} with numerics='source'",
            f"{', '.join(changing)} change(s) the arithmetic; leave numerics='pipeline' to run it",
        )  # fmt: skip
    return passes


def as_passes(pipeline: str | Sequence[Pass]) -> list[Pass]:
    """A pipeline given as text (``"raise-attention,dce"``) or as passes, as a list of passes."""
    if isinstance(pipeline, str):
        return parse_pipeline(pipeline)
    passes = list(pipeline)
    wrong = [p for p in passes if not isinstance(p, Pass)]
    if wrong:
        raise TypeError(f"pipeline: {wrong[0]!r} is not a Pass (give pipeline text or a list of passes)")
    return passes


def check_callable(fn: object, wrapper: str) -> None:
    """``fn`` must be the function to compile; anything else (a pipeline given positionally) is a TypeError."""
    if not callable(fn):
        raise TypeError(
            f"{wrapper}: fn must be the function to compile, got {fn!r} ({type(fn).__name__}); "
            "options are keywords (pipeline=..., strict=...), and without fn the call returns the decorator"
        )


class FallbackWarning(UserWarning):
    """A signature runs the original function (``strict=False``); the message names the stage and why."""


class SpecializationError(AttnpassError):
    """``strict=True``: a signature could not be imported, rewritten, lowered or compiled."""


def static_spec(value: Any) -> tuple:
    """The signature entry of a static (non-array) argument: its type and value, or that it cannot be hashed."""
    try:
        hash(value)
    except TypeError:
        return ("unhashable", type(value).__qualname__)
    return ("static", type(value), value)


def static_text(name: str, value: Any) -> str:
    """``causal=True``: a static argument in a signature's text, bounded; a foreign array by its type and shape."""
    if getattr(value, "shape", None) is not None and getattr(value, "dtype", None) is not None:
        return f"{name}={describe(value)}"
    return f"{name}={short_repr(value)}"


def array_text(name: str, shape: Sequence[int], dtype: str) -> str:
    """``q:bf16[1,24,1,128]``, the IR's spelling where the dtype is an IR dtype."""
    try:
        return f"{name}:{TensorType(tuple(shape), DType.parse(dtype))}"
    except AttnpassError:
        return f"{name}:{dtype}{list(shape)}"


@dataclass
class Rebuild:
    """Turns a program's outputs into the traced function's output structure, which ``structure`` is set to
    when the function runs (until then the outputs as they are).

    A frontend's traced function writes here rather than into its :class:`Traceable`: a closure that held its
    Traceable would make a reference cycle, and the arrays of each trace would outlive it until Python's
    cycle collector ran (a decode loop tracing a new cut kept every earlier cut's buffers alive).
    """

    structure: Callable[[Any], Any] | None = None

    def __call__(self, out: Any) -> Any:
        return out if self.structure is None else self.structure(out)


@dataclass
class Traceable:
    """One signature, ready to import: ``fn`` takes only the dynamic arrays (named), static values are bound
    (``fn`` holds no dynamic array of its own).

    ``text`` spells the signature; ``unstatic`` names an argument that cannot be static (unhashable),
    and ``rebuild`` turns the program's outputs into the function's output structure (learnt when ``fn`` runs).
    """

    text: str
    fn: Callable[..., Any]
    arrays: list
    unstatic: str | None = None
    rebuild: Rebuild = field(default_factory=Rebuild)


def name_parameters(call: Callable, names: Sequence[str], like: Callable) -> None:
    """Name ``call``'s positional parameters ``names`` and ``call`` itself after ``like``: the graph's names."""
    positional = inspect.Parameter.POSITIONAL_ONLY
    params = [inspect.Parameter(n if n.isidentifier() else f"arg{i}", positional) for i, n in enumerate(names)]
    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__name__ = graph_name(like)


class Frontend(abc.ABC):
    """What a backend contributes: signature keys, the import, its target and its compiler."""

    target: str

    @abc.abstractmethod
    def device(self) -> str:
        """The device the default pipeline is chosen for: ``"cpu"``, ``"metal"``, ``"gpu"`` or ``"tpu"``."""

    @abc.abstractmethod
    def key(self, args: tuple, kwargs: dict) -> tuple[Hashable, list]:
        """The signature key of a call and its dynamic arrays in input order (the hot path: keep it cheap)."""

    @abc.abstractmethod
    def traceable(self, fn: Callable, args: tuple, kwargs: dict) -> Traceable:
        """The call as a function of its dynamic arrays, for the importer."""

    @abc.abstractmethod
    def import_graph(self, t: Traceable) -> ImportedGraph:
        """Import ``t.fn`` on ``t.arrays``."""

    @abc.abstractmethod
    def compile(self, fn: Callable) -> Callable:
        """The backend's compiler applied to a generated program function."""

    @abc.abstractmethod
    def fallback(self, fn: Callable) -> Callable:
        """What runs a signature that could not be compiled: the original function."""


@dataclass(frozen=True)
class Specialization:
    """What one signature compiled to, or why it runs the original function.

    ``imported`` is the imported graph and its captured arrays, ``result`` the
    pipeline's result (``graph``, ``remarks`` and ``ops`` are shortcuts),
    ``program`` the lowered program; ``reason`` is None when compiled, else the
    failed stage and its error, or the message of ``declined`` (the wrapper's
    ``decline`` hook's decision); ``seconds`` is the time the signature took to
    build; ``call(arrays)`` runs the compiled program on a call's array
    arguments (None when the signature runs the original function).
    """

    signature: str
    pipeline: str
    imported: ImportedGraph | None
    result: PassResult | None
    program: Program | None
    reason: str | None
    seconds: float
    call: Callable[[list], Any] | None = field(default=None, repr=False, compare=False)
    declined: Decline | None = None

    @property
    def compiled(self) -> bool:
        return self.reason is None

    @property
    def graph(self) -> Graph | None:
        """The rewritten graph (None when the import or the pipeline failed)."""
        return self.result.graph if self.result is not None else None

    @property
    def remarks(self) -> tuple[Remark, ...]:
        return self.result.remarks if self.result is not None else ()

    @functools.cached_property
    def ops(self) -> Counter[str]:
        """How many nodes of each op the rewritten graph computes (inputs not counted; empty without a graph)."""
        return Counter(n.op for n in self.graph.nodes() if n.op != "input") if self.graph is not None else Counter()

    def explain(self, *, graph: bool = False, verbose: bool = False) -> str:
        """The signature, what it compiled to (or the fallback reason) and its remarks; the graph if asked.

        The remarks are summarised (:func:`remark_summary`: one line per distinct decision, with its
        count); ``verbose=True`` lists every remark whole, with its source location.
        """
        ms = self.seconds * 1e3
        if self.compiled:
            ops = ", ".join(f"{op} {n}" for op, n in self.ops.most_common())
            status = f"compiled in {ms:.0f} ms to {self.ops.total()} op(s): {ops or 'none'}"
        else:
            status = f"runs the original function: {self.reason}"
        lines = [f"{self.signature}  [{self.pipeline}]  {status}"]
        lines += [f"  {r}" for r in self.remarks] if verbose else [f"  {line}" for line in remark_summary(self.remarks)]
        if graph and self.graph is not None:
            lines += ["  " + line for line in str(self.graph).splitlines()]
        return "\n".join(lines)


NODES_LISTED = 4  # node names a summary line lists before "(+N more)"


def decision(remark: Remark) -> str:
    """The kind of decision a remark records, what :func:`remark_summary` groups by.

    Its rule (when not the pass) and reason code (when not the kind) in parentheses, then its
    message's leading clause (``strategy decomposed (device cpu)``) when it has a short one; without
    either, the whole message.
    """
    tags = [t for t in (remark.rule, remark.reason) if t not in (None, remark.pass_name, remark.kind)]
    head, sep, _rest = remark.message.partition(": ")
    clause = head if sep and len(head) <= 60 else ""
    if tags:
        return f"({', '.join(tags)})" + (f" {clause}" if clause else "")
    return clause or remark.message


def remark_summary(remarks: Sequence[Remark]) -> list[str]:
    """One line per distinct (pass, kind, :func:`decision`), in first-seen order.

    A decision made once is its remark without the location; one made N times is
    ``[pass] kind xN decision: node, node, ...`` (every node of a decline, the first
    :data:`NODES_LISTED` of a rewrite). The ``rule hits`` analysis of multi-rule passes is
    left out: the applied lines count the hits, and its zero-hit rules say nothing.
    """
    groups: dict[tuple[str, str, str], list[Remark]] = {}
    for r in remarks:
        if r.reason == "rule_hits":
            continue
        groups.setdefault((r.pass_name, r.kind, decision(r)), []).append(r)
    lines = []
    for (pass_name, kind, what), group in groups.items():
        if len(group) == 1:
            lines.append(str(dataclasses.replace(group[0], loc=None)))
            continue
        nodes = list(dict.fromkeys(r.node for r in group if r.node))
        shown = nodes if kind == "declined" else nodes[:NODES_LISTED]  # every declined node is named
        listed = ", ".join(shown) + (f" (+{len(nodes) - len(shown)} more)" if len(shown) < len(nodes) else "")
        lines.append(f"[{pass_name}] {kind} x{len(group)} {what}" + (f": {listed}" if listed else ""))
    return lines


SIGNATURES_LISTED = 3  # signatures a fallback line of the summary lists before "(+N more)"


def signatures_summary(entries: Sequence[Specialization]) -> list[str]:
    """The summary form of many signatures: how many compiled, the fallbacks grouped by reason, then one line
    per distinct (pass, kind, :func:`decision`) over all of them with its remark count and in how many
    signatures it was made (``rule hits`` analyses left out, as in :func:`remark_summary`)."""
    compiled = sum(e.compiled for e in entries)
    seconds = sum(e.seconds for e in entries)
    lines = [f"  {compiled} compiled, {len(entries) - compiled} run the original function; built in {seconds:.1f} s"]
    fallbacks: dict[str, list[str]] = {}
    for e in entries:
        if not e.compiled:
            fallbacks.setdefault(str(e.reason), []).append(e.signature)
    for reason, signatures in fallbacks.items():
        more = f" (+{len(signatures) - SIGNATURES_LISTED} more)" if len(signatures) > SIGNATURES_LISTED else ""
        listed = "; ".join(signatures[:SIGNATURES_LISTED])
        lines.append(f"  runs the original function x{len(signatures)}: {reason}: {listed}{more}")
    groups: dict[tuple[str, str, str], list[int]] = {}
    for index, e in enumerate(entries):
        for r in e.remarks:
            if r.reason != "rule_hits":
                groups.setdefault((r.pass_name, r.kind, decision(r)), []).append(index)
    for (pass_name, kind, what), made in groups.items():
        lines.append(f"  [{pass_name}] {kind} x{len(made)} {what}: in {len(set(made))} of {len(entries)} signature(s)")
    lines.append("  (explain(summary=False) prints each signature)")
    return lines


def raised_attention_dtypes(entry: Specialization) -> tuple[set[str], set[str]]:
    """The dtypes of the attentions raise-attention raised in ``entry`` (each raised attention's output in the
    imported graph) and of the function's outputs: ``({"bf16"}, {"f32"})`` for a float32 model whose attention
    computes in bfloat16 (EasyDeL's default ``attn_dtype``)."""
    if entry.imported is None:
        return set(), set()
    graph = entry.imported.graph
    attention = {graph.node(r.node).type.dtype.short for r in entry.remarks
                 if r.pass_name == RAISE and r.kind == "applied" and r.rule == "attention" and r.node in graph}  # fmt: skip
    return attention, {graph.node(o).type.dtype.short for o in graph.outputs}


def numerics_note(entries: Sequence[Specialization], numerics: str | None) -> str:
    """What the programs compute against the function (docs/numerics.md), for the summary's first line: the bound
    of each dtype the raised attentions compute in, and, where a half-float attention sits in a float32 function,
    that its rounding reaches the float32 outputs (they are not held to float32's 1e-5)."""
    if numerics == "source":
        return f"the function's own, bit for bit (numerics='source': only {' and '.join(SOURCE_EXACT)} run)"
    raised = [e for e in entries if any(r.pass_name == RAISE and r.kind == "applied" and r.rule == "attention"
                                        for r in e.remarks)]  # fmt: skip
    if not raised:
        return "no attention raised: the function's arithmetic (docs/numerics.md)"
    attention, outputs = set(), set()
    for e in raised:
        dtypes, outs = raised_attention_dtypes(e)
        attention |= dtypes
        outputs |= outs if dtypes - {"f32"} else set()  # the outputs of signatures with a half-float attention
    half = sorted(attention - {"f32"})
    bounds = ["float32 within 1e-5 of the function"] if "f32" in attention or not attention else []
    if half:
        bounds.append(f"{'/'.join(half)} attention within two steps of its output's largest value in that dtype (on "
                      "JAX closer to float32)")  # fmt: skip
    if half and "f32" in outputs:
        bounds.append(f"a {'/'.join(half)} attention inside a float32 function (EasyDeL's default attn_dtype) carries "
                      "that rounding into the float32 outputs: they are not held to 1e-5")  # fmt: skip
    option = "; numerics='source' keeps the function's own" if numerics is not None else ""
    return (
        f"attention raised to sdpa in {len(raised)} of {len(entries)} signature(s) is computed by the target's "
        "attention call or decompose-sdpa (on MLX's CPU that call's own ops, elsewhere in float32), not in the "
        f"function's op order: {'; '.join(bounds)} (docs/numerics.md)" + option
    )


def check_calling_convention(before: Graph, after: Graph) -> None:
    """The rewritten graph must take a subset of the imported inputs, unchanged, and give the same outputs."""
    for name in after.inputs:
        if name not in before.inputs:
            raise AttnpassError(f"the pipeline added input {name}; a drop-in program takes the function's arguments")
        if after.node(name).type != before.node(name).type:
            raise AttnpassError(
                f"the pipeline changed input {name} from {before.node(name).type} to {after.node(name).type}; "
                "a drop-in program takes the function's own arguments (leave narrow-inputs out)"
            )
    types = [[g.node(o).type for o in g.outputs] for g in (before, after)]
    if types[0] != types[1]:
        raise AttnpassError(f"the pipeline changed the outputs from {types[0]} to {types[1]}")


def bind_program(program: Program, imported: ImportedGraph, n_args: int, compiled: Callable) -> Callable[[list], Any]:
    """``call(arrays)``: the compiled program fed with the call's arrays and the captured params, by input name."""
    arg_index = {name: i for i, name in enumerate(imported.graph.inputs[:n_args])}
    slots: list[tuple[int | None, Any]] = []
    for name in program.input_names:
        if name in arg_index:
            slots.append((arg_index[name], None))
        else:
            slots.append((None, program.target.from_numpy(imported.params[name])))

    def call(arrays: list) -> Any:
        return compiled(*[arrays[i] if i is not None else value for i, value in slots])

    return call


class _SignatureCache:
    """LRU map signature key -> Specialization; one builder per key, the others wait for it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Specialization] = OrderedDict()
        self._building: dict[Hashable, threading.Event] = {}

    def get(self, key: Hashable, build: Callable[[], tuple[Specialization, tuple]]) -> tuple[Specialization, tuple]:
        """The entry of ``key`` and ``()``; from the thread that built it, the entry and what ``build`` returned."""
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    return entry, ()
                pending = self._building.get(key)
                if pending is None:
                    pending = self._building[key] = threading.Event()
                    break
            pending.wait()
        try:
            entry, first = build()
            with self._lock:
                self._entries[key] = entry
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        finally:
            with self._lock:
                del self._building[key]
            pending.set()
        return entry, first

    def values(self) -> list[Specialization]:
        with self._lock:
            return list(self._entries.values())


class CompiledFunction:
    """A function compiled by attnpass per input signature; call it as the original.

    ``pipeline`` is text or passes; None is :func:`wrapper_pipeline` for the
    frontend's device when the wrapper is made. ``specializations`` lists the
    cached signatures (least recently used first), ``specialization(*args)`` the
    one of a call, ``traces`` counts the signatures built so far, and
    ``explain()`` prints each signature with its remarks (past :data:`SUMMARY_AFTER`
    of them, their decisions grouped by kind). ``numerics`` (None: the wrapper offers
    no choice) is ``"pipeline"`` or ``"source"``, which runs only :data:`SOURCE_EXACT`,
    so the program computes every bit as the function does. ``decline``, given the
    pipeline's result, may return a :class:`~attnpass.passes.infra.rewrite.Decline` to run the original
    function instead: the signature is then neither lowered nor compiled (a decision, not a
    failure: no warning, even with ``strict``). ``fallback=False`` is for a function that is not
    the user's (``optimize``'s programs, written by attnpass): a signature that cannot be compiled
    never runs it, its caller runs its own original (the client's function), and calling the
    wrapper on such a signature raises :class:`SpecializationError`.
    """

    def __init__(
        self,
        fn: Callable,
        frontend: Frontend,
        *,
        pipeline: str | Sequence[Pass] | None,
        strict: bool,
        max_signatures: int,
        name: str,
        decline: Callable[[PassResult], Decline | None] | None = None,
        numerics: str | None = None,
        fallback: bool = True,
    ) -> None:
        require_int(name, "max_signatures", max_signatures)
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._frontend = frontend
        self._fallback = frontend.fallback(fn) if fallback else None
        passes = numerics_passes(name, numerics, pipeline) if numerics is not None else None
        if passes is None:
            passes = wrapper_pipeline(frontend.device(), frontend.target) if pipeline is None else as_passes(pipeline)
        self.numerics = numerics
        self._passes = tuple(passes)
        self.pipeline = format_pipeline(self._passes)
        self.strict = strict
        self._decline = decline
        self._wrapper_name = name
        self._fn_name = getattr(fn, "__qualname__", None) or repr(fn)
        self._cache = _SignatureCache(max_signatures)
        self._count_lock = threading.Lock()
        self.traces = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, arrays = self._frontend.key(args, kwargs)
        entry, first = self._cache.get(key, lambda: self._build(args, kwargs, arrays))
        if first:
            return first[0]
        if entry.call is None:
            if self._fallback is None:
                raise SpecializationError(f"{self._wrapper_name}({self._fn_name}) on {entry.signature}: {entry.reason}")
            return self._fallback(*args, **kwargs)
        return entry.call(arrays)

    def specialization(self, *args: Any, **kwargs: Any) -> Specialization:
        """The specialization of this call's signature (building it, with one call, if it is not cached)."""
        key, arrays = self._frontend.key(args, kwargs)
        return self._cache.get(key, lambda: self._build(args, kwargs, arrays))[0]

    @property
    def specializations(self) -> list[Specialization]:
        return self._cache.values()

    def explain(
        self, *, graphs: bool = False, file: TextIO | None = None, verbose: bool = False, summary: bool | None = None
    ) -> None:
        """Print every cached signature: what it compiled to or why not, and a summary of its remarks.

        ``verbose=True`` prints every remark whole instead (:meth:`Specialization.explain`);
        ``graphs=True`` adds each rewritten graph; ``file`` defaults to stdout. ``summary=True`` prints
        the numerics and the decisions of all signatures grouped by kind (:func:`signatures_summary`)
        instead of each signature; None chooses it past :data:`SUMMARY_AFTER` signatures unless
        ``graphs`` or ``verbose`` asks for each one.
        """
        out = file if file is not None else sys.stdout
        entries = self.specializations
        head = f"{self._wrapper_name}({self._fn_name}): {len(entries)} signature(s) cached, {self.traces} trace(s)"
        print(head, file=out)
        if summary is None:
            summary = len(entries) > SUMMARY_AFTER and not (graphs or verbose)
        if summary:
            print(f"  numerics: {numerics_note(entries, self.numerics)}", file=out)
            for line in signatures_summary(entries):
                print(line, file=out)
            return
        for entry in entries:
            print(entry.explain(graph=graphs, verbose=verbose), file=out)

    def _build(self, args: tuple, kwargs: dict, arrays: list) -> tuple[Specialization, tuple]:
        """Import, rewrite, lower, compile, call once: the entry and ``(output,)``, or a fallback entry and the
        original function's ``(output,)`` when the import failed (it ran to tell a caller's mistake), else ``()``."""
        with self._count_lock:
            self.traces += 1
        start = time.perf_counter()
        stage, text = "import", "(arguments)"
        imported = result = program = None
        try:
            t = self._frontend.traceable(self._fn, args, kwargs)
            text = t.text
            if t.unstatic is not None:
                raise AttnpassError(t.unstatic)
            imported = self._frontend.import_graph(t)
            stage = "pipeline"
            result = PassManager(self._passes).run(imported.graph)
            check_calling_convention(imported.graph, result.graph)
            declined = self._decline(result) if self._decline is not None else None
            if declined is not None:
                seconds = time.perf_counter() - start
                entry = Specialization(text, self.pipeline, imported, result, None, declined.message, seconds)
                return dataclasses.replace(entry, declined=declined), ()
            stage = "lowering"
            program = lower(result.graph, self._frontend.target)
            stage = "compiled call"
            call = bind_program(program, imported, len(arrays), self._frontend.compile(program.fn))
            out = t.rebuild(call(arrays))
        except Exception as exc:
            failure = exc
        else:
            failure = None
        if failure is not None:
            # a failed import may be the caller's own mistake: the function run plainly (outside the handler,
            # so its error carries no import failure) raises it, and that error is the one the caller sees
            runs_here = self._fallback is not None
            first = (self._fallback(*args, **kwargs),) if stage == "import" and runs_here else ()
            reason = f"{stage} failed: {type(failure).__name__}: {failure}"
            where = f"{self._wrapper_name}({self._fn_name}) on {text}"
            if self.strict:
                raise SpecializationError(f"{where}: {reason}") from failure
            runs = "runs the original function" if runs_here else "is not compiled: its caller runs its own function"
            warnings.warn(f"{where} {runs}: {reason}", FallbackWarning, stacklevel=5)
            seconds = time.perf_counter() - start
            return Specialization(text, self.pipeline, imported, result, program, reason, seconds), first
        rebuild, seconds = t.rebuild, time.perf_counter() - start

        def run(arrays: list) -> Any:
            return rebuild(call(arrays))

        return Specialization(text, self.pipeline, imported, result, program, None, seconds, run), (out,)

    def __repr__(self) -> str:
        cached = len(self.specializations)
        return f"<{self._wrapper_name} of {self._fn_name}: {cached} signature(s), {self.traces} trace(s)>"


__all__ = [
    "CompiledFunction", "FallbackWarning", "Frontend", "MAX_SIGNATURES", "Specialization", "SpecializationError",
    "NUMERICS", "Rebuild", "SOURCE_EXACT", "SUMMARY_AFTER", "Traceable", "array_text", "as_passes", "check_callable",
    "check_calling_convention", "decision", "name_parameters", "numerics_note", "numerics_passes",
    "raised_attention_dtypes", "remark_summary", "signatures_summary", "static_spec", "static_text",
    "wrapper_pipeline",
]  # fmt: skip
