"""Wrong rewrites and crashes the fuzzer found (tests/fuzz), each kept as its shrunk reproducer (graph text, pipeline)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnpass.ir import parse_graph
from attnpass.passes import parse_pipeline
from tests.fuzz.differential import check
from tests.fuzz.families import Case

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the pinned NaN rows

ATTENTION = """graph decomposed(q:{dt}[1,1,2,4], k:{dt}[1,1,3,4], v:{dt}[1,1,3,4], mask:{mask}[2,3]) {{
  kT:{dt}[1,1,4,3] = transpose[perm=(0, 1, 3, 2)] k
  scores:{dt}[1,1,2,3] = matmul q kT
{body}
  probs:{dt}[1,1,2,3] = softmax[axis=3, precise=False] {last}
  pv:{dt}[1,1,2,4] = matmul probs v
  return pv
}}"""

MASKED = """  c:{dt}[] = constant[value=(0.5,), shape=(), dtype='{dtype}']
  scaled:{dt}[1,1,2,3] = mul scores c
  fill:{dt}[] = constant[value=({fill},), shape=(), dtype='{dtype}']
  masked:{dt}[1,1,2,3] = where mask scaled fill"""

BIASED_THEN_SCALED = """  biased:{dt}[1,1,2,3] = add scores mask
  c:{dt}[] = constant[value=(0.5,), shape=(), dtype='{dtype}']
  scaled:{dt}[1,1,2,3] = mul biased c"""


def _case(body: str, last: str, *, dtype: str = "float32", mask: str = "bool", fill: float = -math.inf) -> Case:
    dt = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    fill_text = "-inf" if fill == -math.inf else repr(fill)
    mask_type = dt if mask == "additive" else "bool"
    body = body.format(dt=dt, dtype=dtype, fill=fill_text)
    graph = parse_graph(ATTENTION.format(dt=dt, mask=mask_type, body=body, last=last))
    rng = np.random.default_rng(0)
    arrays = {
        name: rng.uniform(-1, 1, t.shape).astype(t.dtype.numpy) for name, t in zip(graph.inputs, graph.input_types())
    }
    if mask == "bool":
        arrays["mask"] = np.array([[False, False, False], [True, False, True]])  # row 0 attends no key
    else:
        arrays["mask"] = rng.normal(0, 2, (2, 3)).astype(arrays["q"].dtype)
    return Case("decomposed", graph, arrays)


@pytest.mark.parametrize("fill", [-math.inf, float(np.finfo(np.float32).min)])
def test_raise_attention_keeps_a_minus_inf_filled_row_nan(fill):
    """where(mask, s, -inf): a row with no key is NaN in the source; raised as a bool mask it became the mean of V.

    Found by the fuzzer as ``decomposed`` with ``qsa-gather,raise-attention,dce``. The fix raises a
    -inf fill as the additive mask where(mask, 0, -inf); a finite fill (MLX's, JAX's) stays a bool mask,
    whose rows with no key are the mean of V in both.
    """
    case = _case(MASKED, "masked", fill=fill)
    assert check(case, parse_pipeline("raise-attention")) is None
    raised = parse_pipeline("raise-attention")[0](case.graph).graph
    assert [n.op for n in raised.nodes() if n.op == "sdpa"] == ["sdpa"]


def test_raise_attention_scales_the_mask_after_the_mask_add():
    """(s + m) * c scales the mask too; it was raised as sdpa(scale=c, mask=m), i.e. s * c + m.

    Now raised exactly as sdpa(scale=c, mask=m * c): the remark names the scaled mask.
    """
    case = _case(BIASED_THEN_SCALED, "scaled", mask="additive")
    assert check(case, parse_pipeline("raise-attention")) is None
    result = parse_pipeline("raise-attention")[0](case.graph)
    assert "mask mask·0.5 (additive)" in " ".join(r.message for r in result.applied())


def test_raise_attention_reads_bfloat16_fills():
    """np.finfo rejects bfloat16: raise-attention crashed on a bf16 where-masked attention."""
    case = _case(MASKED, "masked", dtype="bfloat16", fill=-math.inf)
    assert check(case, parse_pipeline("raise-attention")) is None


def test_split_kv_keeps_a_row_without_keys_the_mean_of_v():
    """A bool mask that hides every key: the unsplit sdpa is the mean of V (docs/semantics.md §4); split-kv's
    combine divided 0 by 0 (every shard's log-sum-exp is -inf) and returned NaN.

    Found by the fuzzer as ``sdpa`` with ``split-kv`` once the branch met main's fully-masked-row semantics.
    The combine now weighs the shards equally when none attends a key.
    """
    graph = parse_graph("""graph sdpa(q:f32[1,1,1,8], k:f32[1,1,6,8], v:f32[1,1,6,8], mask:bool[1,6]) {
  attn:f32[1,1,1,8] = sdpa[scale=None, causal='none'] q k v mask=mask
  return attn
}""")
    rng = np.random.default_rng(0)
    arrays = {n: rng.uniform(-1, 1, t.shape).astype(np.float32) for n, t in zip(graph.inputs, graph.input_types())}
    arrays["mask"] = np.zeros((1, 6), dtype=bool)
    assert check(Case("sdpa", graph, arrays), parse_pipeline("split-kv")) is None
