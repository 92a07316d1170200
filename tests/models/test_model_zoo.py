"""The model zoo (examples/model_zoo.py): every case imports and its lowered program matches the module.

One test per case, every cell of its row asserted. What this branch guarantees
is fixed: imported, max error within the stated tolerance (float32 1e-4;
bfloat16 two ulps of the output), head-chunk applied to every eligible
``sdpa``, canonicalize never growing a graph, a remark whenever a layer is not
raised. How many layers ``raise-attention`` raises is the pass's business and
is read from :data:`RAISED` (first matching pattern wins) and :data:`SILENT`: one edit when it learns more.
"""

from __future__ import annotations

from fnmatch import fnmatch

import pytest

from tests.util import load_example, requires

zoo = load_example("model_zoo")

# case-name pattern -> attention layers raise-attention raises today (of 2 per mlx-lm model, 1 per JAX case)
RAISED: list[tuple[str, int]] = [
    ("gemma2/*", 0),  # tanh logit soft-capping between the scores and the softmax: declined by name
    ("gpt_oss/*", 0),  # attention sinks (an extra softmax column): declined by name
    ("cohere2/prefill/*", 1),  # the sliding-window layer raises, the global one is declined
    ("jax.einsum-gqa/*", 0),  # the 1/jnp.sqrt(d) scale: canonicalize folds only ops every target rounds alike
    ("equinox.MultiheadAttention/*", 0),  # equinox's unbatched per-head layout is declined
    ("jax.*", 1),
    ("flax.*", 1),
    ("*", 2),
]


# cases where raise-attention leaves no remark on a layer it does not raise (it should always leave one)
SILENT: tuple[str, ...] = ()


def raised_today(name: str) -> int:
    return next(count for pattern, count in RAISED if fnmatch(name, pattern))


def _marks(case) -> list:
    if case.backend == "mlx":
        return [requires("mlx.core", "mlx_lm")]
    library = {"flax": ("flax",), "equinox": ("equinox",)}.get(case.name.split(".")[0], ())
    return [requires("jax", *library)]


CASES = [pytest.param(case, id=case.name, marks=_marks(case)) for case in zoo.cases()]


def test_the_zoo_covers_every_family_step_and_dtype():
    names = {case.name for case in zoo.cases()}
    assert len(zoo.FAMILIES) == 16 and len(names) == 16 * 3 * 2 + 6 + 3 * 2
    for family in ("llama", "qwen3_moe", "gemma3_text", "deepseek_v2", "gpt_oss", "olmo2"):
        for step in ("prefill", "verify", "decode"):
            assert {f"{family}/{step}/f32", f"{family}/{step}/bf16"} <= names
    for variant in ("none", "mask", "bias", "causal", "gqa", "bf16"):
        assert f"jax.dot_product_attention/{variant}" in names


@pytest.mark.parametrize("case", CASES)
def test_zoo_case(case):
    row = zoo.run_case(case)
    assert row.imported == "yes", row.imported
    assert row.ok, f"{case.name}: max error {row.error} > {row.bound}"
    assert row.raised == raised_today(case.name), f"{case.name}: raised {row.raised}: {row.remark}"
    applied, eligible = row.chunked
    assert applied == eligible <= row.raised, f"{case.name}: head-chunk applied {applied} of {eligible} eligible"
    if row.nodes is not None:
        assert row.nodes[1] <= row.nodes[0]
    silent = row.remark.startswith("raise-attention left no remark")
    assert silent == any(fnmatch(case.name, p) for p in SILENT), f"{case.name}: {row.remark}"
    assert bool(row.remark) == (row.raised < case.layers), f"{case.name}: {row.remark}"
    assert zoo.format_row(row).startswith(case.name)


@requires("jax")
def test_the_table_prints_one_row_per_case(capsys):
    assert zoo.main(["jax.dot_product_attention/mask"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == zoo.HEADER and len(lines) == 2
    assert lines[1].split()[:4] == ["jax.dot_product_attention/mask", "yes", "1/1", "-"]
