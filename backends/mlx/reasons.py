"""The router's reason codes: why a call of an optimized model runs the client's own function, one table.

The passes' codes are :data:`attnpass.passes.REASONS`; these are the router's (its adapters, its bounds and its
programs' decisions), which a :class:`~attnpass.passes.Decline` of ``optimize`` gives and
:attr:`~.optimized.OptimizedModel.declined` counts. tests/passes/infra/test_remark_reasons.py checks both tables:
every code given is in one of them, every code of each is given.
"""

from __future__ import annotations

ROUTER_REASONS: dict[str, str] = {
    "unknown_cache": "the call's cache class has no cache adapter",
    "cache_unrouted": "the cache kind's adapter routes no call of this client function (its row says why)",
    "string_mask": "a string mask other than MLX's 'causal'",
    "mask_keys_mismatch": "the mask covers another number of keys than the call attends",
    "not_fetched": "keys/values are not the arrays the cache's update_and_fetch returned in this model call",
    "cache_changed": "the cache's buffer or position changed between its fetch and the attention call",
    "not_prefix": "the fetched keys are not the cache buffer's valid prefix",
    "quantized_sinks": "attention sinks on a quantized cache (mlx-lm's quantized helper refuses them)",
    "no_array_mask": "a batched cache's call without an array mask (the streams' padding is only in the mask)",
    "short_context": "fewer key rows than the bound routes: the client's function is faster there",
    "quantized_tie": "a half-float quantized call on CPU, where the program only ties the client's function",
    "fallback_ops": "a program that would be only MLX's CPU fallback's own ops, over a buffer cut: the client's is faster",
    "no_program": "the signature has no compiled program: its import, pipeline or lowering failed",
    "model_mask": "the model combined a mask with the QSA selection",
    "model_kernel": "the model's own sparse kernel takes this call",
    "not_selected": "the selection is not the indexer's output for this cache in this model call",
    "no_gather_pass": "the pipeline has no gather pass: the masked form it would keep is the client's own",
    "mla_absorbed": "an MLA call the model already attends in the latent form (its queries embedded, keys and values the latent)",
    "mla_not_projections": "an MLA call whose keys/values are not the up-projections of one latent",
    "mla_quantized": "an MLA call whose up-projections are quantized (QuantizedMultiLinear)",
    "mla_operands": "an MLA call whose mask is not an additive float array over its keys, or with sinks",
    "no_absorb_pass": "the pipeline has no mla-absorb: the expansion it would keep is the client's own",
    "no_client": "optimize: no module of the model calls a registered client function",
}

__all__ = ["ROUTER_REASONS"]
