"""mlx-lm generation through attnpass: ``optimize(model)``, then ``mlx_lm.generate`` as usual.

Tiny random-initialised models built in code (:func:`attnpass.models.tiny_lm`:
24 query heads over 2 KV heads, head dim 128, 2 layers, bf16), a word-level
tokenizer, 64 greedy tokens: plain, then with the attention routed through
attnpass programs (``with optimize(model):``), for a llama and a qwen3 model,
and speculative decoding with a one-layer llama draft. Prints whether the texts
are identical, how many signatures were traced, the attention calls routed
through attnpass programs or declined to mlx-lm's helper (and why), and the
remarks of each signature. ``--pipeline`` picks the rewrites (default: the
device's; on CPU its decompose-sdpa rewrites the calls of at most 8 query rows,
decode and verify steps, and the 11-row prefill keeps MLX's fused call and is
declined; try ``raise-attention,head-chunk{budget=8},dce``). Either way the
texts are identical: on MLX's CPU decompose-sdpa runs the fused call's own ops
(log-probabilities bit for bit in every dtype), head-chunk the fused call per
chunk of heads; a text that parted would print as DIFFERENT. On CPU, ``optimize``
keeps mlx-lm's helper for calls over fewer cache rows than its measured bound
(``MIN_KEYS``: 192 in float32, 128 in bfloat16), where the helper is faster:
these tiny contexts are all shorter, so by default nothing is routed and
``explain()`` says why; ``--min-keys 0`` routes every call.

    python examples/mlx_lm_optimize.py [--tokens 64] [--dtype bfloat16] [--pipeline TEXT] [--min-keys 0]
"""

from __future__ import annotations

import argparse

import mlx_lm

from attnpass.backends.mlx import optimize
from attnpass.models import tiny_lm, tiny_tokenizer

PROMPT = "t3 t17 t99 t250 t7 t8 t9 t10 t44 t1 t2 t3"


def compare(
    name: str, model, tokenizer, tokens: int, pipeline: str | None, min_keys: int | None, **generate_kwargs
) -> bool:
    """Generate plain and optimized; print both texts' agreement, the trace count and the remarks."""
    plain = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=tokens, **generate_kwargs)
    with optimize(model, pipeline, min_keys=min_keys) as opt:
        optimized = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=tokens, **generate_kwargs)
    same = plain == optimized
    print(f"== {name}: {len(plain.split())} tokens, {'identical' if same else 'DIFFERENT'} with optimize; "
          f"{opt.traces} trace(s), {opt.routed} attention call(s) routed")  # fmt: skip
    print(f"   {plain[:100]}...")
    opt.explain()
    return same


def main(tokens: int = 64, dtype: str = "bfloat16", pipeline: str | None = None, min_keys: int | None = None) -> bool:
    tokenizer = tiny_tokenizer()
    same = True
    for family in ("llama", "qwen3"):
        same &= compare(family, tiny_lm(family, dtype=dtype), tokenizer, tokens, pipeline, min_keys)
    model, draft = tiny_lm("llama", dtype=dtype), tiny_lm("llama", dtype=dtype, layers=1, seed=1)
    same &= compare("llama + draft (speculative)", model, tokenizer, tokens, pipeline, min_keys, draft_model=draft)
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--pipeline", default=None, help="attnpass pipeline text (default: the device's)")
    parser.add_argument("--min-keys", type=int, default=None, help="optimize's min_keys (default: the device's)")
    args = parser.parse_args()
    raise SystemExit(0 if main(args.tokens, args.dtype, args.pipeline, args.min_keys) else 1)
