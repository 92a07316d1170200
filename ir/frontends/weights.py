"""Imported weights on disk: a safetensors file beside the graph JSON (no pickle).

A graph keeps, on each input an importer made from a captured array, that
array's ``path`` (``model.layers.0.self_attn.q_proj.weight``); the JSON holds
the graph only. The values go to a safetensors file whose keys are those
paths, so it reads like a checkpoint: ``g.json`` pairs with ``g.safetensors``
(:func:`weights_file`). Loading checks every weight input against the file:
present, same dtype, same shape.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path
from typing import Mapping

import numpy as np

from attnpass.ir.core.graph import Graph
from attnpass.ir.core.types import AttnpassError

FORMAT = "attnpass.weights"


class WeightsError(AttnpassError):
    """A weights file is missing, unreadable or does not match the graph's weight inputs."""


def weights_file(graph_file: str | Path) -> Path:
    """The weights file beside a graph file: ``g.json`` -> ``g.safetensors``."""
    return Path(graph_file).with_suffix(".safetensors")


def weight_inputs(graph: Graph) -> dict[str, str]:
    """Input name -> path of each resident input that holds an imported array (its values travel beside the graph)."""
    return {
        name: graph.node(name).attrs["path"]
        for name in graph.inputs
        if graph.input_role(name) == "resident" and graph.node(name).attrs["path"] is not None
    }


def save_weights(graph: Graph, params: Mapping[str, np.ndarray], file: str | Path) -> Path:
    """Write the values of ``graph``'s weight inputs (``params`` by input name) to ``file``, keyed by path."""
    from safetensors.numpy import save_file

    inputs = weight_inputs(graph)
    missing = sorted(set(inputs) - set(params))
    if missing:
        raise WeightsError(f"graph {graph.name}: no values for weight input(s) {', '.join(missing)}")
    shared = sorted(path for path, count in Counter(inputs.values()).items() if count > 1)
    if shared:
        raise WeightsError(f"graph {graph.name}: several weight inputs have the path {', '.join(shared)}")
    tensors = {}
    for name, path in inputs.items():
        _check(graph, name, path, params[name])
        tensors[path] = np.ascontiguousarray(params[name])
    with open(file, "wb"):  # an ordinary open: the mode the umask gives, as the JSON beside it has
        pass
    mode = stat.S_IMODE(os.stat(file).st_mode)
    save_file(tensors, str(file), metadata={"format": FORMAT, "graph": graph.name})
    os.chmod(file, mode)  # save_file replaces the file with one of mode 0600
    return Path(file)


def load_weights(graph: Graph, file: str | Path) -> dict[str, np.ndarray]:
    """The values of ``graph``'s weight inputs from ``file``, by input name; checks keys, dtypes and shapes."""
    from safetensors import SafetensorError, safe_open

    inputs = weight_inputs(graph)
    try:
        with safe_open(str(file), "numpy") as f:
            stored = set(f.keys())
            missing = [path for path in inputs.values() if path not in stored]
            if missing:
                raise WeightsError(f"{file}: no tensor for weight(s) {', '.join(missing[:4])} of graph {graph.name}")
            values = {name: f.get_tensor(path) for name, path in inputs.items()}
    except SafetensorError as exc:
        with open(file, "rb") as f:
            json = f.read(64).lstrip().startswith(b"{")  # safetensors starts with its header's length
        what = "JSON text, not safetensors (a graph file?)" if json else "not a safetensors file"
        raise WeightsError(
            f"{file}: {what} ({exc}); expected the weights: the .safetensors file ImportedGraph.save writes "
            "beside the graph JSON"
        ) from None
    except OSError as exc:
        raise WeightsError(f"{file}: cannot read weights: {exc}") from None
    for name, path in inputs.items():
        _check(graph, name, path, values[name], str(file))
    return values


def _check(graph: Graph, name: str, path: str, value: np.ndarray, where: str | None = None) -> None:
    expected = graph.node(name).type
    if value.shape != expected.shape or value.dtype != expected.dtype.numpy:
        source = f"{where}: " if where else ""
        raise WeightsError(
            f"{source}weight {path} is {value.dtype}{list(value.shape)}, "
            f"but graph {graph.name} input {name} is {expected}"
        )


def require_weights_file(graph: Graph, graph_file: str | Path, file: str | Path | None) -> Path | None:
    """The weights file for ``graph`` read from ``graph_file``: ``file``, else the one beside it, else None.

    Raises when the graph has weight inputs and no file holds them: the JSON alone never runs.
    """
    inputs = weight_inputs(graph)
    candidate = Path(file) if file is not None else weights_file(graph_file)
    if candidate.is_file():
        return candidate
    if file is not None:
        raise WeightsError(f"weights file {file} does not exist")
    if inputs:
        shown = ", ".join(list(inputs.values())[:3]) + (", ..." if len(inputs) > 3 else "")
        raise WeightsError(
            f"{graph_file}: graph {graph.name} has {len(inputs)} imported weight input(s) ({shown}) and no weights "
            f"file beside it ({candidate}): the JSON holds the graph only; ImportedGraph.save writes both"
        )
    return None


__all__ = [
    "FORMAT", "WeightsError", "load_weights", "require_weights_file", "save_weights", "weight_inputs", "weights_file",
]  # fmt: skip
