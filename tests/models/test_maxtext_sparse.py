"""MaxText's sparse attention under attnpass's strict ``jit`` (MaxText: .venv-jax-libraries only).

The DeepSeek-V3.2 decode step of benchmarks/maxtext_sparse.py (loaded by path) over a cache filled to 4,096 keys:
its DSA attention is gathered (the jit's own dsa-gather remark: K = 2,048 of the 4,104 keys, the value-cutoff
selection's argtopk, one set of cells shared by the 8 query heads MaxText folds into the rows), no softmax over all
keys is left, the StableHLO's score dots read 2,048 keys (plain jax.jit's: the 4,096 prefill keys and the 8
decode ones), the logits agree with plain ``jax.jit`` within the gather's float32 bound (1e-5) and the updated cache
within the library zoo's (1e-4: the indexer key's LayerNorm and RoPE as imported round differently). The
benchmark end to end (both layers, small cache): each row within the bound and naming what the sparse passes did.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent.parent


def _benchmark():
    spec = importlib.util.spec_from_file_location("maxtext_sparse", ROOT / "benchmarks" / "maxtext_sparse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hlo(jax, step, args, entry) -> dict[str, str]:
    """The StableHLO of plain ``jax.jit(step)`` and of attnpass's program for the same call."""
    leaves = jax.tree_util.tree_leaves(args)
    given = dict(zip(entry.imported.graph.inputs, leaves))
    target = entry.program.target
    ins = [given[n] if n in given else target.from_numpy(entry.imported.params[n]) for n in entry.program.input_names]
    return {"plain": jax.jit(step).lower(*args).as_text(), "attnpass": jax.jit(entry.program.fn).lower(*ins).as_text()}


def _attention_key_widths(text: str) -> set[int]:
    """The key counts of the attention score dots in StableHLO ``text``: each ``dot_general`` whose two operands
    both have the 576-wide latent-and-rope features (the 8 query rows, heads folded, by the keys), counted as the
    larger operand's elements / 576."""
    found = set()
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        operands = re.findall(r"tensor<([\dx]+)xf32>", line.split(" -> ")[0])
        shapes = [[int(d) for d in o.split("x")] for o in operands]
        if len(shapes) == 2 and all(576 in sh for sh in shapes):
            found.add(max(math.prod(sh) for sh in shapes) // 576)
    return found


@requires("jax", "maxtext")
def test_maxtexts_dsa_decode_is_gathered_and_agrees_with_jax_jit():
    import jax

    import attnpass.backends.jax as ajax

    bench = _benchmark()
    model, params, cache = bench.build("dsa", 4096, 1024)
    step, args = bench.step_args(model, params, cache, 4096)
    ours = ajax.jit(step, strict=True)
    (ref_logits, ref_cache), (logits, new_cache) = jax.jit(step)(*args), ours(*args)
    (entry,) = ours.specializations
    (remark,) = [r for r in entry.remarks if r.pass_name == "dsa-gather"]
    assert remark.kind == "applied", str(remark)
    figures = {k: remark.data[k] for k in ("top_k", "kv_len", "distinct", "keys", "shared_cells", "rows")}
    assert figures == {"top_k": 2048, "kv_len": 4104, "distinct": "argtopk", "keys": "fallback",
                       "shared_cells": True, "rows": 8}  # fmt: skip
    assert [r.reason for r in entry.remarks if r.pass_name == "mla-absorb"] == ["not_latent"]  # already latent
    ops = [n for n in entry.graph.nodes()]
    assert any(n.op == "qsa_gather" for n in ops)
    assert not [n.name for n in ops if n.op == "softmax" and n.type.shape[-1] == 4104]  # no attention over all T
    widths = {name: _attention_key_widths(text) for name, text in _hlo(jax, step, args, entry).items()}
    assert widths["plain"] == {4096, 8} and widths["attnpass"] == {2048}, widths  # the keys each score dot reads
    ref, got = np.asarray(ref_logits), np.asarray(logits)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(ref_cache), jax.tree_util.tree_leaves(new_cache), strict=True):
        a, b = np.asarray(a), np.asarray(b)  # the written keys: the imported LayerNorm/RoPE's rounding, not attention
        assert np.abs(b - a).max() <= 1e-4 * max(np.abs(a).max(), 1e-30)  # the library zoo's float32 bound


@requires("jax", "maxtext")
def test_the_maxtext_sparse_benchmark_agrees_with_jax_jit_and_names_each_route():
    found = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "maxtext_sparse.py"), "--contexts", "4096", "--window", "1024",
         "--reps", "1"],
        check=False, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in found.stdout.splitlines()
            if line.startswith(("| dsa ", "| window "))}  # fmt: skip
    assert sorted(rows) == ["dsa", "window"], found.stdout
    for row in rows.values():
        assert float(row[7]) < 1e-5, row  # max |diff| / max |logit|, float32
        assert "dsa-gather" in row[8] and "block-sparse" in row[8], row  # applied or declined, by code
    assert "dsa-gather applied" in rows["dsa"][8], rows["dsa"]
