"""``python -m belayer.cli``: the ``belayer`` command, as tests, benches and the demo start a gateway."""

import sys

from belayer.cli import main

sys.exit(main())
