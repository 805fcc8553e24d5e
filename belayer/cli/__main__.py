"""``python -m belayer.cli``: the ``belayer`` command, as tests, benches and the demo start a gateway."""

import sys

from belayer.cli import main

if __name__ == "__main__":  # not when collected or imported (pytest --doctest-modules imports it)
    sys.exit(main())
