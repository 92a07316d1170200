"""Imported flax and equinox decoder blocks, the user's Megatron shardings plus shard-attention, on 8 devices.

The cases (:mod:`tests.jax_model_mesh_cases`: a 2-layer decode step of a flax nnx and of an equinox decoder,
16 query / 8 KV heads of 16, hidden 128, caches of 64 rows, Q/K/V and up column-parallel, O and down
row-parallel over ``model``) run in one subprocess with 8 simulated CPU devices, as tests/backends/
test_sharded_mesh.py's do. With ``shard-attention{heads=model}`` the partitioned HLO holds exactly the two
all-reduces of a Megatron layer per layer (O's and down's partial sums, each the size of the hidden state) and no
other collective: nothing moves K/V; each device holds 1/8 of every K/V cache, the bytes the remark states, and
the compiled program takes the caches so placed. What does not compose is declined by name: 4 KV heads over 8
devices (``not_divisible``: the caches stay whole on every device and XLA gathers K/V), and caches the user
already split over the keys (``sharding_conflict``). Every output (hidden state and written caches) is the
module's own (``jax.jit``) within float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends.test_sharded_mesh import XLA_FLAGS
from tests.sharded_cases import claimed_bytes
from tests.util import requires

pytestmark = requires("jax", "flax", "equinox")

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 8
OTHER_COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.jax_model_mesh_cases"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {case["case"]: case for case in map(json.loads, done.stdout.splitlines())}


def remarks(case: dict, kind: str) -> list[str]:
    return [r for r in case["remarks"] if f"] {kind} " in r]


def assert_the_modules_outputs(case: dict) -> None:
    assert len(case["errors"]) == 1 + 2 * case["layers"]  # hidden state, then every written cache
    assert max(case["errors"]) <= 1e-5, case["errors"]


@pytest.mark.parametrize("name", ["flax-nnx-heads", "equinox-heads"])
def test_megatron_layers_with_sharded_attention_all_reduce_twice_per_layer_and_never_move_kv(cases, name):
    case = cases[name]
    assert case["devices"] == DEVICES and len(remarks(case, "applied")) == case["layers"] and not case["reasons"]
    assert all("whole GQA groups" in r for r in remarks(case, "applied"))
    found = case["collectives"]
    assert all(not found[op] for op in OTHER_COLLECTIVES), found
    # O's and down's partial sums: one hidden state each, per layer
    assert found["all-reduce"] == [case["hidden_bytes"]] * (2 * case["layers"]), found
    claims = {}
    for remark in remarks(case, "applied"):
        claims.update(claimed_bytes(remark))
    assert set(claims) == set(case["caches"]) and len(claims) == 2 * case["layers"]
    for cache, (per_device, total) in claims.items():
        held = case["inputs"][cache]
        assert held["per_device"] == [per_device] == [total // DEVICES] and held["total"] == total, (cache, held)
        assert held["devices"] == DEVICES and held["compiled_sharding_matches"], held
    for weight, sharding in case["weights"].items():  # the user's Megatron placement, kept
        held = case["inputs"][weight]
        assert case["shardings"][weight] == sharding and held["per_device"] == [held["total"] // DEVICES], weight
    assert_the_modules_outputs(case)


def test_kv_heads_that_do_not_fill_the_mesh_are_declined_and_their_caches_stay_whole(cases):
    case = cases["flax-nnx-4-kv-heads-declined"]
    assert case["reasons"] == ["not_divisible"] * case["layers"] and not remarks(case, "applied")
    assert all("8 does not divide 4" in r for r in remarks(case, "declined"))
    for cache in case["caches"]:
        assert case["inputs"][cache]["per_device"] == [case["inputs"][cache]["total"]], cache  # replicated
    # left to the partitioner, the column-parallel K/V projections split heads apart and K/V are gathered
    assert case["collectives"]["all-gather"], case["collectives"]
    assert_the_modules_outputs(case)


def test_caches_the_user_split_over_the_keys_conflict_with_heads_and_are_declined(cases):
    case = cases["equinox-caches-on-keys-declined"]
    assert case["reasons"] == ["sharding_conflict"] * case["layers"] and not remarks(case, "applied")
    for remark in remarks(case, "declined"):
        assert "is already sharded (model, _, _); this attention needs (_, model, _)" in remark, remark
    for cache in case["caches"]:  # the user's placement stands
        assert case["shardings"][cache] == ["model", None, None]
    assert_the_modules_outputs(case)
