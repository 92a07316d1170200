"""The numpy target's ``qsa`` helper: the QSA ops written row by row as the semantics read (the oracle).

Out-of-contract runtime values always raise
:class:`~attnpass.lowering.checks.RuntimeCheckError` (a ``ValueError``):
positions outside ``[0, kv_len)`` and block ids outside ``[-1, ceil(kv_len / ratio))``.
Selection sorts by (score descending, block id ascending) with ``np.lexsort``,
so ties go to the lower id by construction.
"""

from __future__ import annotations

import numpy as np

from attnpass.lowering.checks import RuntimeCheckError, check_qsa_operands


def pool(raw_keys: np.ndarray, *, ratio: int) -> np.ndarray:
    """float32 mean of each complete block (the r rows added in order, then divided), cast back."""
    *lead, t, d = raw_keys.shape
    nb = t // ratio
    blocks = raw_keys[..., : nb * ratio, :].reshape(*lead, nb, ratio, d).astype(np.float32)
    acc = blocks[..., 0, :]
    for i in range(1, ratio):
        acc = acc + blocks[..., i, :]
    return (acc / np.float32(ratio)).astype(raw_keys.dtype)


def block_scores(idx_q: np.ndarray, block_keys: np.ndarray) -> np.ndarray:
    """sum_h relu(q_h . k_n) / sqrt(Di), computed in float64 and rounded to float32."""
    dots = np.einsum("bshd,bnd->bshn", idx_q.astype(np.float64), block_keys.astype(np.float64))
    return (np.maximum(dots, 0.0).sum(axis=2) / np.sqrt(idx_q.shape[-1])).astype(np.float32)


def _complete(p: int, ratio: int) -> int:
    return max(0, (int(p) + 1) // ratio)


def select(block_scores: np.ndarray, positions: np.ndarray, *, ratio: int, top_k_blocks: int) -> np.ndarray:
    b, s, nb = block_scores.shape
    out = np.full((b, s, top_k_blocks), -1, dtype=np.int32)
    for i, j in np.ndindex(b, s):
        n = min(_complete(positions[i, j], ratio), nb)
        score = block_scores[i, j, :n].astype(np.float64)
        score[np.isnan(score)] = -np.inf
        order = np.lexsort((np.arange(n), -score))  # last key is primary
        keep = np.sort(order[: min(top_k_blocks, n)])
        out[i, j, : keep.size] = keep
    return out


def mask(selection: np.ndarray, positions: np.ndarray, *, ratio: int, kv_len: int) -> np.ndarray:
    check_qsa_operands("qsa_mask", selection, positions, ratio=ratio, kv_len=kv_len)
    b, s, _k = selection.shape
    out = np.zeros((b, 1, s, kv_len), dtype=bool)
    for i, j in np.ndindex(b, s):
        p, row = int(positions[i, j]), selection[i, j]
        for blk in row[row >= 0]:
            out[i, 0, j, blk * ratio : (blk + 1) * ratio] = True
        out[i, 0, j, _complete(p, ratio) * ratio :] = True  # the tail
        out[i, 0, j, p + 1 :] = False  # causal
    return out


def _slots(op, selection, positions, ratio, width, kv_len) -> tuple[np.ndarray, np.ndarray]:
    check_qsa_operands(op, selection, positions, ratio=ratio, kv_len=kv_len)
    b, s, k = selection.shape
    cells = np.zeros((b, s, width), dtype=np.int32)
    valid = np.zeros((b, s, width), dtype=bool)
    for i, j in np.ndindex(b, s):
        p, row = int(positions[i, j]), selection[i, j]
        n = _complete(p, ratio)
        for slot, blk in enumerate(row):
            if 0 <= blk < n:
                span = np.arange(blk * ratio, (blk + 1) * ratio)
                cells[i, j, slot * ratio : (slot + 1) * ratio] = span
                valid[i, j, slot * ratio : (slot + 1) * ratio] = True
        for t in range(ratio - 1):
            cell = n * ratio + t
            if cell <= p:
                cells[i, j, k * ratio + t] = cell
                valid[i, j, k * ratio + t] = True
    return cells, valid


def cells(selection, positions, *, ratio: int, width: int, kv_len: int) -> np.ndarray:
    return _slots("qsa_cells", selection, positions, ratio, width, kv_len)[0]


def cell_valid(selection, positions, *, ratio: int, width: int, kv_len: int) -> np.ndarray:
    return _slots("qsa_cell_valid", selection, positions, ratio, width, kv_len)[1]


def gather(x: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Row ``b*S + s`` of the result is ``x[b, :, cells[b, s]]``; a cell outside ``[0, T)`` raises."""
    (b, h, t, d), (_b, s, w) = x.shape, cells.shape
    bad = cells[(cells < 0) | (cells >= t)]
    if bad.size:
        raise RuntimeCheckError(f"qsa_gather: cell {int(bad[0])} is outside the cache [0, {t})")
    out = np.empty((b * s, h, w, d), dtype=x.dtype)
    for i, j in np.ndindex(b, s):
        out[i * s + j] = x[i][:, cells[i, j]]
    return out
