"""The peer suites' runner (examples/peer_suite.py) and table (examples/peers.py), without running a peer's tests.

``make peer-mlx-lm`` and ``make peer-mlx-vlm`` run them (minutes); here: the test ids the page shows map back to
pytest's node ids (the reference run reruns them), outcomes compare without object addresses, a test failing plain
is explained by the reference run where it has one, and mlx-vlm's record accounts for every test file of its ref.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.util import EXAMPLES_DIR, load_example, requires

pytestmark = requires("mlx.core")


@pytest.fixture(scope="module")
def suite():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES_DIR))  # the script imports its plugin and table as siblings
        yield load_example("peer_suite")


def test_a_page_s_test_id_is_its_pytest_node_id(suite):
    assert suite.node_id("test_models.TestModels::test_gemma4") == "tests/test_models.py::TestModels::test_gemma4"
    assert suite.node_id("test_apc::test_x[128-512-2-16-8]") == "tests/test_apc.py::test_x[128-512-2-16-8]"
    assert suite.node_id("test_apc_adapters (collecting)") == "tests/test_apc_adapters.py"


def test_an_assertion_s_object_address_does_not_make_an_outcome_differ(suite):
    first = suite._exception("assert <mlx_vlm.apc.DiskBlockStore object at 0x7fcd6be38410> is None")
    assert first == suite._exception("assert <mlx_vlm.apc.DiskBlockStore object at 0x7f841ace46d0> is None")
    assert "0x…" in first
    assert suite._exception("AttributeError: module 'x' has no attribute 'y'") == "AttributeError"


def test_a_test_failing_plain_is_the_version_gap_only_where_it_passes_at_the_tests_own_ref(suite):
    peer, Outcome = suite.PEERS["mlx-vlm"], suite.Outcome
    here = Outcome("failed", ("AttributeError",), "AttributeError: module 'mlx_vlm.apc' has no attribute '_f'")
    gap = suite.why(peer, "test_apc::test_x", here, Outcome("passed"))
    assert gap.startswith("the version gap: passes against mlx-vlm 0.6.15's own source;")
    assert gap.endswith("0.7.10's `mlx_vlm.apc` has no `_f`")
    metal = Outcome("failed", ("RuntimeError",), "RuntimeError: [metal_kernel] No Metal back-end.")
    assert "fails further on: needs Metal" in suite.why(peer, "test_apc::test_x", here, metal)
    assert suite.why(peer, "test_apc::test_x", metal, metal) == "needs Metal (MLX's GPU backend)"
    # a file that failed to collect plain and collects at the ref
    ran = suite.Run({"test_apc_adapters::test_a": Outcome("passed")}, {})
    assert suite.at_reference("test_apc_adapters (collecting)", ran) == Outcome("collected")
    assert suite.at_reference("test_cache (collecting)", ran) is None


def test_the_mlx_vlm_record_runs_or_leaves_out_each_test_file_of_its_ref(suite):
    peer = suite.PEERS["mlx-vlm"]
    run = set(peer.tests)
    assert not run & set(peer.left_out)
    assert {node.split("::")[0] for node in peer.deselected} <= run
    clone = Path(peer.source.default)
    if not clone.exists():
        pytest.skip(f"no clone of mlx-vlm at {clone}")
    listed = subprocess.run(
        ["git", "-C", str(clone), "ls-tree", "--name-only", f"{peer.source.ref}:{peer.source.path}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    files = {f"tests/{name}" for name in listed if name.startswith("test_") and name.endswith(".py")}
    assert files == run | set(peer.left_out)
