"""``python -m rtop``: the same as the ``rtop`` command."""

import sys

from rtop.cli import main

sys.exit(main())
