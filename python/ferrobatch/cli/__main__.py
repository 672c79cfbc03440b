"""``python -m ferrobatch.cli``: the ``ferrobatch`` command."""

import sys

from ferrobatch.cli import main

sys.exit(main())
