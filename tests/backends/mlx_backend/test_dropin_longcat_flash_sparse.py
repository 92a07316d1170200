"""mlx-vlm's LongCat-Flash-Sparse under ``optimize``: its absorbed verify calls gathered over the indexer's top-k.

A call of a few rows on a warm cache attends in the latent form (keys and values the cached latent, the queries
``embed_q``'s output) under the rope scores masked to the indexer's top-k (``finfo.min`` elsewhere). The router
records each top-k the ``Indexer`` returns and, when the mask is on its values that selection of itself
(``selection_holds``), routes the call to ``token_attention``, which dsa-gather turns into one gather of the latent
per row (backends/mlx/selections.py, ``latent_plan``). Its prefill (expanded by the model: keys and values mlx-vlm's
``MultiLinear`` projections of the latent) goes to ``dsa_attention`` (backends/mlx/caches/mla.py): absorbed and
gathered. The sweep's tiny configuration: top 4 keys.
"""

from __future__ import annotations

import pytest

from tests.util import load_example, requires

pytestmark = requires("mlx.core", "mlx_vlm")

FAMILY = "longcat_flash_sparse"


@pytest.fixture(scope="module")
def models():
    sweep = load_example("mlx_vlm_sweep")
    return sweep.MLX_VLM.model(FAMILY), sweep.MLX_VLM.fresh(FAMILY)


def test_speculative_verify_steps_gather_the_indexers_top_k(models):
    from attnpass.backends.mlx import optimize

    lm = load_example("mlx_lm_sweep")
    model, draft = models
    plain = lm.greedy(model)
    assert lm.speculative(model, draft) == plain  # plain mlx-vlm: the check is meaningful
    with optimize(model, min_keys=0, check=True) as opt:
        tokens = lm.speculative(model, draft)
    assert tokens == plain
    (found,) = opt.programs["token_attention"].specializations  # the verify steps
    assert found.ops["qsa_gather"] == 1  # the one latent, gathered once per row
    assert any(r.pass_name == "dsa-gather" and r.kind == "applied" for r in found.remarks)
    (prefill,) = opt.programs["dsa_attention"].specializations  # expanded by the model, absorbed and gathered here
    assert {r.pass_name for r in prefill.remarks if r.kind == "applied"} >= {"mla-absorb", "dsa-gather"}
    assert opt.routed >= 3 and not opt.declined


def test_a_recorded_top_k_the_mask_does_not_select_is_not_gathered(models, monkeypatch):
    """The proof is on the mask's values: a recorded top-k of position 0 only does not cover the cells the mask
    keeps, so the verify calls stay the model's own (declined: mlx-vlm attends in the latent form already) and the
    prefill is mla_attention over every key (which mla-absorb declines at these tiny sizes: little_gain), and the
    tokens are still plain's."""
    import mlx.core as mx

    from attnpass.backends.mlx import optimize, selections

    lm = load_example("mlx_lm_sweep")
    model, draft = models
    plain = lm.greedy(model)
    note = selections.note_token_selection
    monkeypatch.setattr(
        selections,
        "note_token_selection",
        lambda call, idx, *_, **__: note(call, None if idx is None else mx.zeros_like(idx)),
    )
    with optimize(model, min_keys=0) as opt:
        assert lm.speculative(model, draft) == plain
    assert not {"token_attention", "dsa_attention"} & set(opt.programs)
    assert "mla_absorbed" in opt.declined and set(opt.declined) <= {"mla_absorbed", "little_gain"}  # mla-absorb's
