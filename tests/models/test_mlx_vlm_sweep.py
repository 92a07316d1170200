"""The mlx-vlm sweep (examples/mlx_vlm_sweep.py) and its committed table (docs/mlx_vlm_families.md).

The table lists every family of the installed mlx-vlm that has a language model; a fixed fast subset is rerun here
and must end with the status the table records (then ``make zoo-vlm``). The sweep's own parts are checked on their
own: which packages are families, the generated configurations, and the language model called as mlx-vlm's
``generate`` calls it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
        assert all(c["raised"] == record["layers"] > 0 for c in record["cases"])
        assert record["optimize"]["identical"]


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
