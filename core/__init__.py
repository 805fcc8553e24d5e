"""The leaf of Belayer's import graph: the exception tree, the owner of background tasks, the live feed.

Every other package may import ``core``; ``core`` imports none of them. The order, checked by
``import-linter`` in ``make lint``::

    belayer (CLI, benchmarks, demo) → harness_adapters → gateway → engine_pool | sandbox → core
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("belayer")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
