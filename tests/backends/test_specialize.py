"""Drop-in wrappers: ``attnpass.backends.mlx.compile`` and ``attnpass.backends.jax.jit`` (backends/specialize.py)."""

from __future__ import annotations

import io
import re
import threading
import warnings

import numpy as np
import pytest

from attnpass import passes
from attnpass.backends import assert_primitive_counts, to_numpy
from attnpass.backends.specialize import (
    CompiledFunction,
    FallbackWarning,
    SpecializationError,
    Traceable,
    wrapper_pipeline,
)
from attnpass.passes import format_pipeline
from tests.util import assert_bits_equal, assert_close, requires

SCALE = 128**-0.5
FUSED = "raise-attention,dce"  # leaves the attention one fused call: the wrapper's results are the call's bits


def test_wrapper_pipeline_raises_attention_first_then_the_device_pipeline_that_keeps_the_signature():
    assert (
        format_pipeline(wrapper_pipeline("cpu"))
        == "raise-attention,mla-absorb{crossover_factor=0.85},qsa-gather{prefill_tile=16},dsa-gather{tile_bytes=8388608},"
        "block-sparse,decompose-sdpa,dce"
    )
    assert format_pipeline(wrapper_pipeline("metal", "mlx")) == (
        "raise-attention,mla-absorb,qsa-gather{prefill_tile=16},dsa-gather{tile_bytes=33554432},head-chunk,"
        "decompose-sdpa{device=metal,target=mlx},dce"
    )
    for device, target in (("cpu", "mlx"), ("cpu", "jax"), ("metal", "mlx"), ("gpu", "jax"), ("tpu", None)):
        rest = wrapper_pipeline(device, target)[1:]
        assert rest == passes.default_pipeline(device, keep_signature=True, target=target)
        # the program is called with the function's own arguments: no pass that adds or retypes inputs
        assert not {"qsa-pool-cache", "narrow-inputs"} & {p.name for p in rest}


@requires("mlx.core")
class TestMLXCompile:
    @staticmethod
    def attention(q, k, v, scale, mask=None):
        import mlx.core as mx

        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    @staticmethod
    def inputs(t=64, dtype="bfloat16"):
        import mlx.core as mx

        mx.random.seed(3)
        q = mx.random.normal((1, 24, 1, 128)).astype(getattr(mx, dtype))
        k, v = (mx.random.normal((1, 2, t, 128)).astype(getattr(mx, dtype)) for _ in range(2))
        mask = mx.arange(t)[None, None, None] < t - 3
        return q, k, v, mask

    def test_one_trace_per_signature_and_the_fused_call_bit_for_bit(self):
        from attnpass.backends.mlx import compile

        fast = compile(self.attention, pipeline=FUSED)
        q, k, v, mask = self.inputs()
        for _ in range(3):
            assert_bits_equal(to_numpy(fast(q, k, v, SCALE, mask=mask)), to_numpy(self.attention(q, k, v, SCALE, mask)))
        assert fast.traces == 1
        fast(*self.inputs(t=96)[:3], SCALE, mask=self.inputs(t=96)[3])  # new shapes
        fast(q, k, v, 0.125, mask=mask)  # new static value
        fast(q, k, v, SCALE)  # mask=None is static too
        assert fast.traces == 4 and len(fast.specializations) == 4

    def test_each_signature_shows_its_rewritten_graph_and_remarks(self, capsys):
        from attnpass.backends.mlx import compile

        fast = compile(self.attention, pipeline=FUSED)
        q, k, v, mask = self.inputs()
        entry = fast.specialization(q, k, v, SCALE, mask=mask)
        assert entry.compiled and entry.reason is None
        assert [n.op for n in entry.graph.nodes() if n.op == "sdpa"] == ["sdpa"]
        assert any(r.pass_name == "raise-attention" and r.kind == "applied" for r in entry.remarks)
        assert "mx.fast.scaled_dot_product_attention" in entry.program.source
        fast.explain(graphs=True)
        out = capsys.readouterr().out
        assert "1 signature(s) cached, 1 trace(s)" in out
        kv = "k:bf16[1,2,64,128], v:bf16[1,2,64,128]"
        assert f"q:bf16[1,24,1,128], {kv}, scale={SCALE!r}, mask:bool[1,1,1,64]" in out
        assert "[raise-attention] applied" in out and "= sdpa[" in out

    def test_compile_with_options_only_is_the_decorator_with_those_options(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        attention = self.attention

        @compile(pipeline="raise-attention,head-chunk", strict=True)
        def wide(q, k, v, mask):
            return attention(q, k, v, SCALE, mask)

        assert isinstance(wide, CompiledFunction) and wide.__name__ == "wide"
        assert wide.pipeline == "raise-attention,head-chunk" and wide.strict
        _q, k, v, mask = self.inputs()
        q = mx.random.normal((1, 24, 4, 128)).astype(mx.bfloat16)  # q_len*gqa = 48 > 32: head-chunk splits it
        assert_close(to_numpy(wide(q, k, v, mask)), to_numpy(attention(q, k, v, SCALE, mask)))
        (entry,) = wide.specializations
        chunked = [r for r in entry.remarks if r.pass_name == "head-chunk"]
        assert [r.kind for r in chunked] == ["applied"] and entry.ops["sdpa"] > 1
        assert entry.program.source.count("mx.fast.scaled_dot_product_attention") == entry.ops["sdpa"]
        assert compile(self.attention).pipeline == format_pipeline(wrapper_pipeline("cpu", "mlx"))  # bare form
        with pytest.raises(TypeError, match="fn must be the function to compile, got 'raise-attention'"):
            compile("raise-attention")

    def test_explain_summarises_one_line_per_decision_and_verbose_prints_every_remark(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        fast = compile(lambda x: sum(x * float(i) + i for i in range(1, 12)))  # one line, a dozen constant folds
        fast(mx.ones((3,)))
        (entry,) = fast.specializations
        full, short = io.StringIO(), io.StringIO()
        fast.explain(file=full, verbose=True)
        fast.explain(file=short)
        assert len(full.getvalue().splitlines()) == 2 + len(entry.remarks) >= 18  # the flood: every remark whole
        summary = short.getvalue().splitlines()
        assert (
            len(summary) <= 10 and summary[:2] == full.getvalue().splitlines()[:2]
        )  # one line per pass: 8 before mla-absorb and dsa-gather joined
        assert not re.search(r"\b0, |rule hits", short.getvalue())  # no zero-hit rule lists
        # each rule the pass counted a hit for is one line with that count
        (hits,) = [r.message for r in entry.remarks if r.reason == "rule_hits"]
        counted = {rule: int(n) for rule, n in re.findall(r"([\w-]+) (\d+)[,;]", hits) if n != "0"}
        assert counted and set(counted) >= {"fold"}
        for rule, n in counted.items():
            (line,) = [line for line in summary if f" ({rule})" in line]
            assert line.startswith("  [raise-attention] applied") and (n == 1) != (f" x{n} ({rule})" in line)
        # and every other remark is counted once: no remark lost, none counted twice
        counts = [int(m.group(1)) if (m := re.search(r"\] \w+ x(\d+) ", line)) else 1 for line in summary[2:]]
        assert sum(counts) == len(entry.remarks) - 1

    def test_the_summary_names_every_declined_rewrite(self):

        from attnpass.backends.mlx import compile

        attention = self.attention

        def twice(q, k, v, mask):
            return attention(attention(q, k, v, SCALE, mask), k, v, SCALE, mask)

        fast = compile(twice, strict=True)
        q, k, v, mask = self.inputs()
        fast(q, k, v, mask)
        (entry,) = fast.specializations
        declined = [r for r in entry.remarks if r.kind == "declined"]
        assert len({r.node for r in declined if r.pass_name == "qsa-gather"}) == 2  # the two attention calls
        out = io.StringIO()
        fast.explain(file=out, graphs=True)
        lines = out.getvalue().splitlines()
        for r in declined:
            assert [line for line in lines if line.startswith(f"  [{r.pass_name}] declined") and (r.node or "") in line]
        assert any(" = matmul " in line or "= matmul[" in line for line in lines)  # graphs=True: the rewritten graph

    def test_the_default_pipeline_is_the_devices_and_agrees_with_the_fused_call(self):
        from attnpass.backends.mlx import compile

        fast = compile(self.attention, strict=True)
        q, k, v, mask = self.inputs()
        assert_close(to_numpy(fast(q, k, v, SCALE, mask=mask)), to_numpy(self.attention(q, k, v, SCALE, mask)))
        (entry,) = fast.specializations
        assert entry.pipeline == fast.pipeline
        assert fast.pipeline.startswith(
            "raise-attention,mla-absorb{crossover_factor=0.85},qsa-gather{prefill_tile=16},"
        )
        # one decision per attention call, on the sdpa raise-attention made: on CPU, GQA-folded into f32 matmuls
        (raised,) = [r.node for r in entry.remarks if r.pass_name == "raise-attention" and r.node == "matmul_1"]
        (strategy,) = [r for r in entry.remarks if r.pass_name == "decompose-sdpa"]
        assert (strategy.kind, strategy.node) == ("applied", f"{raised}_sdpa")
        assert "sdpa" not in entry.ops and entry.ops["matmul"] == 2 and entry.ops["softmax"] == 1
        assert "scaled_dot_product_attention" not in entry.program.source
        assert_primitive_counts(entry.program, {"Matmul": 2, "Softmax": 1}, q, k, v, mask)
        # the remarks speak of the target the graph is prepared for, MLX, not of JAX's
        assert not [r for r in entry.remarks if re.search(r"jax|xla|cudnn", r.message, re.IGNORECASE)]

    def test_a_primitive_the_importer_lacks_runs_the_original_with_one_warning_per_signature(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        def running_sum(x, axis):
            return mx.sort(x, axis=axis) * 2  # Sort: not in the importer

        fast = compile(running_sum)
        x = mx.arange(12, dtype=mx.float32).reshape(3, 4)
        reason = r"import failed: ModelImportError: unsupported MLX primitive Sort"
        signature = r"running_sum.*x:f32\[3,4\], axis=0 runs the original function: "
        with pytest.warns(FallbackWarning, match=signature + reason):
            first = fast(x, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = fast(x, 0)  # same signature: no second warning
        for out in (first, again):
            np.testing.assert_array_equal(to_numpy(out), np.sort(np.arange(12.0).reshape(3, 4), axis=0) * 2)
        with pytest.warns(FallbackWarning, match="axis=1"):
            fast(x, 1)
        (entry, _) = fast.specializations
        assert not entry.compiled and entry.graph is None and "Sort" in entry.reason

        strict = compile(running_sum, strict=True)
        with pytest.raises(SpecializationError, match=reason):
            strict(x, 0)

    def test_unhashable_static_arguments_and_retyped_inputs_fall_back_with_the_reason(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        def pick(x, rows):
            return x[: len(rows)] * 2

        with pytest.warns(FallbackWarning, match="argument rows is a list: not an array and not hashable"):
            np.testing.assert_array_equal(to_numpy(compile(pick)(mx.ones((4, 3)), [0, 1])), np.full((2, 3), 2.0))

        def first_row(x):
            return x[0:1] + 1

        narrowing = compile(first_row, pipeline="narrow-inputs")
        with pytest.warns(FallbackWarning, match=r"pipeline failed: .*changed input x from f32\[4,3\] to f32\[1,3\]"):
            np.testing.assert_array_equal(to_numpy(narrowing(mx.zeros((4, 3)))), np.ones((1, 3)))

    def test_captured_weights_and_list_outputs(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        weight = mx.random.normal((16, 8))  # > 64 elements: a resident input fed from the captured value
        mx.eval(weight)

        def project(x):
            y = x @ weight
            return [y, y * 2]

        fast = compile(project, strict=True)
        x = mx.random.normal((3, 16))
        out = fast(x)
        assert isinstance(out, list) and len(out) == 2
        for got, want in zip(out, project(x)):
            assert_close(to_numpy(got), to_numpy(want))
        assert fast.specializations[0].imported.params
        (single,) = compile(lambda x: (x * 2,), strict=True)(x)
        np.testing.assert_array_equal(to_numpy(single), to_numpy(x * 2))

    def test_the_cache_is_bounded_and_least_recently_used_goes_first(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        fast = compile(lambda x: x * 2, max_signatures=2)
        for n in (1, 2, 1, 3):
            fast(mx.ones((n,)))
        assert [e.signature for e in fast.specializations] == ["x:f32[1]", "x:f32[3]"]
        assert fast.traces == 3
        fast(mx.ones((2,)))  # evicted: traced again
        assert fast.traces == 4
        with pytest.raises(ValueError, match="max_signatures must be an int >= 1"):
            compile(lambda x: x, max_signatures=0)

    def test_threads_share_one_trace_per_signature(self):
        import mlx.core as mx

        from attnpass.backends.mlx import compile

        fast = compile(lambda x, y: x * y + 1)
        results, errors = {}, []

        def work(i: int) -> None:
            try:
                n = 2 + i % 3
                results[i] = to_numpy(fast(mx.full((n,), float(i)), mx.ones((n,))))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert fast.traces == 3
        for i, out in results.items():
            np.testing.assert_array_equal(out, np.full(2 + i % 3, i + 1.0, dtype=np.float32))


@requires("jax")
class TestJAXJit:
    @staticmethod
    def attention(q, k, v, scale):
        import jax
        import jax.numpy as jnp

        return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * scale, axis=-1) @ v

    @staticmethod
    def inputs():
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 8, 4, 64)).astype(np.float32)
        k, v = (rng.standard_normal((1, 8, 32, 64)).astype(np.float32) for _ in range(2))
        return q, k, v

    def test_static_arguments_are_the_signature_and_attention_is_raised(self):
        from attnpass.backends.jax import jit

        fast = jit(self.attention, static_argnames="scale")
        q, k, v = self.inputs()
        assert_close(np.asarray(fast(q, k, v, scale=0.125)), np.asarray(self.attention(q, k, v, 0.125)))
        fast(q, k, v, scale=0.125)
        assert fast.traces == 1
        fast(q, k, v, scale=0.25)
        assert fast.traces == 2
        entry = fast.specializations[-1]
        assert entry.signature.endswith("scale=0.25")
        raised = [r for r in entry.remarks if r.pass_name == "raise-attention" and r.kind == "applied"]
        assert any(r.rule == "attention" and " -> sdpa" in r.message for r in raised)
        # decode-shaped on CPU: GQA-folded, and the remarks speak of the target, JAX, not of MLX's CPU fallback
        (strategy,) = [r for r in entry.remarks if r.pass_name == "decompose-sdpa"]
        assert strategy.kind == "applied" and "sdpa" not in entry.ops
        assert not [r for r in entry.remarks if re.search(r"mlx|mx\.", r.message, re.IGNORECASE)]
        positional = jit(self.attention, static_argnums=3)
        assert_close(np.asarray(positional(q, k, v, 0.125)), np.asarray(self.attention(q, k, v, 0.125)))
        assert positional.specializations[0].compiled

    def test_jit_with_options_only_is_the_decorator_with_those_options(self):
        import jax

        from attnpass.backends.jax import jit

        def plain(q, k, v, causal=False):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

        attend = jit(static_argnames="causal")(plain)  # as @jit(static_argnames="causal")
        assert isinstance(attend, CompiledFunction) and attend.__name__ == "plain"
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, 4, 8, 16)).astype(np.float32)  # rows-first, GQA 4
        k, v = (rng.standard_normal((1, 4, 2, 16)).astype(np.float32) for _ in range(2))
        reference = jax.jit(plain, static_argnames="causal")
        for causal in (False, True, False):
            assert_close(np.asarray(attend(q, k, v, causal=causal)), np.asarray(reference(q, k, v, causal=causal)))
        assert attend.traces == 2
        by_causal = {e.signature.endswith("causal=True"): e for e in attend.specializations}
        # each signature bound its own static value: only the causal one is causal (its constant mask raised to the
        # sdpa's causal kind, docs/semantics.md §1.4)
        kinds = {flag: {n.attrs["causal"] for n in e.graph.nodes() if n.op == "sdpa"} for flag, e in by_causal.items()}
        assert kinds[True] == {"bottom_right"} and kinds[False] <= {"none"}  # square: bottom-right is top-left
        assert all(entry.compiled for entry in attend.specializations)
        with pytest.raises(ValueError, match="unsupported jax.jit option.*donate_argnums"):
            jit(donate_argnums=0)  # refused when the decorator is made, as with fn

    def test_pytrees_in_and_out(self):
        import jax.numpy as jnp

        from attnpass.backends.jax import jit

        def layer(params, x):
            y = x @ params["w"]
            return {"y": y, "pair": (y * 2, x)}

        fast = jit(layer, strict=True)
        params, x = {"w": jnp.ones((3, 2))}, jnp.arange(12.0).reshape(4, 3)
        out, want = fast(params, x), layer(params, x)
        assert set(out) == {"y", "pair"} and isinstance(out["pair"], tuple)
        for got, ref in ((out["y"], want["y"]), (out["pair"][0], want["pair"][0]), (out["pair"][1], want["pair"][1])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        assert fast.specializations[0].signature == "params_w:f32[3,2], x:f32[4,3]"

    def test_a_primitive_the_importer_lacks_runs_jax_jit_of_the_original(self):
        import jax.numpy as jnp

        from attnpass.backends.jax import jit

        def sorted_twice(x):
            return jnp.sort(x) * 2

        x = jnp.arange(5.0)[::-1]
        with pytest.warns(FallbackWarning, match="import failed: ModelImportError: unsupported JAX primitive sort"):
            np.testing.assert_array_equal(np.asarray(jit(sorted_twice)(x)), np.arange(5.0) * 2)
        with pytest.raises(SpecializationError, match="unsupported JAX primitive sort"):
            jit(sorted_twice, strict=True)(x)

    def test_options_tied_to_argument_positions_are_refused(self):
        from attnpass.backends.jax import jit

        with pytest.raises(ValueError, match="unsupported jax.jit option.*donate_argnums"):
            jit(self.attention, donate_argnums=0)


def garbage_after(calls) -> list:
    """The objects only Python's cycle collector would free after ``calls()``: what a trace left in a cycle."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        calls()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@requires("mlx.core")
def test_an_mlx_trace_leaves_no_reference_cycle_holding_its_arrays():
    import mlx.core as mx

    from attnpass.backends.mlx import compile

    fast = compile(TestMLXCompile.attention)

    def calls():
        for t in (64, 96, 128):  # three signatures, three traces
            q, k, v, mask = TestMLXCompile.inputs(t)
            mx.eval(fast(q, k, v, SCALE, mask=mask))

    garbage = garbage_after(calls)
    assert fast.traces == 3
    assert not [o for o in garbage if isinstance(o, mx.array | Traceable)]


@requires("jax")
def test_a_jax_trace_leaves_no_reference_cycle_holding_its_arrays():
    import jax

    from attnpass.backends.jax import jit

    fast = jit(TestJAXJit.attention, static_argnames="scale")

    def calls():
        q, k, v = TestJAXJit.inputs()
        for scale in (0.125, 0.25, 0.5):
            jax.block_until_ready(fast(q, k, v, scale=scale))

    garbage = garbage_after(calls)
    assert fast.traces == 3
    assert not [o for o in garbage if isinstance(o, jax.Array | np.ndarray | Traceable)]
