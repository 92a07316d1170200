"""The mlx-lm sweep (examples/mlx_lm_sweep.py) and its committed table (docs/mlx_lm_families.md).

The table lists every family of the installed mlx-lm; a fixed fast subset of
families is rerun here and must end with the status the table records, so a
regression or an improvement shows up as a failing test (then ``make zoo``).
The sweep's own parts are checked on their own: the generated configuration,
the attention-layer count, the verdict's order and the table's round trip.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from tests.models.sparse_paths import sparse_selections
from tests.util import load_example, requires

sweep = load_example("mlx_lm_sweep")
TABLE = Path(__file__).resolve().parents[2] / "docs" / "mlx_lm_families.md"

# Diverse and fast (about 30 s in all on 2 shared cores): dense GQA, hand-written soft-capped attention, a Mamba hybrid
# (conv1d), an MoE, MLA, attention sinks, and two declines: an MoE router that reads a value on the host, a custom
# Metal kernel.
SUBSET = ("llama", "gemma2", "nemotron_h", "qwen3_moe", "deepseek_v2", "gpt_oss", "dbrx", "bitnet")

mlx_lm_only = requires("mlx.core", "mlx_lm")


def table_version() -> str:
    """The mlx-lm version the committed table was generated with (its header says)."""
    return re.search(r" with mlx-lm (\S+) and MLX ", TABLE.read_text())[1]


@mlx_lm_only
def test_the_table_has_one_row_per_installed_family_and_lists_the_modules_without_one():
    from tests.mlx_lm_versions import mlx_lm_version

    if mlx_lm_version() != table_version():
        pytest.skip(
            f"the table is mlx-lm {table_version()}'s; installed: {mlx_lm_version()} (`make zoo` writes its own)"
        )
    found, skipped = sweep.families()
    assert len(found) >= 100  # mlx-lm 0.32 has 125
    assert list(sweep.committed(TABLE)) == found, "a family was added or removed: run `make zoo`"
    text = TABLE.read_text()
    for name in skipped:
        assert f"- `{name}`:" in text
    assert {"base", "cache", "switch_layers", "rope_utils"} <= set(skipped)


@mlx_lm_only
def test_every_family_of_the_installed_mlx_lm_has_a_row_in_the_table():
    """Also where the table is another mlx-lm's (``make test-mlx-lm-oldest``): each family installed has a row."""
    found, _ = sweep.families()
    assert len(found) >= 100 and set(found) <= set(sweep.committed(TABLE)), set(found) - set(sweep.committed(TABLE))


@mlx_lm_only
@pytest.mark.parametrize("family", SUBSET)
def test_a_family_reaches_the_status_the_table_records(family):
    record = sweep.run_family(family)
    status, reason = sweep.verdict(record)
    assert status == sweep.committed(TABLE)[family], f"{family}: {status}: {reason}"
    assert len(record["cases"]) == 6 and record["optimize"] is not None and record["speculative"] is not None
    if status == "handled":
        assert all(c["raised"] == record["layers"] > 0 for c in record["cases"])
        assert record["optimize"]["identical"]
        assert record["speculative"]["identical"] or record["speculative"]["status"] == "n/a"


@mlx_lm_only
def test_generated_arguments_are_tiny_fill_required_fields_and_keep_other_defaults():
    module = importlib.import_module("mlx_lm.models.qwen3")
    args = sweep.tiny_args("qwen3_not_in_the_zoo", module)
    assert args["hidden_size"] == 192 and args["num_hidden_layers"] == 2 and args["vocab_size"] == 128
    fields = {f.name: f for f in dataclasses.fields(module.ModelArgs)}
    required = {n for n, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING}
    assert required - {"model_type"} <= set(args) <= set(fields)
    # a field with a default and no size keeps it: nothing beyond TINY, FILL-for-required and overrides is set
    assert all(n in sweep.TINY or n in required for n in args)


@mlx_lm_only
def test_a_wrapper_gets_its_inner_model_as_a_text_config():
    module = importlib.import_module("mlx_lm.models.gemma3")
    args = sweep.tiny_args("gemma3", module)
    assert args["text_config"]["hidden_size"] == 192 and args["text_config"]["model_type"] == "gemma3"
    assert not set(sweep.CHOICES) & set(args["text_config"])


@mlx_lm_only
@pytest.mark.parametrize("family, layers", [("llama", 2), ("gemma2", 2), ("nemotron_h", 1), ("bitnet", None)])
def test_attention_layers_count_fused_and_hand_written_attention_not_other_layers(family, layers):
    # llama: mlx-lm's fused helper; gemma2: its own softmax over [B, H, L, S]; nemotron_h: 1 Mamba layer, 1 attention;
    # bitnet: its import declines (a Metal kernel), so nothing is counted
    assert sweep.attention_layers(family) == layers


@mlx_lm_only
def test_the_structural_count_takes_a_softmax_for_attention_only_when_a_matmul_contracts_it_with_v():
    """deepseek_v41's softmaxes over 4 axes that are not attention (hyper-connection mixing, latent pooling) and an
    MoE router's: one attention layer among them (its softmax over 4 axes too)."""
    import mlx.core as mx

    from attnpass.ir import from_mlx

    rng = np.random.default_rng(0)
    w_mix, w_gate, w_router = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((8, 4), (8, 8), (8, 3)))

    def block(x, q, k, v):  # x [1, 6, 8]; q, k, v [1, 2, 6, 4]
        mix = mx.softmax((x @ w_mix).reshape(1, 6, 2, 2), axis=-1)  # mixing weights over 4 axes
        pooled = mx.sum(x.reshape(1, 3, 2, 8) * mx.softmax((x @ w_gate).reshape(1, 3, 2, 8), axis=2), axis=2)
        routed = mx.softmax(x @ w_router, axis=-1)
        attn = mx.softmax(q @ k.swapaxes(-1, -2) * 0.5, axis=-1) @ v
        return attn.sum() + mix.sum() + pooled.sum() + routed.sum()

    args = [mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 6, 8), *[(1, 2, 6, 4)] * 3)]
    assert sweep.candidates(from_mlx(block, *args).graph) == 1


def _top2(compiled_partition):
    """A zoo case's ``make`` of hy_v4's sparse mask (``mlx_vlm/models/hy_v4``: its indexer's
    ``mx.compile(shapeless=True)`` argpartition, ``kth=-top_k``; the mask ``put_along_axis`` of the last ``top_k``):
    the helper first called on a 5-key prompt, then the step on 12 keys; the reference the module's own run."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    scores = mx.array(rng.standard_normal((1, 3, 12)).astype(np.float32))
    mask = mx.array(np.tril(np.ones((3, 12), bool), 9)[None])
    prompt = mx.array(rng.standard_normal((1, 3, 5)).astype(np.float32))

    def sparse(scores, mask):
        top = compiled_partition(scores, mask)[..., -2:]
        keep = mx.put_along_axis(mx.zeros(scores.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
        return mx.where(keep & mask, scores, 0.0)

    def make():
        compiled_partition(prompt, mx.ones(prompt.shape, dtype=mx.bool_))  # as a prefill: traced at 5 keys
        return sparse, (scores, mask), lambda: np.array(sparse(scores, mask))

    return make


@dataclasses.dataclass(frozen=True)
class _OneCase(sweep.Library):
    """A library of one case, whatever the family: ``make``'s."""

    make: object = None

    def case(self, family, step, dtype, layers=2):
        return sweep.zoo.Case(f"{family}/{step}/{dtype}", "mlx", dtype, layers, self.make)


def _one_case(make):
    return _OneCase(**{f.name: getattr(sweep.MLX_LM, f.name) for f in dataclasses.fields(sweep.MLX_LM)}, make=make)


@mlx_lm_only
def test_a_module_that_computes_otherwise_compiled_is_its_own_mismatch_not_a_silently_wrong_import():
    """hy_v4's verify case: MLX resolves argpartition's negative kth at a shapeless helper's first trace (5 keys: kth
    3), and replays it on 12 keys, so the module's compiled top 2 are two of its top 9. The import is the function
    as written (MLX's uncompiled run, the top 2); the sweep says the module computes otherwise compiled. A reference
    that no run of the function gives stays a MISMATCH."""
    import mlx.core as mx

    def partition(scores, mask):
        return mx.argpartition(mx.where(mask, scores, -float("inf")), kth=-2, axis=-1)

    make = _top2(mx.compile(partition, shapeless=True))
    fn, args, reference = make()
    with sweep.compile_off():
        uncompiled = np.array(fn(*args))
    if np.array_equal(reference(), uncompiled):
        pytest.skip("this MLX resolves argpartition's kth at each call of a shapeless compiled function")
    case = sweep.run_case("sparse", "verify", "f32", 0, _one_case(make))
    assert case["status"] == "declined"  # by the module's own reason: attnpass's import is the function as written
    assert case["reason"].startswith("module: its mx.compile'd run differs from its uncompiled run, which the import")
    error = sweep.zoo._max_error(reference(), uncompiled)
    assert case["reason"].endswith(f"(max error {error:.2e} > 1.0e-04; 0.00e+00 uncompiled)")

    def wrong():  # the same function, its reference off by one
        fn, args, _reference = make()
        return fn, args, lambda: uncompiled + 1.0

    case = sweep.run_case("sparse", "verify", "f32", 0, _one_case(wrong))
    assert case["status"] == "failed" and case["reason"] == "MISMATCH (silently wrong): max error 1.00e+00 > 1.0e-04"


def _record(family, *statuses, optimize="handled", speculative="handled", config=""):
    cases = [
        dict(case=f"{family}/{step}/{dtype}", status=s, raised=2, reason=f"r{i}")
        for i, ((step, dtype), s) in enumerate(zip([(s, d) for s in ("prefill", "verify", "decode")
                                                     for d in ("f32", "bf16")], statuses))
    ]  # fmt: skip
    opt = dict(status=optimize, identical=optimize == "handled", routed=3, declined={"x": 1}, reason="o")
    ran = speculative in ("handled", "failed")  # n/a: mlx-lm refused it, nothing ran
    spec = dict(status=speculative, identical=speculative == "handled" if ran else None, routed=4 * ran,
                declined={"y": 2 * ran}, reason="s")  # fmt: skip
    return dict(family=family, cases=cases, optimize=opt, speculative=spec, layers=2, config=config)


def test_the_verdict_is_failed_before_declined_before_handled_with_the_first_reason():
    assert sweep.verdict(_record("a", *["handled"] * 6)) == ("handled", "")
    assert sweep.verdict(_record("a", "handled", "declined", "failed", "declined", "handled", "handled")) == (
        "failed", "verify/f32: r2")  # fmt: skip
    assert sweep.verdict(_record("a", "handled", "declined", *["handled"] * 4)) == ("declined", "prefill/bf16: r1")
    assert sweep.verdict(_record("a", *["handled"] * 6, optimize="failed")) == ("failed", "optimize: o")
    assert sweep.verdict(_record("a", *["handled"] * 6, speculative="failed")) == ("failed", "speculative: s")
    assert sweep.verdict(_record("a", *["handled"] * 6, speculative="n/a")) == ("handled", "")
    assert sweep.verdict(_record("a", "declined", *["handled"] * 5, speculative="n/a")) == (
        "declined",
        "prefill/f32: r0",
    )
    assert sweep.verdict({**_record("a", *["handled"] * 6), "speculative": None}) == ("handled", "")  # older records
    assert sweep.verdict(_record("a", config="TypeError: x")) == ("failed", "config: TypeError: x")
    no_attention = {**_record("a", *["handled"] * 6), "layers": 0}
    assert sweep.verdict(no_attention) == ("declined", "no softmax-attention layer: nothing to raise")
    assert sweep.verdict({**_record("a", "failed"), "layers": 0})[0] == "failed"
    crashed = {**_record("a", "handled"), "optimize": None, "crash": "timeout"}
    assert sweep.verdict(crashed) == ("failed", "timeout after 1 cases")


@mlx_lm_only
def test_the_table_round_trips_each_family_status_and_counts_them(tmp_path):
    records = [_record("a", *["handled"] * 6), _record("b", "declined", *["handled"] * 5, speculative="n/a"),
               _record("d", "failed", *["handled"] * 5, speculative="failed")]  # fmt: skip
    text = sweep.table(records, {"base": sweep.HELPER_REASON}, "make zoo", 60.0)
    (tmp_path / "t.md").write_text(text)
    assert sweep.committed(tmp_path / "t.md") == {"a": "handled", "b": "declined", "d": "failed"}
    assert "3 families: 1 handled, 1 declined by name, 1 failed." in text
    assert "| `a` | handled | ok | ok | ok | ok | ok | ok | 2/2 | identical 3/1 | identical 4/2 |  |" in text
    assert "| 2/2 | identical 3/1 | n/a (s) | prefill/f32: r0 |" in text
    assert "| 2/2 | identical 3/1 | **DIFFER** 4/2 | prefill/f32: r0 |" in text
    assert "- `base`: no Model and ModelArgs" in text


def test_a_crash_names_its_signal_and_the_innermost_frame_of_the_sweep_or_mlx_lm():
    dump = (
        "Fatal Python error: Segmentation fault\n\nThread 0x7f (most recent call first):\n"
        '  File "/x/mlx/nn/layers/base.py", line 9 in f\n'
        '  File "/x/mlx_lm/models/phi3small.py", line 298 in __call__\n'
        f'  File "{sweep.__file__}", line 265 in attention_layers\n'
    )
    assert sweep._ending(-11, dump) == "killed by SIGSEGV in __call__ (phi3small.py:298)"
    assert sweep._ending(-9, "") == "killed by SIGKILL"
    assert sweep._ending(1, "Traceback...\nValueError: bad") == "ValueError: bad"


@mlx_lm_only
@pytest.mark.parametrize("family, reason", [("llama", ""), ("nemotron_h", "ArraysCache not trimmable"), ("gemma2", "")])
def test_speculative_decoding_is_refused_only_where_mlx_lm_cannot_trim_a_cache(family, reason):
    from mlx_lm.models.cache import make_prompt_cache

    model = sweep.zoo.mlx_model(family, "f32", sweep.tiny_args)
    assert sweep.untrimmable(model) == reason
    if reason:  # mlx-lm itself refuses it: the check is n/a, and nothing ran
        with pytest.raises(ValueError, match="trimmable"):
            sweep.speculative(model, model)
        assert sweep.run_speculative(family) == dict(status="n/a", reason=reason, identical=None, routed=0, declined={})
    else:
        assert all(c.is_trimmable() for c in make_prompt_cache(model))


@mlx_lm_only
def test_a_drop_in_check_whose_tokens_differ_from_greedy_fails_the_family():
    plain = sweep.greedy(sweep.zoo.mlx_model("llama", "f32", sweep.tiny_args))
    other = [(token + 1) % 128 for token in plain]
    part = sweep.drop_in("llama", lambda model: other)
    assert part["status"] == "failed" and part["identical"] is False
    assert part["reason"] == f"tokens differ from greedy: {other} vs {plain}"
    record = {**_record("llama", *["handled"] * 6), "speculative": part}
    assert sweep.verdict(record) == ("failed", f"speculative: {part['reason']}")
    assert sweep._drop_in_cell(record, "speculative") == "**DIFFER** 0/0"


@mlx_lm_only
def test_speculative_verify_calls_are_counted_apart_from_the_greedy_run():
    """deepseek_v3 (dense MLA): the greedy run's prefill and one-row decodes are declined, the speculative run's
    4-row verify calls routed (2 verify steps x 2 layers), each under its own handle."""
    greedy, speculative = sweep.run_optimize("deepseek_v3"), sweep.run_speculative("deepseek_v3")
    assert greedy["identical"] and greedy["routed"] == 0 and greedy["declined"]["mla_absorbed"] == 18
    assert speculative["identical"] and speculative["routed"] == 4 and "mla_absorbed" not in speculative["declined"]


@mlx_lm_only
def test_speculative_decoding_is_no_check_where_mlx_lm_s_own_tokens_differ_from_greedy():
    """plamo3 (two sliding-window layers, window 8, an 11-token prompt): plain mlx-lm's speculative tokens are not
    its greedy ones, so the check is n/a (with both), not a failure of optimize; llama's are its greedy ones."""
    from tests.mlx_lm_versions import needs_family

    needs_family("plamo3")
    for family, differs in (("llama", False), ("plamo3", True)):  # plamo3 last: its reason is checked below
        model = sweep.zoo.mlx_model(family, "f32", sweep.tiny_args)
        draft = sweep.zoo.mlx_model.__wrapped__(family, "f32", sweep.tiny_args)
        plain, own = sweep.greedy(model), sweep.speculative(model, draft)
        assert (own != plain) == differs
        reason = sweep.unspeculative(model, draft, plain)
        assert reason == (f"mlx-lm's own speculative tokens differ from greedy: {own} vs {plain}" if differs else "")
    part = sweep.run_speculative("plamo3")
    assert part["status"] == "n/a" and part["reason"] == reason and part["identical"] is None
    assert sweep.verdict({**_record("plamo3", *["handled"] * 6), "speculative": part}) == ("handled", "")


def _last_row(selected) -> np.ndarray:
    return np.asarray(selected).reshape(-1, np.asarray(selected).shape[-1])[-1]


# The learned-sparse families: the function that selects (once per sparse layer) and what a call kept of what its
# last query row could see, (kept, visible); None where it selected nothing (every key fits its budget).
SPARSE = {
    # the indexer's top-k blocks as a keep mask over the keys (its mask returned as given where nothing is dropped)
    "minimax_m3_vl": ("minimax_m3_vl", "Attention", "_block_mask", lambda a, out: None if out is a["mask"] else (
        int(_last_row(out).sum()), out.shape[-1])),
    # the top-k compressed entries, -1 for none, of the groups complete at the last query
    "deepseek_v41": ("deepseek_v41", "Indexer", "__call__", lambda a, out: (
        len({int(i) for i in _last_row(out[0]) if i >= 0}), (a["start_pos"] + a["x"].shape[1]) // a["self"].ratio)),
}  # fmt: skip


@mlx_lm_only
@pytest.mark.parametrize("family", sorted(SPARSE))
@pytest.mark.parametrize("step", ["verify", "decode"])
def test_a_learned_sparse_family_s_tiny_configuration_runs_its_sparse_path_and_drops_keys(family, step):
    """Each learned-sparse family's tiny configuration selects fewer keys (or compressed entries) than its cached
    verify and decode steps can see: its sparse layers run, and drop something, in the sweep's own cases."""
    from tests.mlx_lm_versions import needs_family

    needs_family(family)
    seen = sparse_selections(family, step, sweep.MLX_LM, "mlx_lm", SPARSE)
    assert seen, f"{family}/{step}: no sparse layer ran"
    assert all(s is not None and s[0] < s[1] for s in seen), f"{family}/{step}: (kept, visible) {seen}"
