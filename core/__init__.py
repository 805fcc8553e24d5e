"""The leaf of Belayer's import graph: the one exception tree and the owner of background tasks.

Every other package may import ``core``; ``core`` imports none of them. The order, checked by
``import-linter`` in ``make lint``::

    belayer (CLI, benchmarks, demo) → harness_adapters → gateway → engine_pool | sandbox → core
"""
