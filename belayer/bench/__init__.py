"""Benchmarks run from the command line (``belayer bench gateway``)."""
