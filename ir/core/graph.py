"""Nodes (immutable values) and the Graph, whose topology lives in networkx.

Every node produces one value, named by the node. Graph inputs are nodes of op
``input``; their order is the program signature. A graph may carry *state*: a
resident input paired with the graph output that is its next value (a cache
a decode loop feeds back; :meth:`Graph.state_pairs`). Our classes hold op
semantics (through the registry); a ``networkx.DiGraph`` holds the edges (and
nothing else: no attribute dicts, see :func:`_topology`) and answers the
reachability and cycle queries; the stable order is a sort over the nodes'
operands. networkx is imported when the first graph is built, not with
:mod:`attnpass.ir` (it costs ~100 ms of startup).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import AbstractSet as Set
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from . import builtin as _builtin  # noqa: F401  (registers input and constant)
from .registry import AttrValue, OpDef, encode_attr, get_op
from .sharding import Sharding, normalize_mesh, normalize_sharding, sharding_problem
from .types import AttnpassError, SourceLoc, TensorType, VerifyError, check_identifier, short_repr

ROLES = ("streamed", "resident")
T = TypeVar("T")


@dataclass(frozen=True)
class Node:
    """One SSA value: ``name = op[attrs](inputs) : type``. Change means :meth:`replace`.

    ``sharding``: the value's layout over the graph's mesh, one mesh axis or None per
    dimension (:mod:`attnpass.ir.core.sharding`); None when unannotated. ``optionals``: the
    optional operands the node has, by name in its op record's order; ``inputs`` holds the
    required operands, then those.

    Passes and emitters read operands by the names the op record declares, never an optional one by
    position (``tests/passes/test_operand_reads.py`` checks): ``node.mask``, ``node.q`` (the attribute form,
    :meth:`__getattr__`) is :meth:`operand`, which type checkers see as ``str | None`` (None only for an
    absent optional operand) and which raises AttributeError naming the op's operands for a name it does not
    declare; ``node.operands`` maps every name. Change operands with :meth:`with_operands`. A variadic op's
    operands (``concat``) are read by position.
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, AttrValue]
    type: TensorType
    loc: SourceLoc | None = field(default=None, compare=False)
    sharding: Sharding | None = None
    optionals: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        object.__setattr__(self, "sharding", normalize_sharding(self.sharding))
        object.__setattr__(self, "optionals", tuple(self.optionals))

    def replace(self, **changes: Any) -> "Node":
        return replace(self, **changes)

    @property
    def opdef(self) -> OpDef:
        return get_op(self.op)

    @property
    def operands(self) -> dict[str, str | None]:
        """Operand name -> the value it reads (None: an absent optional operand), in the op record's order."""
        return self.bind(self.inputs)

    def bind(self, values: Sequence[T]) -> dict[str, T | None]:
        """``values`` standing for the inputs, one per input (their types, arrays, emitted names), by operand name."""
        return self.opdef.bind(values, self.optionals)

    def operand(self, name: str) -> str | None:
        """The value operand ``name`` reads; None when that optional operand is absent. AttributeError for a name
        the op record does not declare (or any name of a variadic op, whose operands are read by position)."""
        opdef = self.opdef
        if opdef.variadic or name not in opdef.operand_names:
            raise AttributeError(f"{self.op} {self.name}: no operand {name!r}; operands: {opdef.signature}")
        return self.operands[name]

    def __getattr__(self, name: str) -> str | None:
        """``node.q``, ``node.mask``, ...: :meth:`operand` for each operand its op record declares."""
        op = self.__dict__.get("op")  # absent while unpickling: no recursion through self.op
        if name.startswith("_") or op is None:
            raise AttributeError(name)
        try:
            opdef = get_op(op)
        except AttnpassError:
            raise AttributeError(name) from None
        if opdef.variadic or name not in opdef.operand_names:
            raise AttributeError(
                f"{op} {self.__dict__.get('name')}: no attribute or operand {name!r}; operands: {opdef.signature}"
            )
        return self.operand(name)

    def with_operands(self, **changes: str | None) -> Node:
        """This node with the named operands changed (None: an optional operand removed)."""
        inputs, optionals = self.opdef.arrange({**self.operands, **changes})
        return self.replace(inputs=inputs, optionals=optionals)


class Graph:
    """A typed attention dataflow graph with named inputs and ordered outputs.

    Build with :meth:`add_input` / :meth:`add_node` / :meth:`set_outputs` (or
    :func:`attnpass.ir.trace`). ``print(graph)`` shows the stable text form;
    :meth:`to_json` / :meth:`from_json` round-trip; :meth:`fingerprint` is a
    structural hash that ignores value names. ``mesh_axes`` names the device
    mesh that values' sharding annotations refer to (empty: no mesh).
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = check_identifier(name, "graph name")
        self._mesh: dict[str, int] = {}
        self._nodes: dict[str, Node] = {}
        self._dag = _topology()
        self._dag_shared = False  # with a copy: the first to change its edges takes a private DAG (_own_dag)
        self._rank: dict[str, int] = {}
        self._next_rank = 0
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._state: dict[str, int] = {}  # resident input -> position of its next value in the outputs
        self._order: list[str] | None = None
        self._position: dict[str, int] = {}
        self._suffix: dict[str, int] = {}  # fresh_name's first suffix to try per base: O(1), not O(uses)
        self._accepted: dict[str, tuple[Node, tuple[Node, ...]]] = {}  # the verifier's memo: node, operands it read

    # ------------------------------------------------------------------ building

    def fresh_name(self, hint: str = "v") -> str:
        """A name not used in this graph, derived from ``hint``."""
        base = hint if hint and (hint[0].isalpha() or hint[0] == "_") else f"v{hint}"
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        if base not in self._nodes:
            try:
                return check_identifier(base)
            except AttnpassError:
                base = f"{base}_"
        i = self._suffix.get(base, 1)  # every base_j with j < i is taken (remove_node keeps this true)
        while f"{base}_{i}" in self._nodes:
            i += 1
        self._suffix[base] = i
        return f"{base}_{i}"

    def add_input(
        self, name: str, type: TensorType, role: str = "streamed", loc: SourceLoc | None = None, path: str | None = None
    ) -> str:
        """Append a graph input (its position is its place in the signature); ``path``: an imported value's origin."""
        check_identifier(name, "input name")
        if name in self._nodes:
            raise VerifyError(f"graph {self.name}: duplicate name {name!r}")
        attrs = {"shape": type.shape, "dtype": type.dtype, "role": role, "path": path}
        self.insert(Node(name, "input", (), get_op("input").normalize_attrs(attrs, name), type, loc))
        self._inputs.append(name)
        return name

    def add_node(
        self,
        op: str,
        inputs: Sequence[str] | Mapping[str, str | None] = (),
        attrs: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        hint: str | None = None,
        loc: SourceLoc | None = None,
    ) -> str:
        """Add ``op(inputs)``; the shape rule computes the type (or raises ShapeError). Returns its name.

        ``inputs``: the operands by position (the required ones only), or operand name -> value for an op with
        optional operands (None or left out: absent). The value is called ``name``, or a fresh name derived
        from ``hint`` (default: the op name).
        """
        if op == "input":
            raise VerifyError("use Graph.add_input to add graph inputs")
        opdef = get_op(op)
        inputs, optionals = opdef.arrange(inputs) if isinstance(inputs, Mapping) else (tuple(inputs), ())
        for i in inputs:
            if i not in self._nodes:
                raise VerifyError(f"{op}: operand {i!r} is not defined in graph {self.name}")
        norm = opdef.normalize_attrs(attrs or {}, name)
        type_ = opdef.result_type([self._nodes[i].type for i in inputs], norm, optionals=optionals, normalized=True)
        name = check_identifier(name) if name else self.fresh_name(hint or op)
        if name in self._nodes:
            raise VerifyError(f"graph {self.name}: duplicate name {name!r}")
        node = Node(name, op, inputs, norm, type_, loc, optionals=optionals)
        self.insert(node)
        # Built by the shape rule from these very operands: what the verifier would check again (see its docstring).
        self._accepted[name] = (node, tuple(self._nodes[i] for i in inputs))
        return name

    def insert(self, node: Node) -> None:
        """Insert a node as given (no type inference; the verifier checks it). Operands may come later."""
        if node.name in self._nodes:
            raise VerifyError(f"graph {self.name}: duplicate name {node.name!r}")
        order = self._order
        self._nodes[node.name] = node
        self._own_dag().add_node(node.name)
        self._rank[node.name] = self._next_rank
        self._next_rank += 1
        self._connect(node)
        if order is not None and not self._dag.succ[node.name] and all(i in self._position for i in node.inputs):
            # The newest rank with its operands placed and no readers: the stable order puts it last. Kept, not
            # re-sorted: a pass that adds a node per rewrite and then reads users() stays linear.
            self._position[node.name] = self._position[order[-1]] + 1 if order else 0
            order.append(node.name)
            self._order = order

    def set_outputs(self, names: Sequence[str]) -> None:
        """Set the ordered outputs (any defined values)."""
        for n in names:
            if not isinstance(n, str) or n not in self._nodes:
                raise VerifyError(f"graph {self.name}: output {n!r} is not defined")
        self._outputs = list(names)

    def pair_state(self, input_name: str, output: int) -> None:
        """Declare output number ``output`` the next value of resident input ``input_name``.

        The verifier checks the pair: a resident input, an output of the same type, each
        input and each output in at most one pair.
        """
        if input_name not in self._inputs:
            raise VerifyError(f"graph {self.name}: state {short_repr(input_name)} is not a graph input")
        if input_name in self._state:
            raise VerifyError(
                f"graph {self.name}: state input {input_name} is already updated by output #{self._state[input_name]}"
            )
        self._state[input_name] = int(output)

    def state_pairs(self) -> tuple[tuple[str, int], ...]:
        """``(resident input, output position)`` per state, in signature order: what a decode loop carries."""
        return tuple((name, self._state[name]) for name in self._inputs if name in self._state)

    def is_state(self, name: str) -> bool:
        """Whether ``name`` is a state input (paired with the output that is its next value)."""
        return name in self._state

    def set_inputs(self, names: Sequence[str]) -> None:
        """Reorder the signature: ``names`` must be exactly the graph's input nodes."""
        ins = {n.name for n in self._nodes.values() if n.op == "input"}
        if sorted(map(str, names)) != sorted(ins) or len(set(names)) != len(names):
            raise VerifyError(
                f"graph {self.name}: signature {list(names)} must list each input node once: {sorted(ins)}"
            )
        self._inputs = list(names)

    def set_mesh(self, axes: Mapping[str, int] | Sequence[tuple[str, int]]) -> None:
        """Declare the mesh axes (name -> size, in mesh order) that sharding annotations may name."""
        mesh = normalize_mesh(axes)
        for node in self._nodes.values():
            problem = sharding_problem(node, mesh)
            if problem:
                raise VerifyError(f"set_mesh: value {node.name}: {problem}")
        self._mesh = mesh

    def set_sharding(self, name: str, sharding: Sequence[str | None] | None) -> None:
        """Annotate value ``name`` with ``sharding`` (one mesh axis or None per dimension; None: unannotated)."""
        node = self.node(name).replace(sharding=sharding)
        problem = sharding_problem(node, self._mesh)
        if problem:
            raise VerifyError(f"set_sharding {name}: {problem}")
        self._nodes[name] = node

    # ------------------------------------------------------------------ queries

    @property
    def mesh_axes(self) -> Mapping[str, int]:
        """The declared mesh axes, name -> size in mesh order (empty when the graph has no mesh)."""
        return MappingProxyType(self._mesh)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self._outputs)

    def node(self, name: str) -> Node:
        """The node that defines ``name`` (VerifyError if there is none)."""
        try:
            return self._nodes[name]
        except KeyError:
            raise VerifyError(f"graph {self.name}: no value named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())

    def nodes(self) -> list[Node]:
        """All nodes in a stable topological order (ties broken by insertion order)."""
        return [self._nodes[n] for n in self._topological_order() if n in self._nodes]

    def _topological_order(self) -> list[str]:
        """The cached order of ``nodes()`` (recomputed after a change), with ``_position`` to match."""
        if self._order is None:
            order = self._stable_sort() if len(self._rank) == self._dag.number_of_nodes() else None
            if order is None:  # a dangling operand (in the DAG without a rank) or a cycle: networkx says which
                order = self._sorted_by_networkx()
            self._order = order
            self._position = {n: i for i, n in enumerate(order)}
        return self._order

    def _stable_sort(self) -> list[str] | None:
        """Kahn's sort taking the lowest-ranked ready node first (networkx's lexicographical sort, without its
        generic views: the sort runs after every changing pass); None when a cycle leaves nodes unplaced."""
        rank, nodes = self._rank, self._nodes
        waiting: dict[str, int] = {}
        readers: dict[str, list[str]] = {}
        ready: list[tuple[int, str]] = []
        for name, r in rank.items():
            operands = set(nodes[name].inputs)
            if operands:
                waiting[name] = len(operands)
                for operand in operands:
                    readers.setdefault(operand, []).append(name)
            else:
                ready.append((r, name))  # ascending ranks: already a heap
        order = []
        while ready:
            _, name = heapq.heappop(ready)
            order.append(name)
            for reader in readers.get(name, ()):
                left = waiting[reader] - 1
                waiting[reader] = left
                if not left:
                    heapq.heappush(ready, (rank[reader], reader))
        return order if len(order) == len(rank) else None

    def _sorted_by_networkx(self) -> list[str]:
        import networkx as nx

        try:
            return list(nx.lexicographical_topological_sort(self._dag, key=lambda n: self._rank.get(n, -1)))
        except nx.NetworkXUnfeasible:
            cycle = " -> ".join(u for u, _ in nx.find_cycle(self._dag))
            raise VerifyError(f"graph {self.name}: cycle through {cycle}") from None

    def users(self, name: str) -> list[Node]:
        """Nodes that read ``name``, in topological order."""
        self.node(name)  # VerifyError for an unknown name
        self._topological_order()  # not nodes(): building that O(N) list per call made passes quadratic
        users = sorted(self._dag.successors(name), key=self._position.__getitem__)
        return [self._nodes[u] for u in users]

    def ancestors(self, names: Sequence[str]) -> set[str]:
        """``names`` and every value they transitively read."""
        return _reach(names, self._dag.predecessors)

    def descendants(self, names: Sequence[str]) -> set[str]:
        """``names`` and every value that transitively reads them."""
        return _reach(names, self._dag.successors)

    def input_types(self) -> list[TensorType]:
        """The graph inputs' types, in signature order."""
        return [self._nodes[n].type for n in self._inputs]

    def input_role(self, name: str) -> str:
        """``"streamed"`` or ``"resident"`` for graph input ``name``."""
        return self.node(name).attrs["role"]

    def input_nbytes(self, role: str = "streamed") -> int:
        """Bytes of the graph inputs with ``role`` that one call consumes (default: streamed)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return sum(self._nodes[n].type.nbytes for n in self._inputs if self.input_role(n) == role)

    # ------------------------------------------------------------------ mutation

    def replace_node(self, name: str, node: Node) -> None:
        """Swap the node called ``name`` for ``node`` (same name; types are re-checked by the verifier)."""
        if node.name != name:
            raise VerifyError(f"replace_node: name mismatch {name!r} vs {node.name!r}")
        self.node(name)
        self._nodes[name] = node
        dag = self._own_dag()
        dag.remove_edges_from(list(dag.in_edges(name)))
        self._connect(node)

    def replace_all_uses(self, old: str, new: str) -> int:
        """Make every reader of ``old`` (and the outputs) read ``new``; returns how many uses changed."""
        if self.node(old).type != self.node(new).type:
            raise VerifyError(
                f"replace_all_uses: {old} : {self.node(old).type} and {new} : {self.node(new).type} differ in type"
            )
        count = 0
        for reader in list(self._dag.successors(old)):  # order is irrelevant here; users() would re-sort the graph
            user = self._nodes[reader]
            if user.name == new:
                continue
            inputs = tuple(new if i == old else i for i in user.inputs)
            count += sum(1 for i in user.inputs if i == old)
            self.replace_node(user.name, user.replace(inputs=inputs))
        if old in self._outputs:
            count += self._outputs.count(old)
            self._outputs = [new if o == old else o for o in self._outputs]
        return count

    def replace_with(self, old: str, new: str) -> None:
        """Make every reader of ``old`` (and the outputs) read ``new``, then remove ``old``."""
        self.replace_all_uses(old, new)
        self.remove_node(old)

    def retype_input(self, name: str, type: TensorType) -> None:
        """Give graph input ``name`` a new type in place (same name, role, position and location).

        Its readers are not re-typed: the caller rewires them before the verifier runs.
        """
        node = self.node(name)
        if node.op != "input":
            raise VerifyError(f"retype_input: {name} is {node.op}, not a graph input")
        attrs = {**node.attrs, "shape": type.shape, "dtype": type.dtype}
        self._nodes[name] = node.replace(type=type, attrs=get_op("input").normalize_attrs(attrs))

    def remove_node(self, name: str) -> None:
        """Remove a value nobody reads (graph inputs leave the signature too)."""
        self.node(name)
        readers = sorted(self._dag.successors(name), key=self._rank.__getitem__)  # no topological sort: O(readers)
        if readers or name in self._outputs:
            raise VerifyError(f"remove_node: {name} is still used by {readers or 'the graph outputs'}")
        if name in self._state:
            raise VerifyError(f"remove_node: {name} is state, updated by output #{self._state[name]}")
        del self._nodes[name]
        del self._rank[name]
        self._accepted.pop(name, None)
        stem, _, suffix = name.rpartition("_")
        if suffix.isdigit() and self._suffix.get(stem, 0) > int(suffix):
            self._suffix[stem] = int(suffix)
        self._own_dag().remove_node(name)
        if name in self._inputs:
            self._inputs.remove(name)
        if self._order is not None:  # a node without readers leaves the stable order of the others as it was
            self._order.remove(name)
            del self._position[name]

    def remove_dead(self) -> list[Node]:
        """Remove every value no output reads, graph inputs included (they leave the signature).

        Readers go before what they read; returns the removed nodes in topological order.
        """
        return self._remove_unread(None, keep_inputs=False)

    def prune(self, values: Sequence[str]) -> list[Node]:
        """Remove what ``values`` transitively read that no output reads any more (graph inputs stay).

        The cleanup after a rewrite: only the replaced subgraph's cone is looked at, so values
        that were dead before elsewhere in the graph are left alone. Returns the removed nodes.
        """
        return self._remove_unread(self.ancestors([v for v in values if v in self._nodes]), keep_inputs=True)

    def _remove_unread(self, among: Set[str] | None, *, keep_inputs: bool) -> list[Node]:
        live = self.ancestors(self._outputs) | set(self._state)  # state inputs stay even when unread
        dead = [
            n for n in self.nodes()
            if n.name not in live and (among is None or n.name in among) and not (keep_inputs and n.op == "input")
        ]  # fmt: skip
        removed: set[str] = set()
        order, self._order = self._order, None  # the others keep their order: filtered once, not per removal
        for node in reversed(dead):  # a value some kept (dead but out-of-cone) node reads stays
            if all(reader in removed for reader in self._dag.successors(node.name)):
                self.remove_node(node.name)
                removed.add(node.name)
        if order is not None:
            self._order = [n for n in order if n not in removed]
            self._position = {n: i for i, n in enumerate(self._order)}
        return [n for n in dead if n.name in removed]

    def copy(self) -> "Graph":
        """An independent graph with the same nodes (immutable, so shared), signature and outputs."""
        g = Graph(self.name)
        g._mesh = dict(self._mesh)
        g._nodes = dict(self._nodes)
        g._dag = self._dag  # shared until either graph changes its edges (copy on write: _own_dag)
        g._dag_shared = self._dag_shared = True
        g._rank = dict(self._rank)
        g._next_rank = self._next_rank
        g._inputs = list(self._inputs)
        g._outputs = list(self._outputs)
        g._state = dict(self._state)
        g._order = None if self._order is None else list(self._order)
        g._position = dict(self._position)
        g._suffix = dict(self._suffix)
        g._accepted = dict(self._accepted)
        return g

    def _own_dag(self) -> Any:
        """The DAG, to change: a private duplicate if a copy still shares it."""
        if self._dag_shared:
            self._dag, self._dag_shared = self._dag.duplicate(), False
        return self._dag

    def _connect(self, node: Node) -> None:
        dag = self._own_dag()
        for src in node.inputs:
            if src not in dag:
                dag.add_node(src)  # dangling until defined; the verifier reports it
            dag.add_edge(src, node.name)
        self._order = None

    # ------------------------------------------------------------------ views and forms

    def verify(self) -> "Graph":
        """Run the verifier (structure, then types); returns self; raises VerifyError."""
        from .verifier import verify

        verify(self)
        return self

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)

    def __repr__(self) -> str:
        return (
            f"<Graph {self.name}: {len(self._inputs)} inputs, {len(self._nodes)} nodes, {len(self._outputs)} outputs>"
        )

    def to_json(self, indent: int | None = None) -> str:
        """The JSON form (read back with :meth:`from_json`)."""
        from .serialize import graph_to_json

        return graph_to_json(self, indent=indent)

    @staticmethod
    def from_json(text: str) -> "Graph":
        """Parse, validate and verify a graph from :meth:`to_json`; executes nothing."""
        from .serialize import graph_from_json

        return graph_from_json(text)

    def __eq__(self, other: object) -> bool:
        """Structural equality: same name, mesh, signature, outputs, state and nodes (with their sharding annotations).

        Metadata that does not change what the graph computes is ignored, as by :meth:`fingerprint`:
        source locations and an input's weight ``path`` (kept in JSON, not in the text form).
        """
        if not isinstance(other, Graph):
            return NotImplemented
        return (
            self.name == other.name
            and list(self._mesh.items()) == list(other._mesh.items())
            and self._inputs == other._inputs
            and self._outputs == other._outputs
            and self._state == other._state
            and _same_nodes(self._nodes, other._nodes)
        )

    __hash__ = None  # type: ignore[assignment]

    def fingerprint(self) -> str:
        """A stable structural hash (hex sha256) of what the graph computes.

        Value and input names, node order, source locations, dead nodes, the mesh
        and sharding annotations (placement, not arithmetic) do not enter it; ops,
        attributes, types, input positions and roles, and the dataflow into each
        output and the state pairs do.
        """
        live = self.ancestors(self._outputs)
        digests: dict[str, str] = {}
        for pos, name in enumerate(self._inputs):
            n = self._nodes[name]
            digests[name] = _sha(["input", pos, str(n.type), n.attrs["role"]])
        for n in self.nodes():
            if n.name in digests or n.name not in live:
                continue
            attrs = {k: encode_attr(v) for k, v in sorted(n.attrs.items())}
            optionals = [list(n.optionals)] if n.optionals else []
            digests[n.name] = _sha([n.op, attrs, str(n.type), [digests[i] for i in n.inputs]] + optionals)
        signature = [digests[i] for i in self._inputs]
        state = [[self._inputs.index(i), o] for i, o in self.state_pairs()]
        return _sha(["graph", signature, [digests[o] for o in self._outputs]] + ([state] if state else []))


class _NoAttributes(dict):
    """The one attribute dict of every node and edge of a topology: empty, and it stays so."""

    __slots__ = ()

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("attnpass graph topology holds no attributes: node semantics live in Node")

    def update(self, *args: Any, **kwargs: Any) -> None:
        if any(args) or kwargs:
            self.__setitem__(None, None)


_NO_ATTRIBUTES = _NoAttributes()


@functools.cache
def _topology_class() -> type:
    """A ``networkx.DiGraph`` whose nodes and edges share one empty attribute dict (networkx's documented
    ``*_attr_dict_factory`` hooks): a graph copy allocates no dict per edge, which at a few thousand nodes per pass
    is most of a copy's cost and of the collector's work."""
    import networkx as nx  # here, not at import time: see the module docstring

    class Topology(nx.DiGraph):
        def node_attr_dict_factory(self) -> dict:
            return _NO_ATTRIBUTES

        def edge_attr_dict_factory(self) -> dict:
            return _NO_ATTRIBUTES

        def duplicate(self) -> "Topology":
            """The same edges in new adjacency dicts, copied level by level (C dict copies, no per-edge calls).

            Assigning ``_node``/``_adj``/``_pred`` is networkx's supported way to swap them (its descriptors reset
            the cached views); succ and pred still share their attribute dicts, as networkx requires: all are the
            one empty dict."""
            dup = type(self)()
            dup._node = dict(self._node)
            dup._adj = {u: dict(readers) for u, readers in self._adj.items()}
            dup._pred = {v: dict(operands) for v, operands in self._pred.items()}
            return dup

    return Topology


def _topology() -> Any:
    return _topology_class()()


def _same_nodes(mine: Mapping[str, Node], theirs: Mapping[str, Node]) -> bool:
    """The same names bound to equal nodes, an input's ``path`` metadata aside (graph copies share their nodes,
    so most pairs are one object and cost an identity check)."""
    if mine.keys() != theirs.keys():
        return False
    for name, node in mine.items():
        other = theirs[name]
        if node is other or node == other:
            continue
        if not (node.op == other.op == "input" and _without_path(node) == _without_path(other)):
            return False
    return True


def _without_path(node: Node) -> Node:
    """An input node without its weight ``path`` metadata."""
    return node.replace(attrs={k: v for k, v in node.attrs.items() if k != "path"})


def _reach(names: Sequence[str], step: Callable[[str], Iterable[str]]) -> set[str]:
    """``names`` and everything ``step`` leads to from them, transitively."""
    out, stack = set(names), list(names)
    while stack:
        for other in step(stack.pop()):
            if other not in out:
                out.add(other)
                stack.append(other)
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
