"""Qwen3.8-Flash-Next attention graphs: one speculative-verify step, and a whole-model step.

The model is GQA with 24 query heads over 2 KV heads, head dim 256, bf16,
softmax scale 1/16; 48 layers, of which every 4th (``l % 4 == 3``) is a QSA
layer (:mod:`attnpass.models.qsa_layer`). :func:`build_model` keeps only the
attention of each layer: the hidden state ``hidden`` [1, 24, S, 256] stands
in for every layer's queries, dense layers are a bottom-right causal ``sdpa``
over their own KV cache, QSA layers the masked-form QSA attention, and each
layer adds its output to the hidden state (the residual).
"""

from __future__ import annotations

import inspect

from attnpass.ir import Graph, Tensor, TensorSpec, ops, trace

from .qsa_layer import QSAConfig, layer_specs, qsa_attention

N_Q_HEADS, N_KV_HEADS, HEAD_DIM, SCALE = 24, 2, 256, 1 / 16
N_LAYERS = 48
QSA_EVERY = 4
MODEL_QSA = QSAConfig(dtype="bfloat16")
SHARED_QSA_INPUTS = ("rope_cos", "rope_sin", "positions", "mask")  # one copy for all QSA layers
LAYER_QSA_INPUTS = ("idx_q", "idx_keys", "idx_q_norm", "idx_k_norm")  # one per QSA layer


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
    """One verify step: q [1, 24, S, 256] over the cache [1, 2, T, 256], bool mask [1, 1, S, T]."""
    return ops.sdpa(q, k_cache, v_cache, scale=SCALE, mask=mask)


def verify_specs(q_len: int, kv_len: int) -> list[TensorSpec]:
    """The inputs of :func:`attention`: bf16 q/K/V (K/V resident) and a bool mask."""
    return [
        TensorSpec((1, N_Q_HEADS, q_len, HEAD_DIM), "bfloat16"),
        TensorSpec((1, N_KV_HEADS, kv_len, HEAD_DIM), "bfloat16", role="resident"),
        TensorSpec((1, N_KV_HEADS, kv_len, HEAD_DIM), "bfloat16", role="resident"),
        TensorSpec((1, 1, q_len, kv_len), "bool"),
    ]


def verify_step(q_len: int = 4, kv_len: int = 4096) -> Graph:
    """The traced verify-step attention (graph ``attention``)."""
    return trace(attention, *verify_specs(q_len, kv_len))


def is_qsa_layer(layer: int) -> bool:
    return layer % QSA_EVERY == QSA_EVERY - 1


def model_specs(n_layers: int, q_len: int, n_kv: int, cfg: QSAConfig = MODEL_QSA) -> dict[str, TensorSpec]:
    """The model step's inputs in signature order: shared ones first, then each layer's ``*_<l>``."""
    qsa = layer_specs(cfg, n_kv, rows=q_len)
    specs = {"hidden": qsa["q"]}
    specs.update({name: qsa[name] for name in SHARED_QSA_INPUTS})
    for layer in range(n_layers):
        specs[f"k_cache_{layer}"] = qsa["k_cache"]
        specs[f"v_cache_{layer}"] = qsa["v_cache"]
        if is_qsa_layer(layer):
            specs.update({f"{name}_{layer}": qsa[name] for name in LAYER_QSA_INPUTS})
    return specs


def build_model(n_layers: int = N_LAYERS, *, q_len: int = 4, n_kv: int = 8192, cfg: QSAConfig = MODEL_QSA) -> Graph:
    """Trace the attention of ``n_layers`` layers (graph ``qwen38_step``); see the module docstring."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    specs = model_specs(n_layers, q_len, n_kv, cfg)

    def qwen38_step(*tensors: Tensor) -> Tensor:
        x = dict(zip(specs, tensors))
        hidden = x["hidden"]
        for layer in range(n_layers):
            kv = {"k_cache": x[f"k_cache_{layer}"], "v_cache": x[f"v_cache_{layer}"]}
            if is_qsa_layer(layer):
                own = {name: x[f"{name}_{layer}"] for name in LAYER_QSA_INPUTS}
                shared = {name: x[name] for name in SHARED_QSA_INPUTS}
                out = qsa_attention(cfg, {"q": hidden, **kv, **own, **shared})
            else:
                out = ops.sdpa(hidden, kv["k_cache"], kv["v_cache"], scale=cfg.scale, causal="bottom_right")
            hidden = hidden + out
        return hidden

    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in specs]
    qwen38_step.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  (trace names inputs from it)
    return trace(qwen38_step, *specs.values())


__all__ = [
    "N_LAYERS", "attention", "build_model", "is_qsa_layer", "model_specs", "verify_specs", "verify_step",
]  # fmt: skip
