"""``python -m kvtrace.cli``: the same as the ``kvtrace`` command."""

import sys

from kvtrace.cli.main import main

sys.exit(main())
