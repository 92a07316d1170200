"""Named example graphs for ``attnpass example NAME``, each with its size options and a pipeline to try."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from attnpass.ir import AttnpassError, Graph

from .qsa_layer import QSAConfig, build_layer
from .qwen38 import N_LAYERS, build_model, verify_step


@dataclass(frozen=True)
class Example:
    """A graph builder with integer options (name -> default) and the pipeline that rewrites it."""

    summary: str
    build: Callable[..., Graph]
    options: Mapping[str, int]
    pipeline: str


EXAMPLES: Mapping[str, Example] = {
    "qwen38-verify": Example(
        "Qwen3.8-Flash-Next speculative-verify attention step: 24 q / 2 kv heads, head dim 256, bf16",
        lambda q_len, n_kv: verify_step(q_len, n_kv),
        {"q_len": 4, "n_kv": 4096},
        "head-chunk",
    ),
    "qwen38-qsa-decode": Example(
        "Qwen3.8-Flash-Next QSA decode attention layer in masked form (f32, one query row)",
        lambda n_kv: build_layer(QSAConfig(), n_kv),
        {"n_kv": 8192},
        "qsa-gather,dce,narrow-inputs,dce",
    ),
    "qwen38-model": Example(
        f"attention of a {N_LAYERS}-layer Qwen3.8-Flash-Next step: QSA at l % 4 == 3, dense sdpa elsewhere, residuals",
        lambda layers, q_len, n_kv: build_model(layers, q_len=q_len, n_kv=n_kv),
        {"layers": N_LAYERS, "q_len": 4, "n_kv": 8192},
        "qsa-gather{max_rows=4},head-chunk,dce,narrow-inputs,dce",
    ),
}


def build_example(name: str, **options: int) -> Graph:
    """Build example ``name``; ``options`` override its defaults. Raises AttnpassError for unknown ones."""
    example = EXAMPLES.get(name)
    if example is None:
        raise AttnpassError(f"unknown example {name!r}; examples: {', '.join(EXAMPLES)}")
    unknown = sorted(set(options) - set(example.options))
    if unknown:
        known = ", ".join(f"{k}={v}" for k, v in example.options.items())
        raise AttnpassError(f"example {name} has no option {', '.join(unknown)}; its options (defaults): {known}")
    for key, value in options.items():
        if value < 1:
            raise AttnpassError(f"example {name}: {key} must be >= 1, got {value}")
    return example.build(**{**example.options, **options})


__all__ = ["EXAMPLES", "Example", "build_example"]
