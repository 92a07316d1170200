"""Attention as real model code writes it, for the raise and canonicalize tests (not a test module).

:func:`llama_attention` is shaped like mlx-lm's llama ``Attention`` called without
a KV cache (prefill), written with ``mlx.core``/``mlx.nn`` only: Q and K go
through an optional RMSNorm (qwen3's ``q_norm``/``k_norm``) and RoPE, V is a plain
transpose of its projection, and the attention is ``mx.fast.scaled_dot_product_attention``
(decomposed by MLX on CPU).
"""

from __future__ import annotations

from typing import Any, Callable


def llama_attention(
    dtype: Any,
    *,
    qk_norm: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 32,
    length: int = 7,
    mask: Any = "causal",
    sinks: bool = False,
) -> tuple[Callable, Any]:
    """``(attention(x), x)``: a random-initialised layer in ``dtype`` and an input ``[1, length, dim]``."""
    import mlx.core as mx
    import mlx.nn as nn

    head_dim = dim // heads

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = head_dim**-0.5
            self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
            self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
            if qk_norm:
                self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
                self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)
            if sinks:
                self.sinks = mx.random.normal((heads,))
            self.rope = nn.RoPE(head_dim, traditional=False, base=10000)

        def __call__(self, x: mx.array) -> mx.array:
            b, n, _ = x.shape
            queries = self.q_proj(x).reshape(b, n, heads, -1)
            keys = self.k_proj(x).reshape(b, n, kv_heads, -1)
            values = self.v_proj(x).reshape(b, n, kv_heads, -1).transpose(0, 2, 1, 3)
            if qk_norm:
                queries, keys = self.q_norm(queries), self.k_norm(keys)
            queries = self.rope(queries.transpose(0, 2, 1, 3))
            keys = self.rope(keys.transpose(0, 2, 1, 3))
            extra = {"sinks": self.sinks} if sinks else {}
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask, **extra)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    mx.random.seed(0)
    module = Attention()
    module.set_dtype(dtype)
    mx.eval(module.parameters())
    x = mx.random.normal((1, length, dim)).astype(dtype)

    def attention(x: mx.array) -> mx.array:
        return module(x)

    return attention, x
