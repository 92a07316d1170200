"""``optimize(model)``: a model's attention (every registered client function it calls) through attnpass programs.

``optimize`` replaces the client functions (:mod:`.clients`: mlx-lm's and mlx-vlm's attention helpers, mlx-vlm
Qwen4-Exp's QSA dispatch) in the modules defining the model's layers, installs the recorders the cache adapters'
proofs read (:mod:`.caches`), and gives the model a subclass whose ``__call__`` (and mlx-vlm's
``_speculative_verify``; a ``language_model``'s too, which mlx-vlm's generate calls directly) marks it active, per
thread. Each attention call of an active model goes to :meth:`OptimizedModel.attend`, which asks its cache's
adapter one question (:meth:`~.caches.CacheAdapter.plan`): a decline, with a reason code of
:data:`~.reasons.ROUTER_REASONS`, or a plan, whose bound (:mod:`.bounds`) may still decline it before its
arguments are built; a planned call's signature is then compiled once (:mod:`.programs`) and may itself be declined
on its rewritten graph (fused calls, masked QSA, short contexts). A declined call runs the client's own function,
bit for bit. :meth:`OptimizedModel.restore` (or leaving a ``with`` block) undoes everything. The router holds no
per-cache-class knowledge; docs/dropin.md says what each cache kind proves and the numerics of a routed call.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from attnpass.ir import AttnpassError, require_int
from attnpass.ir.core.arguments import require_bool
from attnpass.ir.core.switches import env_switch
from attnpass.ir.core.types import native_dtype_name as dtype_name
from attnpass.passes import Decline, Pass

from ..specialize import MAX_SIGNATURES, CompiledFunction
from .bounds import Bounds, known_short
from .caches import ADAPTERS, Plan, Routed, adapter_for
from .caches.base import CacheAdapter
from .calls import ACTIVE, LOCK, Call, Patch, patch, recorded, unpatch
from .check import CHECK_ENV, REWRITTEN, CheckError, difference, loosest, where
from .clients import CLIENTS, Client, client_of
from .compiled import MLXFrontend
from .masks import Masks
from .programs import PROGRAMS, compile_program

ENTRY_POINTS = ("__call__", "_speculative_verify")  # the model's methods that run its layers (MTP verify: mlx-vlm)


class OptimizedModel:
    """What :func:`optimize` returns: routing counts, the compiled programs, :meth:`explain` and :meth:`restore`.

    ``routed`` counts the attention calls that ran an attnpass program, ``declined`` the others by reason code
    (``declines`` holds the last :class:`~attnpass.passes.Decline` of each code, its message and figures);
    ``programs`` maps a program name (:data:`~.programs.PROGRAMS`) to its
    :class:`~attnpass.backends.specialize.CompiledFunction` once a call has needed it, whose
    ``specializations`` hold each signature's rewritten graph and remarks; ``traces`` counts the signatures
    built; ``modules`` maps each module of the model's layers that calls a client to that
    :class:`~.clients.Client`.
    """

    def __init__(
        self, model: Any, modules: dict[str, Client], *, pipeline: str | Sequence[Pass] | None, strict: bool,
        max_signatures: int, min_keys: int | None, check: bool = False,
    ) -> None:  # fmt: skip
        self.model = model
        self.check = check
        self.modules = dict(modules)  # module name -> the client it calls
        self.routed = 0
        self.unchecked = 0  # check=True: routed calls whose client output could not be evaluated (not compared)
        self.declined: Counter[str] = Counter()
        self.declines: dict[str, Decline] = {}
        self.programs: dict[str, CompiledFunction] = {}
        self.bounds: Bounds = {}  # filled by the programs' bound declines
        self._options = {"strict": strict, "max_signatures": max_signatures, "min_keys": min_keys}
        self._pipeline = pipeline
        self._original_class = type(model)
        self._entered: list[tuple[Any, type]] = []  # (module, its own class) given an entered subclass
        self._patched: list[tuple[Any, str]] = []
        self._lock = threading.Lock()
        self._masks = Masks()
        self._restored = False
        self._layers: dict[int, str] = {}  # module id -> its path in the model (check=True names the layer)

    @property
    def traces(self) -> int:
        return sum(c.traces for c in list(self.programs.values()))

    @property
    def pipeline(self) -> str:
        """The pipeline the programs compile with, as text (the device's wrapper pipeline unless one was given)."""
        return self.program("attention").pipeline

    def program(self, name: str) -> CompiledFunction:
        """The compiled function of program ``name``, made the first time it is asked for."""
        found = self.programs.get(name)
        if found is None:
            with self._lock:
                found = self.programs.get(name)
                if found is None:
                    spec = PROGRAMS[name]
                    found = compile_program(spec, self._pipeline, **self._options, bounds=self.bounds)
                    self.programs[name] = found
        return found

    @contextmanager
    def active(self) -> Iterator[None]:
        """Where the model's calls run: this thread's attention comes here, the caches' fetches are recorded.

        Outside the model (a benchmark timing :meth:`attend`), fetch and attend inside one ``with opt.active():``.
        """
        token = ACTIVE.set(Call(self))
        try:
            yield
        finally:
            ACTIVE.reset(token)

    def attend(self, client: Client, *args: Any, **kwargs: Any) -> Any:
        """One call of ``client`` with its arguments: its compiled program, or the client's function when declined."""
        call = client.call(recorded(self), self._masks, *args, **kwargs)
        original = client.function()
        return self._dispatch(client, call, lambda: original(*args, **kwargs))

    def _dispatch(self, client: Client, call: Any, original: Callable[[], Any]) -> Any:
        """``call`` through its cache adapter's plan, or ``original()`` with the decline counted."""
        adapter = adapter_for(client, call.cache)
        found = adapter.plan(call) if isinstance(adapter, CacheAdapter) else adapter
        if isinstance(found, Plan):
            bound = PROGRAMS[found.program].bound
            short = (
                None if bound is None else known_short(self.bounds, bound, dtype_name(call.queries.dtype), found.rows)
            )
            if short is None:
                return self._run(found.build(), original, call.cache)
            found = short
        return self._decline(found, original)

    def _run(self, routed: Routed, original: Callable[[], Any], cache: Any) -> Any:
        """The compiled program of ``routed``'s signature on its arrays, or ``original()`` when it is declined (a
        signature that failed to import, rewrite or lower is declined ``no_program``: the client's function runs,
        never attnpass's own program on real arrays)."""
        entry = self.program(routed.program).specialization(*routed.args)
        if entry.compiled:
            with self._lock:
                self.routed += 1
            if routed.streams is None:
                out = entry.call(routed.given)
            else:
                import mlx.core as mx

                out = mx.concatenate([entry.call(given) for given in routed.streams], axis=0)
            if self.check:
                self._check(routed, entry.signature, out, original(), cache)
            return out
        found = entry.declined or Decline("no_program", f"no compiled program: {entry.reason.splitlines()[0]}")
        return self._decline(found, original)

    def _check(self, routed: Routed, signature: str, out: Any, expected: Any, cache: Any) -> None:
        """``check=True``: raise :class:`~.check.CheckError` when ``out`` is not the client's ``expected`` as the
        program states (:mod:`.check`), naming the layer, the cache and the signature. Where the client's own
        output cannot be evaluated (its inputs are what MLX cannot compute here: a float16 mixture of experts on
        CPU, which a test builds and never evaluates), nothing is compared and both stay lazy, as without the
        check: the call is counted in :attr:`unchecked`."""
        import mlx.core as mx

        try:
            mx.eval(expected)
        except Exception:  # noqa: BLE001  (MLX's own refusal of the client's computation: nothing to compare)
            with self._lock:
                self.unchecked += 1
            return
        numerics = PROGRAMS[routed.program].numerics
        if self._pipeline is not None or MLXFrontend().device() != "cpu":
            numerics = loosest(numerics, REWRITTEN)
        found = difference(out, expected, numerics)
        if found is not None:
            raise CheckError(
                f"optimize(check=True): the attention call of {where(self.model, self._layers)} "
                f"(cache {type(cache).__name__}, program {routed.program} on {signature}): {found}"
            )

    def _decline(self, found: Decline, original: Callable[[], Any]) -> Any:
        """``original()``, the decline counted by its code."""
        with self._lock:
            self.declined[found.reason] += 1
            self.declines[found.reason] = found
        return original()

    NOT_THEIRS = frozenset({"no_candidates", "not_latent", "mask_not_selection", "qsa_form", "gather_form",
                            "not_head_chunked", "no_structured_mask"})  # fmt: skip
    """Decline codes saying a graph holds nothing a pass rewrites: :meth:`explain`'s short form names such a pass
    on one line instead of listing its declines (mla-absorb, qsa-gather and dsa-gather on a llama)."""
    REPORT_WIDTH = 120  # :meth:`explain`'s short form cuts longer lines (``full=True`` prints them whole)

    def explain(self, *, full: bool = False, graphs: bool = False, file: TextIO | None = None) -> None:
        """Print the routing counts, the declines by reason code (with the bound behind each and the option that
        moves it), then per program its signatures' decisions grouped by kind, one line each, leaving out the
        passes that found nothing of theirs in any signature (named on one line). ``full=True`` (or ``graphs``)
        prints every signature with its remarks, whole, instead (:meth:`CompiledFunction.explain`)."""
        out = file if file is not None else sys.stdout
        through = [f"{m} ({client.attribute})" for m, client in self.modules.items()]
        declined = Counter(dict(self.declined))  # a copy: a server's generation thread may be counting
        counts = ", ".join(f"{n} x {code}" for code, n in declined.most_common()) or "none"
        print(f"optimize({self._original_class.__name__}): routed {self.routed} attention call(s) through "
              f"{', '.join(through)}; {self.traces} trace(s) in {self.trace_seconds:.2f} s; declined: {counts}",
              file=out)  # fmt: skip
        if self.unchecked:
            print(f"  check=True: {self.unchecked} routed call(s) not compared: the client's own output could not "
                  "be evaluated (left lazy, as without the check)", file=out)  # fmt: skip
        full = full or graphs
        for code, n in declined.most_common():
            bound = self.decline_bound(code)
            line = f"  declined {code} x{n}: " + (self.declines[code].message if full or bound is None else bound)
            if bound is not None:
                line += ("" if not full else f" ({bound})") + "; optimize(min_keys=N) moves the bound, 0 routes all"
            print(line if full else self._cut(line), file=out)
        for name, compiled in list(self.programs.items()):
            if full:
                compiled.explain(graphs=graphs, verbose=False, summary=False, file=out)
            else:
                for line in self._program_lines(name, compiled):
                    print(line, file=out)
        if not full and self.programs:
            print("  (explain(full=True): every signature and its remarks, whole)", file=out)

    @property
    def trace_seconds(self) -> float:
        """The seconds the held signatures took to build (import, pipeline, lowering, compile, first call)."""
        return sum(e.seconds for c in list(self.programs.values()) for e in c.specializations)

    def decline_bound(self, code: str) -> str | None:
        """The bound behind the declines of ``code`` in words (``under 128 key rows in bfloat16``); None for a code
        that no bound decides (only ``short_context``, ``quantized_tie`` and ``fallback_ops`` have one: :mod:`.bounds`,
        :func:`.programs.kept_fallback`)."""
        found = self.declines.get(code)
        if found is None or code not in ("short_context", "quantized_tie", "fallback_ops"):
            return None
        if code == "fallback_ops":
            return f"a {found.data.get('dtype', 'float32')} call whose program would be MLX's own CPU fallback ops"
        if code == "quantized_tie":
            return f"a {found.data.get('dtype', 'half-float')} call over a quantized cache, which only ties on CPU"
        bounds = sorted((kind, least, precision.value) for (kind, _), (least, precision) in list(self.bounds.items())
                        if least)  # fmt: skip
        if not bounds:
            bounds = [("float", found.data.get("min_keys"), found.data.get("dtype"))]
        return ", ".join(
            f"under {least} key rows in {dtype}" + ("" if kind == "float" else f" over a {kind} cache")
            for kind, least, dtype in bounds
        )

    @staticmethod
    def _program_lines(name: str, compiled: CompiledFunction) -> list[str]:
        """Program ``name``'s short report: its signatures by outcome, then one line per (pass, kind, decision)
        over all of them (cut to :attr:`REPORT_WIDTH`); the passes that applied nothing and only declined with a
        code of :attr:`NOT_THEIRS` are named on the last line instead of listed."""
        from ..specialize import decision

        entries = compiled.specializations
        outcomes = Counter(
            "compiled" if e.compiled else f"declined ({e.declined.reason})" if e.declined else "failed" for e in entries
        )
        seconds = sum(e.seconds for e in entries)
        lines = [
            f"  program {name}: {len(entries)} signature(s), "
            + ", ".join(f"{n} {outcome}" for outcome, n in outcomes.most_common())
            + f"; built in {seconds:.2f} s; pipeline {compiled.pipeline}"
        ]
        for reason, n in Counter(str(e.reason) for e in entries if not e.compiled and not e.declined).items():
            lines.append(OptimizedModel._cut(f"    failed x{n}: {reason}"))
        groups: dict[tuple[str, str, str], list[int]] = {}
        codes: dict[str, set[str]] = {}  # pass -> its codes
        for index, e in enumerate(entries):
            for r in e.remarks:
                if r.reason != "rule_hits":
                    groups.setdefault((r.pass_name, r.kind, decision(r)), []).append(index)
                    codes.setdefault(r.pass_name, set()).add(r.reason if r.kind == "declined" else r.kind)
        idle = [p for p, found in codes.items() if found <= OptimizedModel.NOT_THEIRS]
        for (pass_name, kind, what), made in groups.items():
            if pass_name not in idle:
                where = f" (in {len(set(made))} of {len(entries)} signatures)" if len(entries) > 1 else ""
                lines.append(OptimizedModel._cut(f"    [{pass_name}] {kind} x{len(made)} {what}{where}"))
        if idle:
            found = ", ".join(sorted(set().union(*(codes[p] for p in idle))))
            lines.append(OptimizedModel._cut(f"    nothing to rewrite for {', '.join(idle)} ({found})"))
        return lines

    @classmethod
    def _cut(cls, line: str) -> str:
        """``line`` cut to :attr:`REPORT_WIDTH` characters, ``...`` marking the cut."""
        return line if len(line) <= cls.REPORT_WIDTH else line[: cls.REPORT_WIDTH - 3] + "..."

    def restore(self) -> None:
        """Undo :func:`optimize`: the model's own class, the clients' functions where no other model still routes."""
        with LOCK:
            if self._restored:
                return
            self._restored = True
            for module, cls in self._entered:
                module.__class__ = cls
            for owner, name in self._patched:
                unpatch(owner, name)

    def __enter__(self) -> OptimizedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "restored" if self._restored else "active"
        name = self._original_class.__name__
        return f"<OptimizedModel {name} ({state}): {self.traces} trace(s), {self.routed} routed>"


class NoClientError(AttnpassError, ValueError):
    """``optimize``: no module of the model calls a registered client function (code ``no_client``)."""

    code = "no_client"


def optimize(
    model: Any,
    pipeline: str | Sequence[Pass] | None = None,
    *,
    strict: bool = False,
    max_signatures: int = MAX_SIGNATURES,
    min_keys: int | None = None,
    check: bool | None = None,
) -> OptimizedModel:
    """Run ``model``'s attention (an mlx-lm or mlx-vlm model) through attnpass programs.

    Modules calling a registered client (:data:`~.clients.CLIENTS`: mlx-lm's or mlx-vlm's
    ``scaled_dot_product_attention``, mlx-vlm Qwen4-Exp's ``dispatch_qsa_attention``) get its programs (the
    attention programs; the QSA gather programs). ``mlx_lm.generate``, ``stream_generate``, ``batch_generate``,
    mlx-vlm's ``generate`` and speculative decoding work unchanged. ``pipeline``, ``strict`` and ``max_signatures``
    are as for :func:`attnpass.backends.mlx.compile` (for QSA calls every ``qsa-gather`` of the pipeline is given
    the selection input). A call whose program would get fewer key rows than ``min_keys`` runs the client's
    function (``short_context``, or ``quantized_tie``); None is :data:`~.bounds.MIN_KEYS` on CPU and 0
    elsewhere, and declines too, on CPU, a float32 program that would be only MLX's own fallback ops over the
    buffer's cut (``fallback_ops``: the device's ``fallback_declined``); an int replaces both (0 routes every
    depth and dtype). ``check=True`` (a shadow mode, for tests and for trying a model) also runs
    the client's function on every routed call and raises :class:`~.check.CheckError` on the first output that
    differs beyond the program's stated numerics (bit for bit under the CPU default pipeline; docs/dropin.md),
    naming the layer, the cache and the signature; None reads the switch :data:`~.check.CHECK_ENV` at this
    call (off when unset). Returns an :class:`OptimizedModel`; its ``restore()``, or leaving
    ``with optimize(model):``, undoes the change. Raises ``TypeError`` when ``model`` is not an
    ``mlx.nn.Module``, ``ValueError`` when it is already optimized or ``min_keys`` is not an int >= 0 or None,
    :class:`NoClientError` (a ``ValueError``, code ``no_client``) when none of its modules calls a client, ``PipelineError`` for a bad ``pipeline`` (at once, as ``compile``
    raises it), ``MissingExtraError`` without MLX or mlx-lm.
    """
    from attnpass.ir.core.extras import import_extra
    from attnpass.passes import PipelineError
    from attnpass.passes.infra.pipeline_text import pipeline_passes

    nn = import_extra("mlx.nn", "optimize", "mlx,zoo")
    if pipeline is not None:  # parsed now, not at the first generation that compiles a program
        try:
            pipeline = pipeline_passes(pipeline, "optimize")
        except PipelineError as exc:
            raise PipelineError(f"optimize: pipeline: {exc}") from None
    if not isinstance(model, nn.Module):
        hint = " (mlx_lm.load returns (model, tokenizer): pass the model)" if isinstance(model, tuple) else ""
        raise TypeError(
            f"optimize: expected an mlx-lm model (an mlx.nn.Module such as mlx_lm.load(path)[0]), "
            f"got {type(model).__name__} {_short(model)}{hint}"
        )
    inner = getattr(model, "language_model", None)  # mlx-vlm's generate calls a VLM's language_model directly
    entered = [model] + ([inner] if isinstance(inner, nn.Module) else [])
    for module in entered:
        if getattr(type(module), "_attnpass_optimized", None) is not None:
            raise ValueError(f"{type(module).__name__} is already optimized; restore() it first")
    names = sorted({type(m).__module__ for m in model.modules()})
    modules = {n: client for n in names if (client := client_of(sys.modules.get(n))) is not None}
    if not modules:
        raise NoClientError(
            f"optimize: no_client: no module of {type(model).__name__} ({', '.join(names)}) calls a registered "
            f"client function ({', '.join(str(c) for c in CLIENTS.values())}); {_attention_functions(names)}"
        )
    if min_keys is not None:
        require_int("optimize", "min_keys", min_keys, minimum=0, meaning="or None: MIN_KEYS on CPU")
    if check is not None:
        require_bool("optimize", "check", check)
    optimized = OptimizedModel(
        model, modules, pipeline=pipeline, strict=strict, max_signatures=max_signatures,
        min_keys=min_keys, check=env_switch(CHECK_ENV, check, default=False, subject="optimize's check")[0],
    )  # fmt: skip
    with LOCK:
        for owner, name, replace in _patches(optimized):
            patch(owner, name, replace)
            optimized._patched.append((owner, name))
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

    @functools.wraps(method)  # its signature too: mlx-lm inspects __call__ for input_embeddings
    def entered(self: Any, *args: Any, **kwargs: Any) -> Any:
        with optimized.active():
            return method(self, *args, **kwargs)

    return entered


def _patches(optimized: OptimizedModel) -> list[Patch]:
    """Every client function and recorder ``optimized`` needs, each ``(owner, attribute)`` once: the recorders of
    the adapters serving its clients whose cache module is imported (a cache of a module not imported is never
    made)."""
    found: list[Patch] = [
        (sys.modules[n], client.attribute, lambda _, client=client: client.trampoline())
        for n, client in optimized.modules.items()
    ]
    clients = {client.name for client in optimized.modules.values()}
    for adapter in ADAPTERS.values():
        if adapter.clients & clients and adapter.module in sys.modules:
            found += adapter.patches()
    unique: dict[tuple[Any, str], Patch] = {}
    for owner, name, replace in found:
        unique.setdefault((owner, name), (owner, name, replace))
    return list(unique.values())


def _attention_functions(names: Sequence[str]) -> str:
    """What the modules ``names`` call for attention, as far as their own names tell: functions named like
    attention that they define or import."""
    found = sorted(
        {
            f"{getattr(value, '__module__', '?')}.{attribute}"
            for n in names
            for attribute, value in vars(sys.modules.get(n, sys)).items()
            if "attention" in attribute.lower() and callable(value) and not isinstance(value, type)
        }
    )
    return f"its modules' attention functions: {', '.join(found)}" if found else "no attention function is imported"


def _short(value: Any) -> str:
    """``repr(value)`` on one line, cut to 60 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["NoClientError", "OptimizedModel", "optimize"]
