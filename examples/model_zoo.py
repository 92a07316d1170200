"""The model zoo: real model code, imported, raised, lowered, and checked against the module's own output.

Tiny random-initialised models of the mlx-lm families (2 layers; 24 query and
2 KV heads where the architecture has GQA; head dim 8, hidden size 192, vocab
128), each built from its ``ModelArgs`` in code (no downloads), in three
steps: the whole model without a cache (prefill, 7 tokens), a 5-token verify
step and a 1-token decode step over an 11-token prefilled KV cache; in float32
and bfloat16. Then JAX code: ``jax.nn.dot_product_attention`` (no mask, bool
mask, bias, ``is_causal``, GQA, bf16), a hand-written GQA einsum attention
scaled by ``1 / jnp.sqrt(d)``, flax nnx ``MultiHeadAttention`` and equinox
``MultiheadAttention``.

Each case is imported (``from_mlx`` / ``from_jax``), run through
``raise-attention`` and ``head-chunk``, lowered to its own backend and
compared with the module. One row per case:

- ``imported``: yes, or no with the importer's reason;
- ``raised``: attention layers raised to ``sdpa`` / attention layers in the model;
- ``chunked``: head-chunk rewrites applied / ``sdpa`` calls eligible (q_len * gqa > 32);
- ``max err``: max |lowered program - module| (``ok`` within :func:`tolerance`: 1e-4 in f32, 2 bf16 ulps in bf16);
  with ``--everywhere``, also lowered to the other targets (4 bf16 ulps there), errors at the row's end;
- ``nodes``: graph size before -> after ``canonicalize`` (``n/a`` while no such pass is registered);
- ``remark``: the first declined attention/softmax remark, or the pass failure, when something is declined.

Run: ``.venv/bin/python examples/model_zoo.py [--everywhere] [SUBSTRING ...]`` (cases whose name contains one).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from attnpass.backends import to_numpy
from attnpass.ir import DType, Graph, ModelImportError, from_jax, from_mlx
from attnpass.lowering import lower
from attnpass.passes import PassError, PassManager, available_passes, head_chunk_plan, parse_pipeline

HQ, HKV, HEAD_DIM, LAYERS, VOCAB = 24, 2, 8, 2, 128
HIDDEN = HQ * HEAD_DIM
PROMPT, VERIFY, PREFILL = 11, 5, 7  # cached tokens; rows of a verify step; rows of a prefill without cache
STEPS = {"prefill": PREFILL, "verify": VERIFY, "decode": 1}
DTYPES = ("f32", "bf16")
TARGETS = ("numpy", "mlx", "jax")
TOKENS = np.random.default_rng(0).integers(0, VOCAB, PROMPT + PREFILL).astype(np.int32)

COMMON = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=128, num_attention_heads=HQ,
    num_key_value_heads=HKV, rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=HEAD_DIM,
    max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Each family's ModelArgs beyond COMMON (fields a family lacks are dropped): what its architecture needs.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(MOE, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=8.0),
    "gemma3_text": dict(query_pre_attn_scalar=8, sliding_window=8, sliding_window_pattern=2),
    "phi3": {},
    "deepseek_v2": dict(
        MOE,
        n_shared_experts=1,
        n_routed_experts=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        first_k_dense_replace=1,
        topk_method="greedy",
        rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),  # fmt: skip
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, intermediate_size=32),
    "glm4": dict(attention_bias=True, partial_rotary_factor=0.5),
    "granite": dict(
        logits_scaling=2.0,
        attention_multiplier=0.125,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_bias=False,
        mlp_bias=False,
    ),  # fmt: skip
    "minicpm": dict(dim_model_base=64, scale_depth=1.4, scale_emb=12.0),
    "cohere2": dict(sliding_window=8, sliding_window_pattern=2, layer_norm_eps=1e-5),
    "olmo2": {},
}


@dataclass(frozen=True)
class Case:
    """One zoo case: ``make()`` builds ``(fn, example args, reference)``; ``reference()`` is the module's own output."""

    name: str
    backend: str  # "mlx" or "jax": the importer and the lowering target
    dtype: str  # "f32" or "bf16"
    layers: int  # attention layers in the model
    make: Callable[[], tuple[Callable, tuple, Callable[[], np.ndarray]]]


@dataclass(frozen=True)
class Row:
    case: Case
    imported: str
    raised: int = 0
    chunked: tuple[int, int] = (0, 0)  # applied, eligible
    error: float | None = None
    bound: float = 0.0  # the tolerance the error is held to
    nodes: tuple[int, int] | None = None
    remark: str = ""
    elsewhere: dict[str, float] = field(default_factory=dict)  # max error lowered to each other target
    bound_elsewhere: float = 0.0  # the tolerance those are held to

    @property
    def ok(self) -> bool:
        own = self.error is not None and self.error <= self.bound
        return own and all(error <= self.bound_elsewhere for error in self.elsewhere.values())


def tolerance(dtype: str, expected: np.ndarray, *, elsewhere: bool = False) -> float:
    """The stated bound on max |lowered - module|: 1e-4 in float32; in bfloat16 two units in the last place
    of the largest output (2 * 2**-7 * max(1, max|expected|)): program and module may round fused ops
    differently (XLA fuses bf16 chains and rounds once). ``elsewhere``: lowered to a target other than the
    module's own backend, four units in bfloat16 (one backend rounds each bf16 op, the other fuses chains)."""
    if dtype == "f32":
        return 1e-4
    return (4 if elsewhere else 2) * 2.0**-7 * max(1.0, float(np.max(np.abs(expected))))


# ----------------------------------------------------------------------------- mlx-lm families


Configure = Callable[[str, Any], dict[str, Any]]
Build = Callable[[str, str, Configure], Any]  # (family, dtype, configure) -> the tiny model, cached: mlx_model


def zoo_args(family: str, module: Any) -> dict[str, Any]:
    """``ModelArgs`` keywords of a zoo family: :data:`COMMON` and its :data:`FAMILIES` entry, the fields it has."""
    fields = module.ModelArgs.__dataclass_fields__
    return {k: v for k, v in {**COMMON, **FAMILIES[family]}.items() if k in fields}


@functools.lru_cache(maxsize=None)
def mlx_model(family: str, dtype: str, configure: Configure = zoo_args) -> Any:
    """A tiny random-initialised mlx-lm model of ``family`` (weights seeded, evaluated); ``configure(family,
    module)`` gives its ``ModelArgs`` keywords."""
    import mlx.core as mx
    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(model_type=family, **configure(family, module)))
    model.set_dtype(mx.bfloat16 if dtype == "bf16" else mx.float32)
    model.eval()  # inference mode, as mlx_lm.load leaves it (models branch on self.training)
    mx.eval(model.parameters())
    return model


@contextlib.contextmanager
def bf16_gather_mm() -> Iterator[None]:
    """``mx.gather_mm`` (MoE experts) on bf16 operands as float32 products rounded once to bf16, as a bf16 GEMM
    with float32 accumulation computes it: MLX's CPU GatherMM kernel is float32-only. Evaluation only: the
    import traces the module as it is (one GatherMM primitive)."""
    import mlx.core as mx

    native = mx.gather_mm

    def gather_mm(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        if a.dtype == mx.float32:
            return native(a, b, *args, **kwargs)
        return native(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(a.dtype)

    mx.gather_mm = gather_mm
    try:
        yield
    finally:
        mx.gather_mm = native


def prefilled(
    family: str, step: str, dtype: str, configure: Configure = zoo_args, build: Build = mlx_model
) -> list | None:
    """The cache after the prompt, of the model's own kind (its ``make_cache()``, else mlx-lm's default);
    None for a prefill. ``build``: where the model comes from (another library's models, as mlx-lm's)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if step == "prefill":
        return None
    model = build(family, dtype, configure)
    cache = make_prompt_cache(model)
    with bf16_gather_mm():
        model(mx.array(TOKENS[None, :PROMPT]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def mlx_case(
    family: str, step: str, dtype: str, configure: Configure = zoo_args, layers: int = LAYERS, build: Build = mlx_model
) -> Case:
    """One step of an mlx-lm family; ``layers``: its attention layers; ``build``: as for :func:`prefilled`."""

    def make() -> tuple[Callable, tuple, Callable[[], np.ndarray]]:
        import mlx.core as mx

        model = build(family, dtype, configure)
        tokens = mx.array(TOKENS[None, PROMPT : PROMPT + STEPS[step]])
        cache = prefilled(family, step, dtype, configure, build)  # a step updates it: import and reference get one each

        def forward(tokens: Any) -> Any:
            return model(tokens, cache=cache)

        def reference() -> np.ndarray:
            with bf16_gather_mm():
                return np.array(
                    model(tokens, cache=prefilled(family, step, dtype, configure, build)).astype(mx.float32)
                )

        return forward, (tokens,), reference

    return Case(f"{family}/{step}/{dtype}", "mlx", dtype, layers, make)


# ----------------------------------------------------------------------------- JAX code


def _jax_inputs(dtype: str, kv_heads: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q [1, 5, 24, 8] and k, v [1, 11, kv_heads, 8] (JAX's [B, T, N, H] layout)."""
    rng = np.random.default_rng(seed)
    np_dtype = DType.parse("bfloat16" if dtype == "bf16" else "float32").numpy
    shapes = ((1, VERIFY, HQ, HEAD_DIM), (1, PROMPT, kv_heads, HEAD_DIM), (1, PROMPT, kv_heads, HEAD_DIM))
    return tuple(rng.standard_normal(s).astype(np_dtype) for s in shapes)


def dot_product_attention_case(variant: str) -> Case:
    """``jax.nn.dot_product_attention``: none, mask, bias, causal (24/24 heads); gqa, bf16 (24/2, causal)."""
    dtype = "bf16" if variant == "bf16" else "f32"

    def make() -> tuple[Callable, tuple, Callable[[], np.ndarray]]:
        import jax

        q, k, v = _jax_inputs(dtype, HKV if variant in ("gqa", "bf16") else HQ)
        rng = np.random.default_rng(1)
        extra: tuple = ()
        if variant == "mask":
            extra = (rng.random((1, 1, VERIFY, PROMPT)) < 0.7) | (np.arange(PROMPT) == 0)

            def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
                return jax.nn.dot_product_attention(q, k, v, mask=mask)
        elif variant == "bias":
            extra = (rng.standard_normal((1, HQ, VERIFY, PROMPT)).astype(np.float32),)

            def attend(q: Any, k: Any, v: Any, bias: Any) -> Any:
                return jax.nn.dot_product_attention(q, k, v, bias=bias)
        else:
            causal = variant in ("causal", "bf16")

            def attend(q: Any, k: Any, v: Any) -> Any:
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

        args = (q, k, v, *([extra] if variant == "mask" else extra))
        return attend, args, _jitted_reference(attend, *args)

    return Case(f"jax.dot_product_attention/{variant}", "jax", dtype, 1, make)


def einsum_case(dtype: str) -> Case:
    """Hand-written GQA attention: grouped einsums, scores divided by ``jnp.sqrt(d)``, ``jax.nn.softmax``."""

    def make() -> tuple[Callable, tuple, Callable[[], np.ndarray]]:
        import jax
        import jax.numpy as jnp

        def gqa_attention(q: Any, k: Any, v: Any) -> Any:
            b, s, h, d = q.shape
            groups = q.reshape(b, s, k.shape[2], h // k.shape[2], d)
            scores = jnp.einsum("bskgd,btkd->bkgst", groups, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
            probs = jax.nn.softmax(scores, axis=-1)
            return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, h, d)

        args = _jax_inputs(dtype, HKV)
        return gqa_attention, args, _jitted_reference(gqa_attention, *args)

    return Case(f"jax.einsum-gqa/{dtype}", "jax", dtype, 1, make)


def _randomized(tree: Any, dtype: str, seed: int) -> Any:
    """``tree`` with every array shape (a ``jax.ShapeDtypeStruct`` from ``eval_shape``) filled with random
    values of ``dtype``: a random-initialised module without running the library's initialisers op by op."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    jdtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(0.2 * rng.standard_normal(leaf.shape), jdtype)

    return jax.tree_util.tree_map(fill, tree)


def _tokens(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    np_dtype = DType.parse("bfloat16" if dtype == "bf16" else "float32").numpy
    return np.random.default_rng(seed).standard_normal(shape).astype(np_dtype)


def flax_case(dtype: str) -> Case:
    """flax nnx ``MultiHeadAttention`` (24 heads of 8), self-attention over 5 tokens."""

    def make() -> tuple[Callable, tuple, Callable[[], np.ndarray]]:
        import jax.numpy as jnp
        from flax import nnx

        jdtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
        shapes = nnx.eval_shape(
            lambda: nnx.MultiHeadAttention(
                num_heads=HQ, in_features=HIDDEN, qkv_features=HIDDEN, decode=False, dtype=jdtype, rngs=nnx.Rngs(0)
            )
        )
        graphdef, state = nnx.split(shapes)
        mha = nnx.merge(graphdef, _randomized(state, dtype, 4))
        x = _tokens(dtype, (1, VERIFY, HIDDEN), 2)

        def self_attention(x: Any) -> Any:
            return mha(x)

        return self_attention, (x,), _jitted_reference(self_attention, x)

    return Case(f"flax.nnx.MultiHeadAttention/{dtype}", "jax", dtype, 1, make)


def equinox_case(dtype: str) -> Case:
    """equinox ``MultiheadAttention`` (24 heads of 8, no batch axis), self-attention over 5 tokens."""

    def make() -> tuple[Callable, tuple, Callable[[], np.ndarray]]:
        import equinox as eqx
        import jax

        shapes = eqx.filter_eval_shape(eqx.nn.MultiheadAttention, HQ, HIDDEN, key=jax.random.PRNGKey(0))
        mha = _randomized(shapes, dtype, 5)
        x = _tokens(dtype, (VERIFY, HIDDEN), 3)

        def self_attention(x: Any) -> Any:
            return mha(x, x, x)

        return self_attention, (x,), _jitted_reference(self_attention, x)

    return Case(f"equinox.MultiheadAttention/{dtype}", "jax", dtype, 1, make)


def _jitted_reference(fn: Callable, *args: Any) -> Callable[[], np.ndarray]:
    """The module's output as JAX code runs: under ``jax.jit``."""
    import jax

    return lambda: np.asarray(jax.jit(fn)(*args), np.float32)


def cases() -> list[Case]:
    """Every zoo case, mlx-lm families first."""
    out = [mlx_case(f, step, d) for f in FAMILIES for step in STEPS for d in DTYPES]
    out += [dot_product_attention_case(v) for v in ("none", "mask", "bias", "causal", "gqa", "bf16")]
    out += [make(d) for make in (einsum_case, flax_case, equinox_case) for d in DTYPES]
    return out


# ----------------------------------------------------------------------------- one case, one row


def _apply(pipeline: str, graph: Graph) -> tuple[Graph, list, str]:
    """``(graph after the pipeline, its remarks, "")``; on a pass failure the graph unchanged and the failure."""
    try:
        result = PassManager(parse_pipeline(pipeline)).run(graph)
    except PassError as exc:
        return graph, [], str(exc).splitlines()[0]
    return result.graph, list(result.remarks), ""


def _eligible(graph: Graph) -> int:
    """sdpa calls head-chunk would split (q_len * gqa over its budget)."""
    count = 0
    for node in graph.nodes():
        if node.op == "sdpa":
            hq, s = graph.node(node.inputs[0]).type.shape[1:3]
            count += head_chunk_plan(s, hq, graph.node(node.inputs[1]).type.shape[1]) is not None
    return count


def _sizes(graph: Graph) -> tuple[int, int] | None:
    """Node counts before and after ``canonicalize``, when a pass of that name is registered."""
    if "canonicalize" not in available_passes():
        return None
    after, _remarks, failure = _apply("canonicalize", graph)
    return None if failure else (len(graph), len(after))


def _jit(fn: Callable) -> Callable:
    import jax

    return jax.jit(fn)


def _silence(raised: int, layers: int) -> str:
    if raised == layers:
        return ""
    return f"raise-attention left no remark on the {layers - raised} layer(s) it did not raise"


def _max_error(got: Any, expected: np.ndarray) -> float:
    got64, expected64 = np.asarray(got, np.float64), expected.astype(np.float64)
    # equal values differ by 0, infinities included (phi3small's logits mask writes -inf); a NaN is never ok
    return float(np.max(np.where(got64 == expected64, 0.0, np.abs(got64 - expected64))))


def _leaves(tree: Any) -> list:
    """The arrays of an argument or output in order: itself, a list or tuple of arrays, or a pytree's leaves."""
    if hasattr(tree, "shape"):
        return [tree]
    if isinstance(tree, (tuple, list)) and all(hasattr(x, "shape") for x in tree):
        return list(tree)
    import jax

    return jax.tree_util.tree_leaves(tree)


def host_args(args: tuple) -> list[np.ndarray]:
    """The example arguments as a lowered program takes them: numpy arrays, a pytree (JAX) by its leaves."""
    return [to_numpy(leaf) for arg in args for leaf in _leaves(arg)]


def flat_output(out: Any) -> np.ndarray:
    """One output as a numpy array; several (a step's logits and its updated cache) raveled into one, in order."""
    leaves = _leaves(out)
    if len(leaves) == 1:
        return to_numpy(leaves[0])
    return np.concatenate([np.asarray(to_numpy(o), np.float64).ravel() for o in leaves])


def _run_on(graph: Graph, target: str, args: tuple, params: dict[str, Any]) -> np.ndarray:
    """``graph`` lowered to ``target`` and run as that backend usually runs (JAX under ``jax.jit``)."""
    program = lower(graph, target)
    compiled = _jit(program.fn) if target == "jax" else program.fn
    return flat_output(compiled(*program.bind(*host_args(args), **params)))


def run_case(case: Case, targets: tuple[str, ...] = ()) -> Row:
    """Import, raise, chunk, lower and compare one case; ``targets``: also lowered to these (the case's own
    backend always)."""
    fn, args, reference = case.make()
    importer = from_mlx if case.backend == "mlx" else from_jax
    try:
        imported = importer(fn, *args)
    except ModelImportError as exc:
        return Row(case, f"no: {str(exc).splitlines()[0]}")
    raised, remarks, failure = _apply("raise-attention", imported.graph)
    chunked, chunk_remarks, chunk_failure = _apply("head-chunk", raised)
    sdpa = sum(node.op == "sdpa" for node in raised.nodes())
    # the attention rule's declines (raise-attention's canonicalize sweep declines folds too: not the point here)
    declined = [str(r) for r in remarks if r.kind == "declined" and r.rule in ("attention", "softmax")]
    common = dict(
        raised=sdpa,
        chunked=(sum(r.kind == "applied" for r in chunk_remarks), _eligible(raised)),
        nodes=_sizes(imported.graph),
        remark=failure or chunk_failure or (declined[0] if declined else "") or _silence(sdpa, case.layers),
    )
    expected = reference()
    error = _max_error(_run_on(chunked, case.backend, args, imported.params), expected)
    elsewhere = {t: _max_error(_run_on(chunked, t, args, imported.params), expected) for t in targets}
    elsewhere.pop(case.backend, None)
    return Row(
        case, "yes", error=error, elsewhere=elsewhere, bound=tolerance(case.dtype, expected),
        bound_elsewhere=tolerance(case.dtype, expected, elsewhere=True), **common,
    )  # fmt: skip


def format_row(row: Row) -> str:
    nodes = "n/a" if row.nodes is None else f"{row.nodes[0]} -> {row.nodes[1]}"
    applied, eligible = row.chunked
    chunked = f"{applied}/{eligible}" if eligible or applied else "-"
    error = "-" if row.error is None else f"{row.error:.1e} {'ok' if row.ok else 'FAIL'}"
    imported = row.imported if len(row.imported) <= 60 else row.imported[:59] + "…"
    remark = row.remark if len(row.remark) <= 110 else row.remark[:109] + "…"
    raised = f"{row.raised}/{row.case.layers}" if row.imported == "yes" else "-"
    line = f"{row.case.name:<36} {imported:<8} {raised:>6} {chunked:>7} {error:>12} {nodes:>12}  {remark}"
    others = [f"{t} {e:.1e} {'ok' if e <= row.bound_elsewhere else 'FAIL'}" for t, e in row.elsewhere.items()]
    return line + (f"  [elsewhere: {', '.join(others)}]" if others else "")


HEADER = f"{'case':<36} {'imported':<8} {'raised':>6} {'chunked':>7} {'max err':>12} {'nodes':>12}  remark"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run the cases whose name contains one of these")
    parser.add_argument(
        "--everywhere", action="store_true", help="also lower each case to the other targets (numpy, mlx, jax)"
    )
    options = parser.parse_args(argv)
    selected = [c for c in cases() if not options.only or any(s in c.name for s in options.only)]
    print(HEADER)
    failed = 0
    for case in selected:
        row = run_case(case, TARGETS if options.everywhere else ())
        failed += not row.ok
        print(format_row(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
