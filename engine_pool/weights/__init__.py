"""The pool's weights: the version it serves (``weights.versions``), updates and catch-ups
(``weights.update``), the keeper of the weight owner (``weights.keeper``), the CPU owner (``weights.owner``)
and the GPU weight cache (``weights.cache``)."""
