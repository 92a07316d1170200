"""Qwen3.8-Flash-Next QSA decode layer: the masked form, the gather rewrite, input traffic, numerics.

    .venv/bin/python examples/qwen38_qsa_decode.py

1. Trace the layer at n_kv = 141,312 (trace only) and print the masked graph.
2. Run QSAGather -> DCE -> NarrowInputs -> DCE; print the rewritten graph, every
   remark, the lowered program's signature and the streamed input bytes per call.
3. At a small depth, run masked and gathered programs on numpy, MLX and JAX
   and check the outputs agree.
"""

from __future__ import annotations

import numpy as np

from attnpass.backends import run  # noqa: E402
from attnpass.lowering import lower  # noqa: E402
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs

N_KV_TRACE = 141_312
N_KV_NUMERICS = 4_608
TOLERANCE = 1e-5


def traffic(cfg: QSAConfig, n_kv: int = N_KV_TRACE, *, verbose: bool = True) -> tuple[int, int]:
    """Streamed input bytes per call of the masked and the rewritten layer (printing both graphs)."""
    masked = build_layer(cfg, n_kv)
    result = gather_pipeline().run(masked)
    if verbose:
        print(f"// masked QSA decode layer, n_kv = {n_kv:,}\n{masked}\n")
        print(f"// after qsa-gather, dce, narrow-inputs, dce\n{result.graph}\n")
        print("// remarks")
        for remark in result.remarks:
            print(remark)
        print("\n// signature of the lowered gather program (what a caller provides)")
        for name, type_, role in lower(result.graph, "numpy").signature():
            print(f"  {name}: {type_} ({role})")
    return masked.input_nbytes(), result.graph.input_nbytes()


def _call(target: str, graph, inputs: dict[str, np.ndarray]) -> np.ndarray:
    program = lower(graph, target)
    if target == "jax":
        import jax

        return np.asarray(jax.jit(program.fn)(*program.bind(**inputs)))
    return run(program, **inputs)


def numerics(cfg: QSAConfig, n_kv: int = N_KV_NUMERICS, seed: int = 0) -> dict[str, float]:
    """Max |difference| from the numpy masked output, per (target, path); raises if any exceeds TOLERANCE."""
    masked = build_layer(cfg, n_kv)
    gathered = gather_pipeline().run(masked).graph
    positions = np.array([[n_kv - 7]], dtype=np.int32)
    inputs = make_inputs(cfg, n_kv, positions, seed=seed, hidden_fraction=0.05)
    reference = _call("numpy", masked, inputs)
    errors = {}
    for target in ("numpy", "mlx", "jax"):
        errors[f"{target} masked"] = float(np.abs(_call(target, masked, inputs) - reference).max())
        got = _call(target, gathered, narrowed_inputs(gathered, inputs))
        errors[f"{target} gather"] = float(np.abs(got - reference).max())
    worst = max(errors.values())
    if not worst <= TOLERANCE:
        raise AssertionError(f"masked and gathered outputs disagree: {errors}")
    return errors


def main(n_kv_numerics: int = N_KV_NUMERICS) -> None:
    cfg = QSAConfig()
    before, after = traffic(cfg)
    print(
        f"\nstreamed input bytes per call at n_kv = {N_KV_TRACE:,}: {before:,} -> {after:,} "
        f"({before / 1e6:.2f} MB -> {after / 1e6:.2f} MB)"
    )
    print(f"\nnumerics at n_kv = {n_kv_numerics:,} (max |output - numpy masked|):")
    for key, err in numerics(cfg, n_kv_numerics).items():
        print(f"  {key:<14} {err:.3e}")
    print(f"outputs agree within {TOLERANCE:g}")


if __name__ == "__main__":
    main()
