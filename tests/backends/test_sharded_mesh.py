"""Sharded JAX programs on 8 simulated CPU devices: outputs, compiled collectives and per-device K/V bytes.

The cases (:mod:`tests.sharded_cases`) run in one subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (and no excess
precision, see :data:`XLA_FLAGS`), so the JAX of the rest
of the suite keeps its single device. Graphs: the verify step (24 q / 2 kv
heads, head dim 256, head-chunked), the QSA decode layer (gathered) and a
4-layer model step; meshes 1x8 and 2x4 (``data`` x ``model``). With 2 KV
heads, a heads axis of 8 is declined, so the 1x8 mesh shards the keys
(``seq``, split-KV) and the 2x4 mesh splits the 2 KV heads over ``data`` and
the keys over ``model``; models with 8 KV heads show heads (and streams) alone.
The layout cases put heads-first, rows-first (traced, repeated K/V, and
``jax.nn.dot_product_attention`` imported) and decode-state graphs under each
of ``heads``, ``batch`` and ``seq`` over 4 devices, and hold the remark's K/V
bytes per device to what ``addressable_shards`` hold. Every output is also
compared with the graph before any pass.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnpass.ir import DType
from tests.sharded_cases import LAYOUT_CASES, claimed_bytes
from tests.util import RTOL, requires

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
# |sharded - single-device| <= this * max|single-device|: a few roundings of the output dtype
TOLERANCE = {"bfloat16": 2**-8, "float32": 2**-20}
# Without excess precision, XLA rounds every bf16 value the graph casts to in both programs. With it (the
# default), whether a cast to bf16 followed by bf16 arithmetic is rounded depends on how XLA fuses it, and a
# sharding constraint between the two changes that: the 4-layer bf16 model's batched QSA combine, cast to
# bf16, reshaped and added to the residual, then differs in ~1000 outputs by up to one bf16 ulp of the
# residual (4.0 vs 4.03125) with no rewrite being inexact (the QSA layer alone is bitwise equal sharded).
XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false"
# jax 0.12.1's XLA on CPU fuses the per-device softmax of the heads-sharded QSA layer (one KV head of 8: the logits
# dot, the mask, the row max, exp and the row sum over 2,051 cells) into one YNNPACK fusion that sums each row in its
# own order, while the single device's (8 KV heads) keeps the split of earlier versions (YNNPACK sums of 32 cells,
# then XLA's reduce-window and reduce); jax 0.10.2 and 0.11.2 split both alike. Measured with jax 0.12.1: 4,743 of
# the 8,192 float32 outputs differ, by at most 4.5e-8 next to max |out| 0.152 (3 ulp); with YNNPACK fusions limited
# to dots (this flag, accepted by 0.10.2 too) the bits are the single device's again. The bf16 verify step keeps them.
YNN_DOTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"
YNN_SOFTMAX_BOUND = 2**-21  # |sharded - single| <= this * max |single| where YNNPACK fuses the softmax (3 ulp measured)

pytestmark = requires("jax")


def measured(*names: str, flags: str = XLA_FLAGS) -> dict[str, dict]:
    """The cases of :mod:`tests.sharded_cases` (all of them when no name is given), run in one subprocess."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.sharded_cases", *names],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {case["case"]: case for case in map(json.loads, done.stdout.splitlines())}


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    return measured()


def ynn_fuses_the_softmax() -> bool:
    """Whether the installed jaxlib's XLA may fuse a softmax's reductions into YNNPACK (0.12 on; see YNN_DOTS_ONLY)."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("jaxlib").split(".")[:2]) >= (0, 12)


def applied(case: dict) -> list[str]:
    return [r for r in case["remarks"] if "] applied " in r]


def declined(case: dict) -> list[str]:
    return [r for r in case["remarks"] if "] declined " in r]


def assert_equals_single_device(case: dict) -> None:
    bound = TOLERANCE[case["dtype"]] * case["max_abs"]
    assert case["max_abs_diff"] <= bound, f"{case['case']}: |sharded - single| = {case['max_abs_diff']} > {bound}"
    assert_equals_the_original(case)


def assert_equals_the_original(case: dict) -> None:
    """The sharded output against the graph before any pass (numpy reference, or JAX's own function), within
    ``assert_close``'s tolerance of the dtype: ``|a - e| <= RTOL * (|e| + max|e|)`` elementwise."""
    rtol = RTOL[DType.parse(case["dtype"])]
    assert case["reference_error"] <= rtol, f"{case['case']}: {case['reference_error']} > {rtol}"


def assert_kv_split_evenly(case: dict) -> None:
    per_device = case["kv_bytes_total"] // case["devices"]
    assert case["kv_bytes_per_device"] == [per_device], case["case"]  # every device the same, 1/8 of the whole
    assert case["kv_bytes_per_device_from_sharding"] == per_device
    assert_the_remarks_bytes_are_held(case, case["mesh_size"])


def assert_the_remarks_bytes_are_held(case: dict, n: int) -> None:
    """Every applied remark states its K/V inputs' bytes per device; each device of the mesh holds exactly
    that (``addressable_shards``), ``1/n`` of the input, and the compiled program takes it so placed."""
    for remark in applied(case):
        claims = claimed_bytes(remark)
        assert len(claims) >= 2, remark  # K's and V's
        for value, (per_device, total) in claims.items():
            held = case["inputs"][value]
            assert held["devices"] == n and held["compiled_sharding_matches"], held
            assert held["total"] == total and total % n == 0
            assert held["per_device"] == [per_device] == [total // n], (value, held, claims[value])


HEADS_ONLY = ["verify-1x8-heads-8kv", "verify-2x4-batch-heads-8kv", "qsa-1x8-heads-8kv"]
KEYS_SHARDED = ["verify-1x8-seq", "verify-2x4-heads-seq", "qsa-1x8-seq", "qsa-2x4-heads-seq", "model-1x8-seq",
                "model-2x4-heads-seq", "qsa-2hosts-x-4"]  # fmt: skip
DECLINED = ["verify-1x8-heads-declined", "qsa-1x8-heads-declined", "model-1x8-heads-declined"]


@pytest.mark.parametrize("name", HEADS_ONLY)
def test_whole_kv_groups_per_device_need_no_collective(cases, name):
    case = cases[name]
    assert applied(case) and not declined(case)
    assert "whole GQA groups" in applied(case)[0]
    assert all(not found for found in case["collectives"].values()), case["collectives"]
    assert_kv_split_evenly(case)
    assert_equals_single_device(case)
    assert case["out_spec"] == "P(" + ", ".join(repr(a) for a in case["out_annotation"]) + ")"


@pytest.mark.parametrize("name", ["verify-1x8-heads-8kv", "qsa-1x8-heads-8kv"])
def test_heads_sharding_alone_reproduces_the_single_device_bits(cases, name):
    """Bits on jax 0.10.2 and 0.11.2; on 0.12.1 the float32 QSA layer within YNN_SOFTMAX_BOUND (see YNN_DOTS_ONLY)."""
    case = cases[name]
    if name == "qsa-1x8-heads-8kv" and ynn_fuses_the_softmax():
        assert case["max_abs_diff"] <= YNN_SOFTMAX_BOUND * case["max_abs"], (case["max_abs_diff"], case["max_abs"])
    else:
        assert case["bitwise_equal"]


def test_with_ynn_fusing_only_dots_heads_sharding_reproduces_the_single_device_bits():
    """The cause of jax 0.12's difference: with XLA's YNNPACK fusions limited to dots, the bits come back."""
    case = measured("qsa-1x8-heads-8kv", flags=f"{XLA_FLAGS} {YNN_DOTS_ONLY}")["qsa-1x8-heads-8kv"]
    assert case["bitwise_equal"] and case["reference_error"] <= RTOL[DType.parse(case["dtype"])]


@pytest.mark.parametrize("name", KEYS_SHARDED)
def test_sharded_keys_communicate_only_the_small_combine(cases, name):
    case = cases[name]
    assert applied(case) and not declined(case)
    assert all("only the combine crosses devices" in r for r in applied(case))
    for op in FORBIDDEN:
        assert not case["collectives"][op], (op, case["collectives"])
    reduces = case["collectives"]["all-reduce"]
    assert 0 < len(reduces) <= 2 * case["splits"]  # a max and the sums per combine (XLA merges them further)
    assert max(reduces) <= case["combine_bytes"]  # never more than one attention's [B, Hq, S, Dv + 1] float32
    assert sum(reduces) * 10 < case["kv_bytes_per_device"][0]  # what moves is small next to the K/V each holds
    assert_kv_split_evenly(case)
    assert_equals_single_device(case)


def test_a_long_cache_compiles_with_only_the_combine(cases):
    case = cases["model-2x4-heads-seq-128k-compiled"]
    for op in FORBIDDEN:
        assert not case["collectives"][op], (op, case["collectives"])
    assert case["collectives"]["all-reduce"]
    assert case["kv_bytes_per_device_from_sharding"] * 8 == case["kv_bytes_total"]


@pytest.mark.parametrize("name", DECLINED)
def test_a_heads_axis_that_does_not_divide_the_kv_heads_is_declined(cases, name):
    case = cases[name]
    assert not applied(case) and declined(case)
    assert all("heads: mesh axis model has 8 devices but the attention has 2 KV head(s): 8 does not divide 2" in r
               for r in declined(case))  # fmt: skip
    assert case["kv_bytes_per_device"] == [case["kv_bytes_total"]]  # replicated: correct, not split
    assert all(not found for found in case["collectives"].values())
    assert case["bitwise_equal"]
    assert_equals_the_original(case)


def test_two_hosts_of_four_devices_run_the_same_program(cases):
    case = cases["qsa-2hosts-x-4"]
    assert case["mesh_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # host h holds mesh row h
    assert case["source_on_abstract_mesh"]  # generated from axis names and sizes only: no per-host code


def test_the_sharding_page_block_runs_on_eight_devices(cases):
    printed = cases["sharding-page"]["stdout"].splitlines()
    assert printed[0] == "P(None, 'data', None, None)"
    assert printed[1] == "{524288} 4194304"
    counts = ast.literal_eval(printed[2])
    assert counts["all-reduce"] > 0 and all(counts[op] == 0 for op in FORBIDDEN)


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_each_device_holds_the_share_of_k_and_v_the_remark_states(cases, name):
    """Heads-first, rows-first (traced, repeated K/V, imported from jax.nn.dot_product_attention) and decode-state
    graphs under each option: the bytes the remark states per device are what ``addressable_shards`` of the
    placed K and V hold on every device, the compiled program takes them so placed, and the outputs are the
    original's."""
    case = cases[name]
    (remark,) = applied(case)
    assert set(case["kv_inputs"]) <= set(claimed_bytes(remark)), remark  # it states K's and V's bytes per device
    assert_the_remarks_bytes_are_held(case, case["mesh_devices"])
    collectives = {op: found for op, found in case["collectives"].items() if found}
    assert set(collectives) <= ({"all-reduce"} if name.endswith("-seq") else set()), collectives
    assert_equals_the_original(case)
