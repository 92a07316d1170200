"""mlx-vlm's DSA families under ``optimize``: HunyuanV4 (``hy_v4``) and DeepSeek-V3.2 (``deepseek_v32``).

Their caches are mlx-vlm ``CacheList`` s (routed where the first entry holds an MLA latent) of ``KVCache`` s, or
HunyuanV4's ``HyV4KVCache`` (a ``KVCache`` growing by doubling). A call of several rows expands the latent with
mlx-vlm's ``MultiLinear`` and attends it under the rope scores kept on the indexer's top-k (HunyuanV4: with one
sink per head): routed to ``dsa_attention`` when the top-k the ``Indexer`` returned is, on the mask's values, the
selection (absorbed by mla-absorb, gathered by dsa-gather, the sinks carried). A one-row step gathers its cells in
the model (declined ``mla_absorbed``). The sweep's tiny configurations, float32, ``check=True``.
"""

from __future__ import annotations

import pytest

from tests.util import load_example, requires

pytestmark = requires("mlx.core", "mlx_vlm")


@pytest.mark.parametrize("family", ["hy_v4", "deepseek_v32"])
def test_greedy_and_speculative_tokens_are_the_models_with_the_prefill_and_verify_calls_gathered(family):
    from attnpass.backends.mlx import optimize

    sweep, lm = load_example("mlx_vlm_sweep"), load_example("mlx_lm_sweep")
    model, draft = sweep.MLX_VLM.model(family), sweep.MLX_VLM.fresh(family)
    plain, plain_drafted = lm.greedy(model), lm.speculative(model, draft)  # hy_v4's differ (its compile, not ours)
    with optimize(model, min_keys=0, check=True) as opt:
        assert lm.greedy(model) == plain
        assert lm.speculative(model, draft) == plain_drafted
    assert opt.routed and set(opt.declined) <= {"mla_absorbed"}
    gathered = opt.programs["dsa_attention"].specializations
    assert gathered and all(s.ops["qsa_gather"] >= 1 for s in gathered)
    for s in gathered:
        assert {r.pass_name for r in s.remarks if r.kind == "applied"} >= {"mla-absorb", "dsa-gather"}
        assert ("sinks:f32[" in s.signature) == (family == "hy_v4")
