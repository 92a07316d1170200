"""``python -m attnpass.cli`` is the ``attnpass`` command."""

import sys

from .main import main

sys.exit(main())
