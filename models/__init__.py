"""Example models the library ships: Qwen3.8-Flash-Next's verify step, QSA decode layer and whole model as graphs;
tiny random mlx-lm models (:mod:`.tiny_lm`).

Each is traced with :mod:`attnpass.ir` (so any user can trace the same way);
:data:`EXAMPLES` names them for ``attnpass example NAME`` with their size
options and the pipeline that rewrites them. Layer: above ``passes`` (the QSA
helpers build the gather pipeline), below ``cli``.
"""

from .catalog import EXAMPLES, Example, build_example
from .qsa_layer import (
    QSAConfig,
    build_layer,
    gather_pipeline,
    layer_specs,
    make_inputs,
    narrowed_inputs,
    padded_mask,
    qsa_attention,
    rms_norm,
    rope,
)
from .qwen38 import (
    LAYER_QSA_INPUTS,
    N_LAYERS,
    SHARED_QSA_INPUTS,
    build_model,
    is_qsa_layer,
    model_specs,
    verify_specs,
    verify_step,
)
from .tiny_lm import save_tiny_lm, tiny_lm, tiny_tokenizer

__all__ = [
    "EXAMPLES", "Example", "LAYER_QSA_INPUTS", "N_LAYERS", "SHARED_QSA_INPUTS", "QSAConfig", "build_example", "build_layer", "build_model",
    "gather_pipeline", "is_qsa_layer", "layer_specs", "make_inputs", "model_specs", "narrowed_inputs",
    "padded_mask", "qsa_attention", "rms_norm", "rope", "save_tiny_lm", "tiny_lm", "tiny_tokenizer", "verify_specs", "verify_step",
]  # fmt: skip
