"""``python -m torchparity``: the ``torchparity`` command."""

import sys

from torchparity.cli import main

sys.exit(main())
