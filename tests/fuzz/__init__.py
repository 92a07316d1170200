"""attnpass's own fuzzer (issue 14, item 7): differential fuzzing of pass pipelines, mutation fuzzing of the loader.

- :mod:`.choices`: every random decision is one recorded integer, so any case
  replays from its choice sequence and shrinks by editing it;
- :mod:`.families`: random valid graphs (sdpa, chains, decomposed attention,
  QSA decode) with inputs inside their ops' contracts;
- :mod:`.pipelines`: random pipelines and options over the pass registry;
- :mod:`.differential`: the rewritten graph against the original on the numpy reference;
- :mod:`.json_mutation`: ``Graph.from_json`` loads or raises AttnpassError;
- :mod:`.runner`: the loop, shrinking and reproducers; ``python -m tests.fuzz`` (``make fuzz N=...``).

It lives with the tests rather than in the library: it is built around this
project's passes and tolerances, and it needs both ``passes`` and
``lowering``, which only the CLI layer may import together.
"""

from .runner import KINDS, Outcome, fuzz, minimise, replay, report, run_case

__all__ = ["KINDS", "Outcome", "fuzz", "minimise", "replay", "report", "run_case"]
