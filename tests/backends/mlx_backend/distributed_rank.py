"""One rank of the 2-rank ``mx.distributed`` run of tests/backends/mlx_backend/test_distributed.py (started by mlx.launch).

``python distributed_rank.py MODEL_DIR CASE...``: each case builds a tensor-parallel sharded tiny model
on this rank, decodes greedily plainly, then under ``optimize(model, min_keys=0)``, and prints one JSON line:
``{"rank", "size", "case", "plain", "optimized", "routed", "declined", "traces", "caches"}`` (the token lists,
the counts of the optimized run, the classes of its caches after it). Cases (:data:`CASES`):

- ``llama-sharded-load``: mlx-lm's ``sharded_load`` of the saved tiny llama in MODEL_DIR (``model.shard``);
- ``qwen3-shard``: a tiny qwen3 built in code, ``model.shard(group)``;
- ``llama-kv-bits-8``: the sharded llama decoding over a ``QuantizedKVCache`` (``kv_bits=8`` from token 0);
- ``qwen4-exp-qsa``: mlx-vlm's tiny Qwen4-Exp, which has no ``shard()``: its QSA layers' attention heads
  sharded by hand as mlx-lm shards llama's (q/k/v all-to-sharded, o sharded-to-all; the QSA indexer, the
  Gated-DeltaNet layers and the experts replicated), decoded with its own caches past the indexer's budget.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

PROMPT, TOKENS = "t1 t2 t3 t4 t5 t6 t7", 12


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    model_dir, cases = sys.argv[1], sys.argv[2:]
    for case in cases:
        plain, optimized, opt, caches = CASES[case](group, model_dir)
        line = {"rank": group.rank(), "size": group.size(), "case": case, "plain": plain, "optimized": optimized}
        line |= {"routed": opt.routed, "declined": dict(opt.declined), "traces": opt.traces, "caches": caches}
        print(json.dumps(line), flush=True)


def _decode_lm(model: Any, tokenizer: Any, **options: Any) -> tuple[list[int], list[int], Any, list[str]]:
    """Greedy tokens of mlx-lm's ``stream_generate``, plain then optimized (restored after), and the classes of
    the optimized run's caches."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from attnpass.backends.mlx import optimize

    def tokens(cache: list) -> list[int]:
        run = mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS, prompt_cache=cache, **options)
        return [r.token for r in run]

    plain, cache = tokens(make_prompt_cache(model)), make_prompt_cache(model)
    with optimize(model, min_keys=0) as opt:
        return plain, tokens(cache), opt, [type(c).__name__ for c in cache]


def llama_sharded_load(group: Any, model_dir: str) -> tuple:
    from mlx_lm.utils import sharded_load

    model, tokenizer = sharded_load(model_dir, tensor_group=group)
    return _decode_lm(model, tokenizer)


def qwen3_shard(group: Any, model_dir: str) -> tuple:
    from attnpass.models import tiny_lm, tiny_tokenizer

    model = tiny_lm("qwen3", dtype="float32")
    model.shard(group)
    mx.eval(model.parameters())
    return _decode_lm(model, tiny_tokenizer())


def llama_kv_bits_8(group: Any, model_dir: str) -> tuple:
    from mlx_lm.utils import sharded_load

    model, tokenizer = sharded_load(model_dir, tensor_group=group)
    return _decode_lm(model, tokenizer, kv_bits=8, quantized_kv_start=0)


def qwen4_exp_qsa(group: Any, model_dir: str) -> tuple:
    from mlx.nn.layers.distributed import shard_linear

    from attnpass.backends.mlx import optimize
    from attnpass.models.tiny_vlm import tiny_vlm

    lm = tiny_vlm("qwen4_exp").language_model
    n = group.size()
    for layer in lm.model.layers:
        if not layer.is_linear:  # a QSA layer
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            attn.num_attention_heads //= n
            attn.num_key_value_heads //= n
    mx.eval(lm.parameters())
    prompt = mx.array([[(5 * i) % 200 + 1 for i in range(40)]], dtype=mx.int32)  # 40 tokens: sparse selections

    def tokens(cache: list) -> list[int]:
        found = []
        token = int(mx.argmax(lm(prompt, cache=cache).logits[0, -1]).item())
        for _ in range(TOKENS):
            found.append(token)
            token = int(mx.argmax(lm(mx.array([[token]], dtype=mx.int32), cache=cache).logits[0, -1]).item())
        return found

    plain, cache = tokens(lm.make_cache()), lm.make_cache()
    with optimize(lm, min_keys=0) as opt:
        return plain, tokens(cache), opt, [type(c).__name__ for c in cache]


CASES: dict[str, Callable[[Any, str], tuple]] = {
    "llama-sharded-load": llama_sharded_load,
    "qwen3-shard": qwen3_shard,
    "llama-kv-bits-8": llama_kv_bits_8,
    "qwen4-exp-qsa": qwen4_exp_qsa,
}

if __name__ == "__main__":
    main()
