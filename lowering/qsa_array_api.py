"""The QSA runtime written once over a numpy-named array library ``xp`` (``mlx.core``, ``jax.numpy``).

A target binds ``xp`` and adds what differs, its exact top-k, its scatter and
how it reads values on the host for a check: ``qsa = QSAOps(jnp, top_k=...,
put=..., check=...)`` in its runtime module is the ``qsa`` helper its
generated code calls. Out-of-range block ids and positions
beyond the cache are dropped (never read out of bounds), unless runtime
checks are on (:mod:`attnpass.lowering.checks`): then ``mask``, ``cells`` and
``cell_valid`` raise as the numpy reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .checks import env_checks

TopK = Callable[[Any, int], Any]  # top_k(scores, k): ids of the k largest along the last axis, ties to the lower id
Put = Callable[[Any, Any, Any], Any]  # put(array, indices, values) along the last axis, on a copy
# check(op, selection, positions, ratio, kv_len): check_qsa_operands on this target's arrays
Check = Callable[[str, Any, Any, int, int], None]


@dataclass(frozen=True)
class QSAOps:
    """The QSA ops (``pool`` ... ``cell_valid``, named like the ops without ``qsa_``) over ``xp``.

    ``top_k`` must be exact: -0.0 equal to +0.0, NaN ranked with -inf, ties to the lower block id.
    ``checks``: True checks every call; None checks when ``ATTNPASS_RUNTIME_CHECKS`` is on at the call.
    """

    xp: Any
    top_k: TopK
    put: Put
    check: Check
    checks: bool | None = None
    # row_major(x): x as a row-major array, for a matmul operand that is a small transposed view (MLX 0.32's
    # CPU matmul reads such a view ~1.4x slower; same bits). Identity where the compiler chooses layouts (XLA).
    row_major: Callable[[Any], Any] = lambda x: x  # noqa: E731
    # gather through a flat [B*H*T, D] view: one take of rows at cells plus (b*H + h)*T (MLX: its take_along_axis
    # over the 5-D view is 3-6x slower on CPU); else one take_along_axis keeping streams and heads array axes
    # (XLA partitions it along them on a mesh)
    flat_gather: bool = False

    def _check(self, op: str, selection: Any, positions: Any, ratio: int, kv_len: int) -> None:
        if self.checks or (self.checks is None and env_checks()):
            self.check(op, selection, positions, ratio, kv_len)

    def pool(self, raw_keys: Any, *, ratio: int) -> Any:
        """float32 mean of each complete block (the r rows added in order, then divided), cast back."""
        xp = self.xp
        *lead, t, d = raw_keys.shape
        nb = t // ratio
        blocks = xp.reshape(raw_keys[..., : nb * ratio, :], (*lead, nb, ratio, d)).astype(xp.float32)
        acc = blocks[..., 0, :]
        for i in range(1, ratio):
            acc = acc + blocks[..., i, :]
        return (acc / ratio).astype(raw_keys.dtype)

    def block_scores(self, idx_q: Any, block_keys: Any) -> Any:
        """f32 sum over heads of relu(q_h . key_b) / sqrt(Di), one matmul with the heads folded into rows.

        Written ``keys @ q^T`` (then transposed, ``[NB, S*H]`` is small): the keys are read in their own
        row-major layout, where ``q @ keys^T`` made XLA transpose the whole key matrix first (4x slower).
        """
        xp = self.xp
        b, s, h, d = idx_q.shape
        q = xp.reshape(idx_q.astype(xp.float32), (b, s * h, d))
        dots = xp.swapaxes(xp.matmul(block_keys.astype(xp.float32), self.row_major(xp.swapaxes(q, -1, -2))), -1, -2)
        return xp.sum(xp.maximum(xp.reshape(dots, (b, s, h, -1)), 0.0), axis=2) / math.sqrt(d)

    def select(self, block_scores: Any, positions: Any, *, ratio: int, top_k_blocks: int) -> Any:
        """The top-k complete blocks, ids ascending, invisible picks and padding -1."""
        xp = self.xp
        nb = block_scores.shape[-1]
        n_complete = ((positions + 1) // ratio)[..., None]
        score = xp.where(xp.arange(nb, dtype=xp.int32) < n_complete, block_scores, -math.inf)  # invisible: last
        chosen = xp.sort(self.top_k(score, min(top_k_blocks, nb)).astype(xp.int32), axis=-1)
        chosen = xp.where(chosen < n_complete, chosen, -1)
        b, s, k = chosen.shape
        if k < top_k_blocks:
            chosen = xp.concatenate([chosen, xp.full((b, s, top_k_blocks - k), -1, dtype=xp.int32)], axis=-1)
        return chosen

    def mask(self, selection: Any, positions: Any, *, ratio: int, kv_len: int) -> Any:
        """bool [B, 1, S, kv_len]: (cells of the selected blocks | tail) & causal."""
        self._check("qsa_mask", selection, positions, ratio, kv_len)
        xp = self.xp
        b, s, _k = selection.shape
        n_blocks = -(-kv_len // ratio)
        in_range = (selection >= 0) & (selection < n_blocks)
        ids = xp.where(in_range, selection, n_blocks)  # unused ids land in a spare slot
        picked = self.put(xp.zeros((b, s, n_blocks + 1), dtype=xp.bool_), ids, xp.array(True))
        cells = xp.arange(kv_len, dtype=xp.int32)
        p = positions[..., None]
        tail = cells >= ((p + 1) // ratio) * ratio
        return ((xp.take(picked, cells // ratio, axis=-1) | tail) & (cells <= p))[:, None]

    def cells(self, selection: Any, positions: Any, *, ratio: int, width: int, kv_len: int) -> Any:
        self._check("qsa_cells", selection, positions, ratio, kv_len)
        return self._slots(selection, positions, ratio, width, kv_len)[0]

    def cell_valid(self, selection: Any, positions: Any, *, ratio: int, width: int, kv_len: int) -> Any:
        self._check("qsa_cell_valid", selection, positions, ratio, kv_len)
        return self._slots(selection, positions, ratio, width, kv_len)[1]

    def gather(self, x: Any, cells: Any) -> Any:
        """``x [B, H, T, D]`` at ``cells [B, S, W]`` -> ``[B*S, H, W, D]``, every stream, row and head at once."""
        xp = self.xp
        (b, h, t, d), (_b, s, w) = x.shape, cells.shape
        if self.flat_gather and b * h * t < 2**31:  # the row index is int32
            planes = xp.reshape(xp.arange(b * h, dtype=xp.int32) * t, (b, 1, h, 1))
            rows = xp.take(xp.reshape(x, (b * h * t, d)), xp.reshape(cells, (b, s, 1, w)) + planes, axis=0)
        else:
            rows = xp.take_along_axis(xp.reshape(x, (b, 1, h, t, d)), xp.reshape(cells, (b, s, 1, w, 1)), axis=3)
        return xp.reshape(rows, (b * s, h, w, d))

    def _slots(self, selection: Any, positions: Any, ratio: int, width: int, kv_len: int) -> tuple[Any, Any]:
        """``(cells, valid)`` of width W: the selected blocks' cells, then r-1 tail slots, then padding."""
        xp = self.xp
        b, s, k = selection.shape
        p = positions[..., None]
        n_complete = (p + 1) // ratio
        blk = selection[..., None]
        block_cells = xp.reshape(blk * ratio + xp.arange(ratio, dtype=xp.int32), (b, s, k * ratio))
        block_ok = xp.reshape(
            xp.broadcast_to((blk >= 0) & (blk < n_complete[..., None]), (b, s, k, ratio)), (b, s, k * ratio)
        )
        tail_cells = n_complete * ratio + xp.arange(ratio - 1, dtype=xp.int32)
        parts = [(block_cells, block_ok), (tail_cells, tail_cells <= p)]
        pad = width - k * ratio - (ratio - 1)
        if pad:
            parts.append((xp.zeros((b, s, pad), dtype=xp.int32), xp.zeros((b, s, pad), dtype=xp.bool_)))
        cells = xp.concatenate([c for c, _ in parts], axis=-1)
        ok = xp.concatenate([o for _, o in parts], axis=-1) & (cells >= 0) & (cells < kv_len)
        return xp.where(ok, cells, 0), ok
