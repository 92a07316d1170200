"""The client functions ``optimize`` replaces: one registered :class:`Client` each, as targets and passes are.

A client is a library function that model modules import and call for their attention: mlx-lm's
``scaled_dot_product_attention`` (:data:`MLX_LM_HELPER`), mlx-vlm's own helper of the same name and arguments
(:data:`MLX_VLM_HELPER`), and mlx-vlm Qwen4-Exp's ``dispatch_qsa_attention`` (:data:`QSA_DISPATCH`). Its record
says where models import it from, how a call's arguments become the record the cache adapters read (a
:class:`HelperCall` or a :class:`QSACall`), and its name, which each adapter lists among the clients it serves.
``optimize`` finds the client each module of a model calls (:func:`client_of`) and replaces it there with the
client's trampoline (:meth:`Client.trampoline`), which sends the call of an active optimized model to it and every
other call (of models not optimized) to the original.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .calls import ACTIVE, Call
from .masks import Masks


@dataclass
class HelperCall:
    """One call of an attention helper (mlx-lm's or mlx-vlm's), with the active model call's records."""

    queries: Any
    keys: Any
    values: Any
    cache: Any
    scale: float
    mask: Any
    sinks: Any
    recorded: Call
    masks: Masks

    @property
    def rows(self) -> int:
        """The query rows."""
        return self.queries.shape[2]


@dataclass
class QSACall:
    """One call of mlx-vlm Qwen4-Exp's ``dispatch_qsa_attention``, with the active model call's records."""

    queries: Any
    keys: Any
    values: Any
    blocks: Any
    query_ends: Any
    options: dict[str, Any]
    recorded: Call

    @property
    def cache(self) -> Any:
        return self.options["cache"]


def helper_call(
    recorded: Call, masks: Masks, queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
    sinks: Any = None,
) -> HelperCall:  # fmt: skip
    """The record of a helper call, its arguments bound as the helper binds them."""
    return HelperCall(queries, keys, values, cache, scale, mask, sinks, recorded, masks)


def qsa_call(
    recorded: Call, masks: Masks, queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, **options: Any
) -> QSACall:  # fmt: skip
    """The record of a QSA dispatch call."""
    return QSACall(queries, keys, values, blocks, query_ends, options, recorded)


@dataclass(frozen=True)
class Client:
    """A client function: ``module``.``attribute`` (where models import it from), the ``call`` record its
    arguments make (``call(recorded, masks, *args, **kwargs)``), and its ``name``, which adapters list."""

    name: str
    module: str
    attribute: str
    call: Callable[..., HelperCall | QSACall]

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"

    def function(self) -> Callable[..., Any]:
        """The client's own function (its module imported on first use)."""
        return _original(self)

    def trampoline(self) -> Callable[..., Any]:
        """What replaces the client in a model's module: the active optimized model's route, else the original."""
        return _trampoline(self)

    def called_by(self, module: Any) -> bool:
        """Whether ``module``'s own name ``attribute`` is this client (or its trampoline)."""
        found = getattr(module, self.attribute, None)
        return found is not None and (found is self.trampoline() or found is self.function())


@functools.cache
def _original(client: Client) -> Callable[..., Any]:
    return getattr(importlib.import_module(client.module), client.attribute)


@functools.cache
def _trampoline(client: Client) -> Callable[..., Any]:
    original = client.function()

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        call = ACTIVE.get()
        if call is None:
            return original(*args, **kwargs)
        return call.model.attend(client, *args, **kwargs)

    return routed


CLIENTS: dict[str, Client] = {}


def register(client: Client) -> Client:
    """Register ``client`` (one per name)."""
    if client.name in CLIENTS:
        raise ValueError(f"client {client.name!r} is already registered: {CLIENTS[client.name]}")
    CLIENTS[client.name] = client
    return client


MLX_LM_HELPER = register(Client("mlx-lm", "mlx_lm.models.base", "scaled_dot_product_attention", helper_call))
MLX_VLM_HELPER = register(Client("mlx-vlm", "mlx_vlm.models.base", "scaled_dot_product_attention", helper_call))
QSA_DISPATCH = register(
    Client("qwen4-exp-qsa", "mlx_vlm.models.qwen4_exp.qsa_kernel", "dispatch_qsa_attention", qsa_call)
)
HELPERS = frozenset({MLX_LM_HELPER.name, MLX_VLM_HELPER.name})  # clients taking a HelperCall


def client_of(module: Any) -> Client | None:
    """The registered client ``module`` calls, if any (a client whose library is not imported is never called)."""
    import sys

    for client in CLIENTS.values():
        if client.module in sys.modules and client.called_by(module):
            return client
    return None


__all__ = [
    "CLIENTS", "HELPERS", "MLX_LM_HELPER", "MLX_VLM_HELPER", "QSA_DISPATCH", "Client", "HelperCall", "QSACall",
    "client_of", "helper_call", "qsa_call", "register",
]  # fmt: skip
