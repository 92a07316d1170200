"""mlx-vlm's row-loop families under ``optimize``: GLM-5-Next and DeepSeek-V4, in inference mode (as ``mlx_vlm.load``
leaves a model), their sparse paths on (the sweep's tiny configurations), float32, ``check=True``.

Both run a call of 2 to 8 rows as one-row calls of mlx-vlm's helper: GLM-5-Next's each over latent cells it gathered
itself with its query embedded in the latent space (declined ``mla_absorbed``), DeepSeek-V4's as one-row decode steps
whose keys are its window and compressed entries, not a cache's fetch (declined ``not_fetched``). So a 4-row call is
declined exactly four times what a one-row call is, nothing is routed, and the tokens are the model's own.
docs/sparse_selections.md ("Not routed yet") gives the measured reason the loop is not batched.
"""

from __future__ import annotations

import pytest

from tests.util import lazy_import, load_example, requires

pytestmark = requires("mlx.core", "mlx_vlm")

mx = lazy_import("mlx.core")


@pytest.mark.parametrize("family, code", [("glm5_next", "mla_absorbed"), ("deepseek_v4", "not_fetched")])
def test_a_multi_row_call_is_the_models_loop_of_one_row_calls_each_declined_by_its_code(family, code):
    from attnpass.backends.mlx import optimize

    sweep, lm = load_example("mlx_vlm_sweep"), load_example("mlx_lm_sweep")
    model = sweep.MLX_VLM.model(family)
    assert not model.training  # inference mode: the loop runs only there
    plain = lm.greedy(model)
    cache = model.make_cache()
    with optimize(model, min_keys=0, check=True) as opt:
        assert lm.greedy(model) == plain
        model(mx.array([list(range(1, 13))]), cache)  # a prompt on a fresh cache
        counts = [opt.declined.get(code, 0)]
        for rows in (1, 4):  # a decode step, then a 4-row verify-sized call
            model(mx.array([list(range(20, 20 + rows))]), cache)
            counts.append(opt.declined.get(code, 0))
    one, four = counts[1] - counts[0], counts[2] - counts[1]
    assert one >= 1 and four == 4 * one, counts  # one declined helper call per row and looping layer
    assert opt.routed == 0 and set(opt.declined) == {code}
