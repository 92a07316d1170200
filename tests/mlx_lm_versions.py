"""What differs between the mlx-lm versions the drop-in tests run on (0.31.3, ``make test-mlx-lm-oldest``, through
0.32.x, ``make test``), found by feature, not by version string; import it only from tests that need mlx-lm.

- :func:`batch_generate_ids`: the token ids and log-probabilities of ``batch_generate``, whose ``return_token_ids``
  and ``return_logprobs`` are 0.32's; on 0.31 the same loop over its ``BatchGenerator``.
- :func:`needs_family` / :func:`family_param`: a test of a model family that the installed mlx-lm lacks (0.32 added
  kimi_k3, mistral4, plamo3, ...) skips, naming it.
- :func:`chunked_cache_keeps_its_rows`: whether ``ChunkedKVCache`` keeps the current chunk's keys when it trims its
  front (0.31.3's ``maybe_trim_front`` keeps the last ``chunk_size`` rows of its 256-row buffer instead, so plain
  llama4 attends no key, or fails, past its first call).
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import pytest


def mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


def batch_generate_ids(model: Any, tokenizer: Any, prompts: list[list[int]], **options: Any):
    """``(token_ids, logprobs)`` per prompt of ``mlx_lm.generate.batch_generate(model, tokenizer, prompts,
    **options)``: the sampled tokens' log-probabilities, as its ``return_logprobs`` gives them.

    mlx-lm 0.31's ``batch_generate`` returns texts only: there its ``BatchGenerator`` is driven as
    ``batch_generate`` drives it (0.32's loop: a token kept unless it finished the stream by a stop token)."""
    from mlx_lm.generate import BatchGenerator, batch_generate

    if "return_token_ids" in inspect.signature(batch_generate).parameters:
        out = batch_generate(model, tokenizer, prompts, return_token_ids=True, return_logprobs=True, **options)
        return out.token_ids, out.logprobs
    max_tokens = options.pop("max_tokens", 128)
    max_tokens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], **options)
    uids = generator.insert(prompts, max_tokens)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    logprobs: dict[int, list[float]] = {uid: [] for uid in uids}
    try:
        while responses := generator.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
                    logprobs[r.uid].append(r.logprobs[r.token].item())
    finally:
        generator.close()
    return [tokens[uid] for uid in uids], [logprobs[uid] for uid in uids]


def has_family(family: str) -> bool:
    return importlib.util.find_spec(f"mlx_lm.models.{family}") is not None


def _no_family(family: str) -> str:
    return f"mlx-lm {mlx_lm_version()} has no model family {family} (a newer mlx-lm's)"


def needs_family(*families: str) -> None:
    """Skip the running test unless the installed mlx-lm has every one of ``families``, naming the first missing."""
    for family in families:
        if not has_family(family):
            pytest.skip(_no_family(family))


def family_param(family: str, *values: Any, **kwargs: Any) -> Any:
    """``pytest.param(family, *values)``, skipped where the installed mlx-lm lacks ``family``.

    (Checked at collection: use it only in modules whose tests all need mlx-lm, where it is installed.)"""
    missing = importlib.util.find_spec("mlx_lm") is not None and not has_family(family)
    marks = [pytest.mark.skipif(missing, reason=_no_family(family) if missing else "")]
    return pytest.param(family, *values, marks=marks, **kwargs)


def chunked_cache_keeps_its_rows() -> bool:
    """Whether mlx-lm's ``ChunkedKVCache``, trimmed at its front as llama4 trims it before each call, still returns
    the rows since its chunk started (0.32), not the tail of its zero-filled buffer (0.31.3: none, here)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache

    cache = ChunkedKVCache(8)
    rows = mx.ones((1, 1, 3, 4))
    cache.update_and_fetch(rows, rows)
    cache.maybe_trim_front()
    keys, _ = cache.update_and_fetch(rows[:, :, :1], rows[:, :, :1])
    return keys.shape[2] == cache.offset - cache.start_position == 4
