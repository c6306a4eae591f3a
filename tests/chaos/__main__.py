"""``python -m tests.chaos [--quick] [--only NAME ...] [--json FILE]``: run the chaos table and print it."""

import sys

from tests.chaos.runner import main

sys.exit(main())
