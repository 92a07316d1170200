"""The mlx-vlm sweep (examples/mlx_vlm_sweep.py) and its committed table (docs/mlx_vlm_families.md).

The table lists every family of the installed mlx-vlm that has a language model; a fixed fast subset is rerun here
and must end with the status the table records (then ``make zoo-vlm``). The sweep's own parts are checked on their
own: which packages are families, the generated configurations, and the language model called as mlx-vlm's
``generate`` calls it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.sparse_paths import sparse_selections
from tests.util import load_example, requires

sweep = load_example("mlx_vlm_sweep")
TABLE = Path(__file__).resolve().parents[2] / "docs" / "mlx_vlm_families.md"

# Diverse and fast: dense GQA (llama), a VL family whose language model reads its ModelConfig (qwen2_vl, mRoPE),
# sliding-window layers (gemma3), MLA (deepseek_v3), a hybrid with an untrimmable cache (qwen3_next), Qwen4-Exp's QSA
# calls (its decode import declined: the module calls mx.async_eval), and two declines: hand-written attention that
# optimize has no client for (gemma2), a custom Metal kernel (bitnet).
SUBSET = ("llama", "qwen2_vl", "gemma3", "deepseek_v3", "qwen3_next", "qwen4_exp", "gemma2", "bitnet")

mlx_vlm_only = requires("mlx.core", "mlx_vlm")


@mlx_vlm_only
def test_the_table_has_one_row_per_installed_family_and_lists_the_modules_without_one():
    found, skipped = sweep.families()
    assert len(found) >= 150  # mlx-vlm 0.7.10 has 197
    assert list(sweep.lm.committed(TABLE)) == found, "a family was added or removed: run `make zoo-vlm`"
    text = TABLE.read_text()
    for name, reason in skipped.items():
        assert f"- `{name}`: {reason}" in text
    assert {"base", "cache", "siglip", "flux2", "bert", "qwen3_embedding"} <= set(skipped)


@mlx_vlm_only
def test_packages_without_a_language_model_are_skipped_by_name_and_every_named_one_is_installed():
    import mlx_vlm.models

    found, skipped = sweep.families()
    packages = {p.name for p in Path(mlx_vlm.models.__path__[0]).iterdir() if (p / "__init__.py").exists()}
    assert set(sweep.NOT_LANGUAGE) <= packages, "a package named in NOT_LANGUAGE is gone: remove it there"
    assert not set(sweep.NOT_LANGUAGE) & set(found)
    assert all(skipped[name] == reason for name, reason in sweep.NOT_LANGUAGE.items())
    assert skipped["base"] == sweep.HELPER_REASON and "qwen2_vl" in found


def _row(family: str) -> list[str]:
    """The table's cells of ``family``."""
    line = next(line for line in TABLE.read_text().splitlines() if line.startswith(f"| `{family}` |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


@mlx_vlm_only
@pytest.mark.parametrize("family", SUBSET)
def test_a_family_reaches_the_status_and_drop_in_cells_the_table_records(family):
    record = sweep.lm.run_family(family, library=sweep.MLX_VLM)
    status, reason = sweep.lm.verdict(record)
    row = _row(family)
    assert status == row[1], f"{family}: {status}: {reason}"
    assert len(record["cases"]) == 6 and record["optimize"] is not None and record["speculative"] is not None
    # optimize's greedy tokens and the speculative check, with their calls routed/declined
    assert [sweep.lm._drop_in_cell(record, name) for name in sweep.lm.DROP_INS] == row[9:11]
    if status == "handled":
        assert all(c["raised"] == c.get("layers", record["layers"]) > 0 for c in record["cases"])
        assert record["optimize"]["identical"]


@mlx_vlm_only
def test_a_step_whose_logits_depend_on_fewer_attention_layers_is_counted_by_its_own_import():
    # florence2's warm-cache steps run its encoder too (18 fused calls), but only the decoder's 12 reach the logits
    case = sweep.lm.run_case("florence2", "verify", "f32", 18, sweep.MLX_VLM)
    assert (case["status"], case["raised"], case["layers"]) == ("handled", 12, 12), case


@mlx_vlm_only
def test_generated_configurations_are_tiny_and_a_vl_language_model_gets_its_model_config():
    from mlx.utils import tree_flatten

    language, (text, whole) = sweep.tiny_configs("qwen2_vl")
    assert language.__module__ == "mlx_vlm.models.qwen2_vl.language"
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size, text.num_attention_heads) == (192, 2, 128, 24)
    assert whole.text_config is text and whole.vision_config is not None
    model = sweep.vlm_model("qwen2_vl", "f32")
    assert sum(v.size for _, v in tree_flatten(model.parameters())) < 1_000_000
    # a text-only family's language model takes its ModelConfig
    language, (config,) = sweep.tiny_configs("llama")
    assert type(config).__name__ == "ModelConfig" and config.hidden_size == 192 and config.model_type == "llama"


@mlx_vlm_only
def test_the_language_model_is_called_as_mlx_vlm_s_generate_calls_it():
    """mlx-vlm's caches (the model's make_cache()); logits of the LanguageModelOutput; a new sequence resets the
    mRoPE positions kept from the last one (qwen2_vl slices them for the next call otherwise)."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    model = sweep.vlm_model("qwen2_vl", "f32")
    tokens = mx.array(sweep.zoo.TOKENS[None, :7])
    assert mx.array_equal(model(tokens), model.language_model(tokens).logits)
    longer = mx.array(sweep.zoo.TOKENS[None, :11])
    model(tokens)  # the language model keeps the 7 positions
    with pytest.raises(ValueError, match="broadcast"):  # and slices them for the next 11 tokens, unless reset
        model.language_model(longer, cache=vlm_cache.make_prompt_cache(model.language_model))
    model(tokens)
    cache = model.make_cache()  # a new sequence: reset
    assert all(isinstance(c, vlm_cache.KVCache) for c in cache)
    assert model(longer, cache=cache).shape == (1, 11, 128)


@mlx_vlm_only
def test_a_model_s_own_setup_of_its_language_model_is_made_too():
    """What a family's Model does to its language model: jina_vlm's attaches lm_head (its LanguageModel reads it);
    minicpmo's sets its positions from the prompt's ids (else its language model, qwen3_vl's, derives them from a
    vision configuration that has no merge size); minicpmv4_7's then sets its canvas positions: the same for text."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.models.minicpmv4_7 import minicpmv4_7

    jina = sweep.vlm_model("jina_vlm", "f32")
    assert jina.language_model.lm_head.weight.shape == (128, 192)
    tokens = mx.array(sweep.zoo.TOKENS[None, :7])
    assert jina(tokens).shape == (1, 7, 128)
    minicpmo = sweep.vlm_model("minicpmo", "f32")
    assert minicpmo(tokens).shape == (1, 7, 128)
    assert minicpmo.language_model._position_ids.shape == (3, 1, 7)
    # minicpmv4_7's canvas positions of a text-only prompt: its Model's, as _set_position_state's
    _, (_, whole) = sweep.tiny_configs("minicpmv4_7")
    ids = np.asarray(sweep.zoo.TOKENS[None, :11])
    positions, deltas = minicpmv4_7.CanvasRoPE(whole).get_rope_index(
        ids, mm_token_type_ids=np.zeros_like(ids), target_sizes=np.asarray([]), target_sizes_videos=np.asarray([]),
        downsample_mode=whole.downsample_mode, attention_mask=None,
    )  # fmt: skip
    model = sweep.vlm_model("minicpmv4_7", "f32")
    model.make_cache()  # a new sequence
    model(mx.array(ids))
    assert np.array_equal(np.asarray(positions), np.array(model.language_model._position_ids))
    assert not np.asarray(deltas).any() and not np.array(model.language_model._rope_deltas).any()


@mlx_vlm_only
def test_families_generate_step_cannot_drive_are_declined_by_a_reason_that_holds():
    """phi3small's logits mask indexes the batch axis (mlx-lm's the vocabulary's): out of bounds, a segfault in
    MLX's scatter; diffusion_gemma is generated by denoising a random canvas (mlx-vlm routes a ModelConfig with a
    canvas length to its diffusion path)."""
    import inspect

    from mlx_vlm.generate import diffusion
    from mlx_vlm.models.diffusion_gemma import language as diffusion_gemma
    from mlx_vlm.models.phi3small import language as phi3small

    assert set(sweep.UNDRIVEN) == set(sweep.MLX_VLM.undriven) == {"phi3small", "diffusion_gemma"}
    assert "out[self._dummy_tokenizer_ids] = " in inspect.getsource(phi3small.LanguageModel.__call__)
    assert int(sweep.vlm_model("phi3small", "f32").language_model._dummy_tokenizer_ids.min()) == 100256
    _, (_, whole) = sweep.tiny_configs("diffusion_gemma")
    assert diffusion._has_engine_diffusion_config(whole)
    assert "mx.random.randint" in inspect.getsource(diffusion_gemma.DiffusionGemma4Backbone.__call__)
    for name in sweep.UNDRIVEN:
        part = sweep.lm.run_optimize(name, sweep.MLX_VLM)
        assert part == sweep.lm._part("declined", sweep.UNDRIVEN[name])


@mlx_vlm_only
def test_a_case_counts_its_own_attention_layers_where_the_prefill_import_declines():
    """hunyuan_vl computes its prefill's positions from the token ids on the host (the import declines, by name);
    its verify step reads them from its cache: that case counts its own 2 layers and raises both."""
    prefill = sweep.lm.run_case("hunyuan_vl", "prefill", "f32", None, sweep.MLX_VLM)
    assert prefill["status"] == "declined" and "reads an array's value on the host" in prefill["reason"]
    verify = sweep.lm.run_case("hunyuan_vl", "verify", "f32", None, sweep.MLX_VLM)
    assert (verify["status"], verify["raised"], verify["layers"]) == ("handled", 2, 2), verify
    record = {"family": "hunyuan_vl", "layers": None, "cases": [prefill, verify]}
    assert sweep.lm._raised(record) == "2/2"


@mlx_vlm_only
def test_the_model_library_s_code_is_the_module_s_even_in_a_virtual_environment_inside_the_checkout():
    """A frame of mlx-vlm's code is the module's (``module:``), wherever its package is installed: in this
    checkout's .venv too; attnpass's own code is attnpass's."""
    import mlx.core as mx
    import mlx_vlm

    import attnpass.ir

    assert not sweep.lm._library(Path(mlx_vlm.__file__)) and sweep.lm._library(Path(attnpass.ir.__file__))
    language, (text,) = sweep.tiny_configs("jina_vlm")
    with pytest.raises(AttributeError) as raised:  # jina_vlm's language model without the lm_head its Model attaches
        language(text)(mx.array(sweep.zoo.TOKENS[None, :3]))
    assert sweep.lm._failure(raised.value).startswith("module: AttributeError:")


def _last_row_kept(selected, visible):
    """``(kept, visible)``: the distinct valid (>= 0) entries of the last query row of ``selected`` (ids, any
    leading axes), and ``visible``."""
    import numpy as np

    row = np.asarray(selected).reshape(-1, np.asarray(selected).shape[-1])[-1]
    return len({int(i) for i in row if i >= 0}), int(visible)


def _mask_kept(mask, visible):
    """``(kept, visible)`` of a keep mask (bool, or additive: kept where above -1e20), its last query row."""
    import mlx.core as mx
    import numpy as np

    keep = mask if mask.dtype == mx.bool_ else mask.astype(mx.float32) > -1e20
    return int(np.asarray(keep).reshape(-1, keep.shape[-1])[-1].sum()), int(visible)


def _keys(cache, x):
    """The keys a call sees: its cache's after the call (which appends this step's), else its own tokens'."""
    return x.shape[1] if cache is None else cache.offset


# The learned-sparse families: where each selects (the class or module and the function spied, called once per sparse
# layer), and what a call kept of what its last query row could see: (kept, visible), None where it selected nothing
# (every key fits its budget).
SPARSE = {
    # the indexer's top-k blocks as a keep mask over the keys (on the CPU, no Metal kernel: the mask path)
    **dict.fromkeys(("minimax_m3_vl", "minimax_m3"), (
        "minimax_m3_vl.language", "MiniMaxM3Indexer", "build_block_mask",
        lambda a, out: _mask_kept(out, a["q_positions"][0, -1].item() + 1),
    )),
    # the indexer's top-k token ids over the MLA latent (the cache's, after this step's)
    "hy_v4": ("hy_v4.indexer", "HyV4Indexer", "__call__",
              lambda a, out: None if out is None else (out.shape[-1], _keys(a["cache"], a["x"]))),
    "longcat_flash_sparse": ("longcat_flash_sparse.language", "Indexer", "__call__",
                             lambda a, out: None if out is None else (out.shape[-1], _keys(a["cache"], a["x"]))),
    # top pools' token ids (and the partial tail), -1 for none
    "glm5_next": ("glm5_next.language", "Glm5NextIndexer", "__call__",
                  lambda a, out: _last_row_kept(out, a["offset"] + a["x"].shape[1])),
    # the top-k compressed entries (beside the window) of the sparse branch, of the pooled entries
    "deepseek_v4": ("deepseek_v4.language", None, "_sparse_pooled_attention",
                    lambda a, out: _last_row_kept(a["topk"], a["pooled"].shape[1])),
    "deepseek_v41": ("deepseek_v41.language", "DeepseekV41Attention", "_sparse_attention",
                     lambda a, out: _last_row_kept(a["indices"], a["pool"].shape[1])),
}  # fmt: skip


@mlx_vlm_only
@pytest.mark.parametrize("family", sorted(SPARSE))
@pytest.mark.parametrize("step", ["verify", "decode"])
def test_a_learned_sparse_family_s_tiny_configuration_runs_its_sparse_path_and_drops_keys(family, step):
    """Each learned-sparse family's tiny configuration selects fewer keys (or compressed entries) than its cached
    verify and decode steps can see: its sparse layers run, and drop something, in the sweep's own cases."""
    seen = sparse_selections(family, step, sweep.MLX_VLM, "mlx_vlm", SPARSE)
    assert seen, f"{family}/{step}: no sparse layer ran"
    assert all(s is not None and s[0] < s[1] for s in seen), f"{family}/{step}: (kept, visible) {seen}"
