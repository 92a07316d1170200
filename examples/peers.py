"""The peer suites' table: one :class:`Peer` record per library whose own tests ``examples/peer_suite.py`` runs.

A record says where the peer's tests come from (:class:`Sdist`: a release's sdist, fetched with pip; or
:class:`GitArchive`: a ref of a git clone), which of them run (``tests``) and why the others do not (``left_out``:
files; ``deselected``: tests of the files run, by node id), which model classes get optimized (``models``,
``classes``, ``submodules``), the hub models served by a local stand-in (:class:`StandIn`), the page the run
writes, and why tests fail or skip plain (``why``, diagnosed by hand for the versions named; else the record's
``rules``, then :data:`RULES`, on the message). Read by the script and by its
pytest plugin (``examples/peer_optimize_plugin.py``, ``--attnpass-peer NAME``); imports nothing heavy at import.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sdist:
    """The ``tests/`` of the sdist of ``distribution`` ``version`` on the package index (``pip download``)."""

    distribution: str
    version: str


@dataclasses.dataclass(frozen=True)
class GitArchive:
    """The folder ``path`` at ``ref`` of a git clone of ``url`` (``git archive``): the clone is given with
    ``--git-dir`` (``option``, also a make variable), else ``default`` where it exists. ``package``: the folder of
    the library's own source at ``ref``, which the tests failing plain are run against once more (when the tests
    are not the installed version's, that tells the version gap from the rest)."""

    url: str
    ref: str
    path: str
    package: str
    option: str  # the make variable that passes the clone
    default: str = ""


@dataclasses.dataclass(frozen=True)
class StandIn:
    """A local model served for the hub ``repos`` the tests download: ``make(folder)`` writes it (once), ``serve
    (patch, path)`` resolves the repos to it at the peer's download seams (``patch``: a ``pytest.MonkeyPatch``);
    ``what`` says what it is, for the page."""

    repos: tuple[str, ...]
    make: Callable[[Path], Path]
    serve: Callable[[Any, Path], None]
    what: str


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer suite (see the module's docstring)."""

    name: str  # the distribution, and the make target's suffix: make peer-<name>
    version: str  # the installed version the record was diagnosed against (the tests need not be its own)
    source: Sdist | GitArchive
    tests: tuple[str, ...]  # pytest arguments in the tests' root
    left_out: dict[str, str]  # test files not run, why
    deselected: dict[str, str]  # tests of the files run that are not run (pytest node ids), why
    models: str  # the package whose modules (or packages) define the model classes
    classes: tuple[str, ...]  # the class names optimized in each of them
    submodules: tuple[str, ...]  # a package's submodules searched for them too
    client: str  # the helper the peer's models call, in words
    page: str  # the page --write writes by default, from the repository root
    versions: tuple[str, ...]  # the distributions whose versions head the page
    stand_in: StandIn | None = None
    why: dict[str, str] = dataclasses.field(default_factory=dict)
    rules: tuple[tuple[str, str], ...] = ()

    @property
    def tests_version(self) -> str:
        """The version the tests are of."""
        return self.source.version if isinstance(self.source, Sdist) else self.source.ref.removeprefix("v")

    @property
    def folder(self) -> str:
        """The tests' root under the cache folder (results go there too)."""
        return f"{self.name.replace('-', '_')}-{self.tests_version}"


# Why a test fails or skips plain, from its message: (pattern, reason); a group 1 fills {0}. A peer's own rules
# come first.
RULES: tuple[tuple[str, str], ...] = (
    ((r"OfflineModeIsEnabled|LocalEntryNotFoundError|couldn't connect to 'https://huggingface\.co'"
      r"|locate the file on the Hub"), "needs the network: a Hugging Face hub download"),
    (r"No Metal back-end|Metal backend|GPU only|only supported on Metal", "needs Metal (MLX's GPU backend)"),
    (r"No module named '([\w.]+)'", "needs {0}, not installed"),
    (r"requires ([\w-]+)", "needs {0}, not installed"),
)  # fmt: skip


# mlx-lm: the tests of the installed release's sdist; one hub model, served by a tiny qwen3.

MLX_LM_HUB = ("mlx-community/Qwen1.5-0.5B-Chat-4bit",)  # the hub model mlx-lm 0.32.2's tests load


def _make_tiny_qwen3(folder: Path) -> Path:
    """attnpass's ``save_tiny_lm`` qwen3 (the family nearest the hub model's qwen2) in bfloat16, quantized to 4 bits
    like the hub model by mlx-lm's ``convert``, in ``folder/stand-in`` (made once)."""
    path = folder / "stand-in"
    if not (path / "config.json").is_file():
        from mlx_lm import convert

        from attnpass.models.tiny_lm import save_tiny_lm

        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            tiny = save_tiny_lm(Path(scratch) / "tiny", "qwen3")
            convert(str(tiny), mlx_path=str(Path(scratch) / "quantized"), quantize=True, q_bits=4, q_group_size=64)
            (Path(scratch) / "quantized").rename(path)
    return path


def _serve_mlx_lm(patch: Any, path: Path) -> None:
    """mlx-lm's download seam (``mlx_lm.utils.snapshot_download``, which ``load``, ``convert``, ``load_tokenizer``
    and ``hf_repo_to_path`` call) and ``transformers.AutoTokenizer.from_pretrained`` (the tests call it)."""
    import mlx_lm.utils
    import transformers

    download = mlx_lm.utils.snapshot_download
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def snapshot_download(repo_id: str, *args: Any, **kwargs: Any) -> str:
        return str(path) if repo_id in MLX_LM_HUB else download(repo_id, *args, **kwargs)

    def tokenizer(name: Any, *args: Any, **kwargs: Any) -> Any:
        return from_pretrained(str(path) if name in MLX_LM_HUB else name, *args, **kwargs)

    patch.setattr(mlx_lm.utils, "snapshot_download", snapshot_download)
    patch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(tokenizer))


_QWEN3 = "asserts what only the hub model gives (the stand-in is a tiny qwen3 with a word-level tokenizer)"

MLX_LM = Peer(
    name="mlx-lm",
    version="0.32.2",
    source=Sdist("mlx-lm", "0.32.2"),
    tests=("tests",),
    left_out={},
    deselected={},
    models="mlx_lm.models",
    classes=("Model",),
    submodules=(),
    client="mlx-lm's helper",
    page="docs/peer_suites.md",
    versions=("mlx", "mlx-lm", "transformers", "pytest"),
    stand_in=StandIn(
        MLX_LM_HUB, _make_tiny_qwen3, _serve_mlx_lm, "attnpass's `save_tiny_lm` qwen3, quantized to 4 bits"
    ),
    why={  # mlx-lm 0.32.2's tests whose message does not say it (diagnosed by hand; plain runs, no attnpass)
        **{f"test_losses.TestLosses::test_{n}": "asserts can_run_metal(): needs Metal (MLX's GPU backend)"
           for n in ("kl_div_loss", "js_div_loss", "kl_div_loss_vjp", "js_div_loss_vjp")},
        **{f"test_models.TestModels::test_gated_delta{s}": "gated_delta_kernel is None without Metal: needs Metal"
           for s in ("", "_masked")},
        "test_generate.TestGenerate::test_batch_matches_single": f"{_QWEN3}: its prompts' lengths",
        "test_generate.TestGenerate::test_generate_with_logit_bias": f"{_QWEN3}: its text",
        "test_generate.TestGenerate::test_stream_generate_input_embeddings": f"{_QWEN3}: its text",
        "test_generate.TestGenerate::test_stream_generate_input_embeddings_prefill": f"{_QWEN3}: its text",
        "test_tokenizers.TestTokenizers::test_naive_detokenizer_holds_back_partial_characters": f"{_QWEN3}: its tokens",
        "test_tokenizers.TestTokenizers::test_tokenizers":
            f"{_QWEN3}: its detokenizer class; the other five tokenizers need the network",
        "test_utils.TestUtils::test_load": f"{_QWEN3}: a Qwen2Model",
        "test_server.TestServer::test_handle_models": "lists the models of the hub cache, empty in these runs",
    },
)  # fmt: skip


# mlx-vlm: its releases ship no tests (0.7.10's sdist and wheel, 0.6.15's sdist): the tests of the newest tag of the
# repository this machine can read (a clone given with --git-dir), v0.6.15, against the installed 0.7.10.

_SERVER = "the HTTP server and its request state (FastAPI), with mock models: no language model built"
_PARSER = "a tool-call parser of generated text: no model"
_PICTURES = (
    "an image or video generator (diffusion transformer, VAE, scheduler): no language model, cache or generation"
)
_FILES_OUT = {
    **{f"tests/test_{n}.py": _SERVER for n in ("server", "server_audio", "server_realtime", "responses_state")},
    **{f"tests/test_{n}_tool_parser.py": _PARSER for n in ("atem", "cohere", "gemma4", "pythonic")},
    **{f"tests/test_{n}.py": _PICTURES
       for n in ("flux2", "bonsai", "ideogram4", "mage_flow", "minimax_h3", "video_generation")},
    "tests/test_processors.py": "image/audio processors and their configurations: no model",
    "tests/test_prompt_utils.py": "chat prompts and templates: no model",
    "tests/test_tokenizer_utils.py": "tokenizers and detokenizers: no model",
    "tests/test_audio_utils.py": "audio loading helpers: no model",
    "tests/test_sample_utils.py": "sampling from given logits: no model",
    "tests/test_structured.py": "constrained decoding's logits processors, with fake tokenizers: no model",
    "tests/test_cli.py": "the command line's argument parsing, read from a source checkout: no model",
    "tests/test_smoke.py": "no tests: a script that loads hub models",
    "tests/test_one_bit.py": "1-bit quantized linear layers: no attention",
    "tests/test_trainer.py": "the LoRA trainer, with dummy models",
    "tests/test_trainer_utils.py": "the LoRA trainer's helpers, with dummy models",
    "tests/test_paddleocr_vl_vision.py": "a vision tower only: no language model",
    "tests/test_vision_cache.py": "the vision-feature cache and model source it inspects: no model built",
    "tests/test_nemotron_voicechat_convert.py": "a checkpoint's weight conversion: no model called",
    "tests/test_gemma4_assistant_masks_static.py":
        "loads a source file of a checkout with a fake mlx, no model (and the source is not in the tests' folder)",
}  # fmt: skip
_FILES_IN = (
    "apc", "apc_adapters", "apc_component_adapters", "apc_exact_mode", "apc_observability", "apc_quantized",
    "apc_semantic_key", "apc_storage", "batch_quantized_cache", "cache", "kv_cache_quantization", "quant_sdpa_mask",
    "quant_sdpa_mask_adversarial", "turboquant", "turboquant_rht_value_kernels", "generate", "speculative",
    "laguna_dflash_drafter", "muse_glimmer_dflash_drafter", "diffusion_models", "diffusion_gemma", "models",
    "minimax_m3", "inkling", "nemotron_h_nano_omni", "nemotron_voicechat", "mage_vl_positions", "qwen3_omni_moe",
    "qwen3_5_mtp_sanitize", "qwen3_5_ragged_sdpa_fallback", "rope", "rope_utils", "utils",
)  # fmt: skip

MLX_VLM = Peer(
    name="mlx-vlm",
    version="0.7.10",
    source=GitArchive(
        "https://github.com/Blaizzy/mlx-vlm",
        "v0.6.15",
        "mlx_vlm/tests",
        "mlx_vlm",
        "MLX_VLM_GIT",
        default="/work/.mirror/Blaizzy+mlx-vlm/repo",
    ),
    tests=tuple(f"tests/test_{n}.py" for n in _FILES_IN),
    left_out=_FILES_OUT,
    deselected={
        **{
            f"tests/test_quant_sdpa_mask_adversarial.py::test_left_pad_mask_all_head_and_length_combos[128-512-{h}]": "time: 10 to 70 s each plain on 2 shared cores; calls mlx-vlm's quantized attention function directly, no "
            "model or cache (attnpass is not involved); its 54 shorter cases run"
            for h in ("1-16-8", "2-16-1", "2-16-2", "2-16-8", "2-32-8", "2-8-8", "3-16-8", "4-16-8", "8-16-8")
        },
        "tests/test_models.py::TestModels::test_multi_modality": "time: over 10 minutes plain on 2 shared cores (its full-size vision tower's GELU multiplies by a numpy "
        "scalar, which evaluates each layer in float16 on CPU); the other 348 tests of the file take 45 s",
    },
    models="mlx_vlm.models",
    classes=("Model", "LanguageModel"),
    submodules=("language",),
    client="mlx-vlm's helper",
    page="docs/peer_suites_mlx_vlm.md",
    versions=("mlx", "mlx-vlm", "mlx-lm", "transformers", "pytest"),
    rules=(  # first the test's own limits, then what the version gap's messages say (0.7.10 against 0.6.15's tests)
        (r"\[GatherMM::eval\] Currently only supports float32",
         "MLX's CPU GatherMM is float32-only: the test's float16 mixture of experts needs Metal"),
        (r"Metal kernels are unavailable|Metal-only|requires Metal", "needs Metal (MLX's GPU backend)"),
        (r"set (\w+) to run", "needs a real checkpoint: {0} is not set in these runs"),
        (r"rollback requires uniform (?:per-row )?acceptance",
         "0.7.10's batched speculative rollback refuses the test's uneven acceptance"),
        (r"cannot import name '(\w+)' from '([\w.]+)'", "0.7.10's `{1}` has no `{0}`"),
        (r"module '([\w.]+)' (?:from [^>]*> )?(?:has no|does not have the) attribute '(\w+)'",
         "0.7.10's `{0}` has no `{1}`"),
        (r"type object '(\w+)' has no attribute '(\w+)'", "0.7.10's `{0}` has no `{1}`"),
        (r"'(\w+)' object has no attribute '(\w+)'", "a `{0}` has no `{1}`"),
        (r"([\w.]+)\(\) got an unexpected keyword argument '(\w+)'", "0.7.10's `{0}` takes no `{1}`"),
    ),
    why={  # diagnosed by hand: plain runs, no attnpass
        **{f"test_speculative::test_qwen3_5_ragged_decode_attention_matches_{n}_pass_singleton":
           "the Metal-only ragged decode attention returns None without Metal: needs Metal" for n in ("one", "two")},
        "test_diffusion_models.TestMaskedDiffusionServerLane::test_diffusion_generation_family_block":
            "imports `mlx_vlm.tests`: the tests run from git beside the installed package, which has none (it passes "
            "against 0.6.15's source, which holds them)",
    },
)  # fmt: skip

PEERS: dict[str, Peer] = {peer.name: peer for peer in (MLX_LM, MLX_VLM)}
