"""Print the requirements of installed distributions, one a line, for ``pip install``: the ones whose markers hold
here, less those named by ``--drop`` (a requirement its installer cannot meet on this platform, installed otherwise).

Usage: ``python .ci/requirements_of.py DIST... [--drop NAME]...``
"""

from __future__ import annotations

import argparse
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements_of(dists: list[str], drop: list[str]) -> list[str]:
    """What ``dists`` require here (markers evaluated, no extra), less the names in ``drop``."""
    dropped = {canonicalize_name(name) for name in drop}
    found = []
    for dist in dists:
        for text in requires(dist) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(requirement.name) not in dropped:
                requirement.marker = None
                found.append(str(requirement))
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dists", nargs="+")
    parser.add_argument("--drop", action="append", default=[])
    args = parser.parse_args()
    print("\n".join(requirements_of(args.dists, args.drop)))
