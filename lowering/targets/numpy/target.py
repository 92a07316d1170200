"""The numpy reference target (float64 arithmetic, rounded per node): the tests' oracle.

Its arrays are numpy's, so it converts nothing; it has no primitive view and no export.
"""

from __future__ import annotations

import numpy as np

from attnpass.lowering.target import Target

from .emitters import EMITTERS

NUMPY = Target(
    name="numpy",
    distribution="numpy",
    prelude=("import numpy as np", "from attnpass.lowering.targets.numpy import reference as ref"),
    aliases=frozenset({"np", "ref"}),
    emitters=EMITTERS,
    array_module="numpy",
    from_numpy=np.asarray,
    runtime={"qsa": "attnpass.lowering.targets.numpy.qsa"},
)
