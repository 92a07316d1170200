"""MLA calls: what mlx-lm's multi-head latent attention layers hand its helper, proven and routed (docs/mla.md).

mlx-lm's MLA layers (deepseek_v3, deepseek_v32, glm_moe_dsa, glm4_moe_lite, kimi_*, longcat_flash) cache a latent
per token and its rope key in a ``KVCache`` (keys: the latent, values: the rope key); a call of more than one
query row gives the helper ``embed_q(latent, transpose=False)`` as keys, ``unembed_out(latent)`` as values and
the rope scores as an additive mask. The patches of :func:`patches` note, in the active call, what every
``MultiLinear`` and ``QuantizedMultiLinear`` returns and each DSA ``Indexer``'s top-k (per indexer cache). A
call is an MLA call of a cache (:func:`involved`) when its queries or keys are a recorded output or a recorded
projection read the cache's last fetch. :func:`decline` routes it only when it proves that the keys ARE a float
``MultiLinear``'s untransposed output and the values one's transposed output of one input, that input IS the
cache's last fetch, the fetch its buffer's first rows and the write position unchanged (a cache that replaced its
buffer since, as deepseek_v32's ``mx.depends`` does, no longer writes the fetched one, which the program reads),
and the mask an additive float array over those keys, with sinks per head or none. One query row is declined (``mla_absorbed``:
mlx-lm attends in the latent form already), as are quantized projections and keys built otherwise (mistral4
concatenates the rope part).

:func:`route` gives the ``mla_attention`` program the buffer's cut (:func:`~..buffers.buffer_rows`: one signature
per cut) and the mask padded by -inf (padded cells weigh exactly 0). When the layer's indexer returned a top-k
in this call and the mask is, on its values, that selection of itself (every unselected cell at or below
finfo.min, every row a selected cell above it: checked on the arrays, :func:`selection_holds`), the
``dsa_attention`` program gets the indices too, with dsa-gather's promises; otherwise the mask goes as it is.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from attnpass.passes import Decline

from ..buffers import buffer_rows, first_rows, words
from ..calls import Call, Patch, classes, last_fetch, recorder
from ..masks import pad_last
from ..selections import latent_plan, recorded_top_k, selection_holds
from .base import CacheAdapter, HelperCall, Plan, Routed

MLA = "mlx_lm.models.mla"
MLAS = (MLA, "mlx_vlm.models.mla")  # the modules whose MultiLinear and QuantizedMultiLinear the proofs record
DSA = "mlx_lm.models.deepseek_v32"


LINEARS = ("MultiLinear", "QuantizedMultiLinear")
PROJECTIONS = "mla projections"  # the notes of what each MultiLinear returned: id -> (out, layer, input, transpose)
INDEXED = "dsa top-k"  # the notes of each DSA indexer's top-k, by its cache: id -> (cache, top-k or None)


def note_projection(call: Call, out: Any, layer: Any, x: Any, transpose: bool = True) -> None:
    """What a ``MultiLinear`` (or ``QuantizedMultiLinear``) returned, and from what."""
    call.notes(PROJECTIONS)[id(out)] = (out, layer, x, transpose)


def note_selection(call: Call, out: Any, indexer: Any, x: Any, qr: Any, mask: Any, cache: Any = None) -> None:
    """A DSA ``Indexer``'s top-k (None: every key), by its cache."""
    if cache is not None:
        call.notes(INDEXED)[id(cache)] = (cache, out)


def patches() -> list[Patch]:
    """The recorders of the MLA proofs: the projections' outputs (mlx-lm's, and mlx-vlm's once imported) and the
    DSA indexer's top-k."""
    found = [(classes(DSA, "Indexer")[0], "__call__", recorder(note_selection))]
    for module in (m for m in MLAS if m == MLA or m in sys.modules):
        found += [(layer, "__call__", recorder(note_projection)) for layer in classes(module, *LINEARS)]
    return found


def involved(call: HelperCall, cache: Any) -> bool:
    """Whether ``call`` is an MLA call of ``cache``: its queries or keys a recorded projection's output, or a
    recorded projection read ``cache``'s last fetch."""
    found = call.recorded.notes(PROJECTIONS)
    if not found:
        return False
    if id(call.queries) in found or id(call.keys) in found:
        return True
    fetch = last_fetch(cache, call.recorded)
    return fetch is not None and any(p[2] is fetch.keys for p in found.values())


def _projection(recorded: Call, out: Any) -> tuple[Any, Any, Any, bool] | None:
    found = recorded.notes(PROJECTIONS).get(id(out))
    return found if found is not None and found[0] is out else None


def decline(call: HelperCall, cache: Any) -> Decline | None:
    """Why the MLA call ``call`` over the latent ``cache`` cannot take an MLA program (None when it can)."""
    recorded = call.recorded
    if _projection(recorded, call.queries) is not None:
        return Decline(
            "mla_absorbed", f"{call.rows} query row(s): the model attends in the latent form already (the queries are "
            "embed_q's output, keys and values the latent)", data={"rows": call.rows},
        )  # fmt: skip
    keys, values = _projection(recorded, call.keys), _projection(recorded, call.values)
    if keys is None or values is None or keys[3] or not values[3] or keys[2] is not values[2]:
        return Decline(
            "mla_not_projections", "the keys and values are not embed_q(latent, transpose=False) and "
            "unembed_out(latent) of one latent (mistral4 concatenates the rope keys to them)",
        )  # fmt: skip
    linear = {classes(m, "MultiLinear")[0] for m in MLAS if m == MLA or m in sys.modules}
    quantized = [type(p[1]).__name__ for p in (keys, values) if type(p[1]) not in linear]
    if quantized:
        message = f"the keys or values are a {quantized[0]}'s output: only float MultiLinear projections are routed"
        return Decline("mla_quantized", message, data={"projection": quantized[0]})
    fetch = last_fetch(cache, recorded)
    if fetch is None or keys[2] is not fetch.keys:
        return Decline("not_fetched", "the latent the projections read is not the cache's last fetch in this call")
    rows, length = fetch.keys.shape[2], fetch.buffer[0].shape[2]
    if not rows == fetch.position <= length:
        message = f"the latent ({rows} rows) is not the first {fetch.position} rows of the buffer ({length} rows)"
        return Decline("not_prefix", message, data={"rows": rows, "offset": fetch.position, "buffer_rows": length})
    if cache.offset != fetch.position:
        return Decline("cache_changed", "the latent cache's write position changed since its fetch")
    return _operands_decline(call, fetch.position)


def _operands_decline(call: HelperCall, n: int) -> Decline | None:
    """The mask must be an additive float ``[B, H|1, L, n]`` array, and no sinks given."""
    import mlx.core as mx

    mask = call.mask
    floating = mask is not None and not isinstance(mask, str) and mx.issubdtype(mask.dtype, mx.floating)
    heads = call.queries.shape[1]
    sinks = call.sinks is None or (not isinstance(call.sinks, (int, float)) and tuple(call.sinks.shape) == (heads,))
    if not floating or mask.ndim != 4 or mask.shape[2:] != (call.rows, n) or not sinks:
        got = (
            f"sinks {_spelled(call.sinks)}"
            if not sinks
            else f"mask {mask if isinstance(mask, str) else _spelled(mask)}"
        )
        message = f"an MLA call takes an additive float mask over its {n} keys and sinks per head ({heads}) or none; got {got}"
        return Decline("mla_operands", message, data={"keys": n})
    return None


def _spelled(mask: Any) -> str:
    return "None" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"


def route(call: HelperCall, cache: Any, companions: tuple = ()) -> Routed:
    """The program of an MLA call :func:`decline` accepted: ``dsa_attention`` when an indexer cache among
    ``companions`` recorded a top-k the mask is proven to select, else ``mla_attention``."""
    fetch = last_fetch(cache, call.recorded)
    assert fetch is not None  # proven by decline
    n = fetch.position
    length = buffer_rows(n, fetch.buffer[0].shape[2])
    keys, values = _projection(call.recorded, call.keys), _projection(call.recorded, call.values)
    arrays = [call.queries, first_rows(fetch.buffer[0], length), keys[1]["weight"], values[1]["weight"]]
    arrays.append(pad_last(call.mask, length - n) if length > n else call.mask)
    selection = _selection(call, companions, n)
    sinks = [] if call.sinks is None else [call.sinks]
    if selection is None:
        return Routed("mla_attention", (*arrays, call.sinks, call.scale), arrays + sinks)
    arrays.append(words(selection))
    return Routed("dsa_attention", (*arrays, call.sinks, call.scale), arrays + sinks)


def _selection(call: HelperCall, companions: tuple, n: int) -> Any:
    """The top-k an indexer cache among ``companions`` recorded in this call, or one a token indexer returned
    (:data:`~..selections.TOKEN_INDEXERS`), when the mask selects it."""
    for companion in companions:
        held, idx = call.recorded.notes(INDEXED).get(id(companion), (None, None))
        if held is companion and idx is not None and selection_holds(call.mask, idx, n):
            return idx
    return recorded_top_k(call, n)


def plan(call: HelperCall, cache: Any, companions: tuple = ()) -> Decline | Plan:
    """The plan of the MLA call ``call`` over the latent ``cache``: :func:`decline`'s reason, or the
    ``mla_attention`` program over the latent buffer's cut (``dsa_attention`` when :func:`route` proves a top-k)."""
    found = decline(call, cache)
    if found is not None:
        return found
    fetch = last_fetch(cache, call.recorded)
    rows = buffer_rows(fetch.position, fetch.buffer[0].shape[2])
    return Plan("mla_attention", rows, lambda: route(call, cache, companions))


class LatentHolder(CacheAdapter):
    """An adapter whose cache may hold an MLA latent: its MLA calls (:meth:`latent`) go through this module, the
    others to the next adapter class in the method order."""

    def latent(self, call: HelperCall) -> tuple[Any, tuple] | None:
        """``(latent cache, companion caches)`` when ``call`` is an MLA call, else None."""
        return (call.cache, ()) if involved(call, call.cache) else None

    def patches(self) -> list[Patch]:
        return super().patches() + patches()

    def plan(self, call: HelperCall) -> Decline | Plan:
        held = self.latent(call)
        if held is None:
            return super().plan(call)
        gathered = latent_plan(dataclasses.replace(call, cache=held[0]))
        return plan(call, *held) if gathered is None else gathered


__all__ = [
    "INDEXED", "PROJECTIONS", "LatentHolder", "decline", "involved", "note_projection", "note_selection", "patches",
    "plan", "route",
]  # fmt: skip
