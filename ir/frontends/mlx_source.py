"""The user's source lines of MLX primitives: ``mx.export_function`` records carry none.

:class:`LineRecorder` finds them during the import's own export, at the cost of
one line tracer: it runs the function under :func:`sys.settrace` and, at every
line of user code (anything outside MLX, attnpass and the standard library),
notes each new array in the frame's locals or return value with that line; the
export returns those arrays as extra outputs, so the records say which
primitive made each, and :meth:`LineRecorder.lines` gives every primitive the
first line at which an array depending on it appeared.

:func:`locate` is the fallback for a failing primitive that has no such line
(a function whose outputs are not arrays, an export that refused the extra
outputs): it calls the function again (lazily: nothing is evaluated) under the
same tracer, exports every array it recorded in one export (a cost linear in
the graph, like the import's), and returns the first line whose arrays contain
the failing primitive: same name, arguments and operand and result types, or
failing that the same name. The replay is best effort: a function whose state
the failed import already changed (a KV cache it updated) may take another
path, and then ``None`` is returned.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator, Sequence

from attnpass.ir.core.types import SourceLoc

_LIBRARY_DIRS: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not user code: MLX, attnpass's IR and the standard library."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        import mlx

        ir_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        mlx_dirs = [os.path.abspath(p) for p in mlx.__path__]
        _LIBRARY_DIRS = tuple(os.path.join(d, "") for d in (*mlx_dirs, ir_dir, sysconfig.get_paths()["stdlib"]))
    return _LIBRARY_DIRS


def _is_user(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_library_dirs())


def raised_at(exc: BaseException) -> SourceLoc | None:
    """The innermost line of user code in ``exc``'s traceback (where a function did what raised), or None."""
    loc, tb = None, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_user(code.co_filename):
            loc = SourceLoc(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return loc


def _signature(record: dict) -> tuple:
    """What identifies a primitive across exports: name, arguments, operand and result types."""

    def types(values: list) -> tuple:
        return tuple((tuple(shape), str(dtype)) for _key, shape, dtype in values)

    return record["name"], repr(record.get("arguments", ())), types(record["inputs"]), types(record["outputs"])


class LineRecorder:
    """The user line at which each array first appears while the export traces the function."""

    def __init__(self) -> None:
        import mlx.core as mx

        self.mx = mx
        self.found: list[tuple[Any, SourceLoc]] = []  # (array, line) in the order seen, kept alive
        self.seen: set[int] = set()
        self.lines_of: dict[FrameType, int] = {}
        self.count: int | None = None  # the function's own outputs; None: nothing recorded

    def _note(self, frame: FrameType, line: int, values: Sequence[Any]) -> None:
        loc = None
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, self.mx.array) and id(item) not in self.seen:
                    self.seen.add(id(item))
                    loc = loc or SourceLoc(frame.f_code.co_filename, line, frame.f_code.co_name)
                    self.found.append((item, loc))

    def trace(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        if event == "call":
            return self.trace if _is_user(frame.f_code.co_filename) else None
        if event == "line":
            if frame in self.lines_of:
                self._note(frame, self.lines_of[frame], list(frame.f_locals.values()))
            self.lines_of[frame] = frame.f_lineno
        elif event == "return":
            self._note(frame, frame.f_lineno, [arg, *frame.f_locals.values()])
            self.lines_of.pop(frame, None)
        return self.trace

    def wrap(self, fn: Callable, example_args: Sequence[Any]) -> Callable:
        """``fn`` for the export: traced, returning its outputs and then every array it recorded (not the
        example arguments themselves: the export replaces them by tracers and refuses them as outputs)."""

        def traced(*args: Any) -> Any:
            with self._recording(example_args):
                out = fn(*args)
            outs = [out] if isinstance(out, self.mx.array) else out
            if not isinstance(outs, (list, tuple)) or not all(isinstance(o, self.mx.array) for o in outs):
                self.forget()
                return out  # a structure the extra outputs would change: no lines
            self.count = len(outs)
            return (*outs, *(array for array, _loc in self.found))

        return traced

    @contextmanager
    def _recording(self, args: Sequence[Any]) -> Iterator[None]:
        """Record afresh under the line tracer, the arguments ``args`` not counted as new arrays."""
        self.forget()
        self.seen.update(id(a) for a in args)
        previous = sys.gettrace()
        sys.settrace(self.trace)
        try:
            yield
        finally:
            sys.settrace(previous)
            self.lines_of.clear()

    def forget(self) -> None:
        """Nothing recorded: the export's outputs are the function's own."""
        self.found.clear()
        self.seen.clear()
        self.count = None

    def lines(self, records: list[dict]) -> dict[int, SourceLoc]:
        """Primitive index (among the records' primitives) -> the first line at which an array made
        from it appeared: its own output's line, or the earliest of its consumers'."""
        return {i: found[1] for i, found in enumerate(self._first(records)) if found is not None}

    def _first(self, records: list[dict]) -> list[tuple[int, SourceLoc] | None]:
        """Per primitive: (order, line) of the first recorded array made from it, or None."""
        outputs = next(r for r in records if r["type"] == "outputs")["outputs"]
        seen: dict[Any, tuple[int, SourceLoc]] = {}
        for order, ((key, _shape, _dtype), (_array, loc)) in enumerate(zip(outputs[self.count or 0 :], self.found)):
            seen.setdefault(key, (order, loc))
        primitives = [r for r in records if r["type"] == "primitive"]
        producer = {key: i for i, r in enumerate(primitives) for key, _s, _d in r["outputs"]}
        consumers: list[list[int]] = [[] for _ in primitives]
        for j, r in enumerate(primitives):
            for key, _s, _d in r["inputs"]:
                if key in producer:
                    consumers[producer[key]].append(j)
        first: list[tuple[int, SourceLoc] | None] = [None] * len(primitives)
        for i in reversed(range(len(primitives))):  # consumers come later in the records
            candidates = [seen[key] for key, _s, _d in primitives[i]["outputs"] if key in seen]
            candidates += [first[j] for j in consumers[i] if first[j] is not None]
            first[i] = min(candidates, key=lambda c: c[0], default=None)
        return first

    def replay(self, fn: Callable, args: Sequence[Any], target: dict) -> SourceLoc | None:
        """Run ``fn(*args)`` again (lazily) under the tracer, export every array it recorded in one export
        and return the first line whose arrays contain ``target``'s primitive (by signature, else by name)."""
        with self._recording(args):
            try:
                fn(*args)
            except Exception:  # the replay took another path: what it recorded so far still counts
                pass
        arrays = tuple(array for array, _loc in self.found)
        records: list[dict] = []
        try:
            self.mx.export_function(records.append, lambda: arrays)
        except Exception:  # an array the export refuses (e.g. a compiled helper's output)
            return None
        self.count = 0
        primitives = [r for r in records if r["type"] == "primitive"]
        first = self._first(records)
        named = [(r, found) for r, found in zip(primitives, first) if found and r["name"] == target["name"]]
        exact = [found for r, found in named if _signature(r) == _signature(target)]
        best = min(exact or [found for _r, found in named], key=lambda found: found[0], default=None)
        return best[1] if best else None


def locate(fn: Callable, args: Sequence[Any], record: dict, *, compile_off: bool) -> SourceLoc | None:
    """The user line that created ``record``'s primitive when ``fn(*args)`` runs again, or None."""
    import mlx.core as mx

    if compile_off:
        mx.disable_compile()
    try:
        return LineRecorder().replay(fn, args, record)
    finally:
        if compile_off:
            mx.enable_compile()


__all__ = ["LineRecorder", "locate", "raised_at"]
