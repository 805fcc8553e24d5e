"""``python -m belayer_vllm.preload [PRELOAD_OPTIONS] -- WORKER_ARGS...``: vLLM's own weight-cache
daemon (``vllm preload``) for one device group, started with the workers' own vLLM arguments.

The pool (``engine_pool.weights.cache``) gives the daemon the arguments it gives its workers, so that the
daemon's fingerprint of the weights (vLLM's ``WeightCacheKey``: checkpoint, dtype, quantization,
tensor-parallel size) is the workers' and they map its tensors instead of falling back to disk. Some of
those arguments belong to vLLM's HTTP front end (``--enable-auto-tool-choice``, ``--api-key``), which
``vllm preload`` does not take: they are dropped here, with one line in the log naming them, by vLLM's
own parser (``parse_known_args``), so no list of front-end options is kept in Belayer.
"""

from __future__ import annotations

import argparse
import sys
from typing import cast


def split_known(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments ``vllm preload`` takes, the ones it does not), by vLLM's own parser."""
    _, unknown = _parser().parse_known_args(argv)
    # argparse lists the unknown tokens (an unknown option's value too) in their order in `argv`
    known, left = [], list(unknown)
    for token in argv:
        if left and token == left[0]:
            left.pop(0)
        else:
            known.append(token)
    return known, unknown


def main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.stderr.write("usage: python -m belayer_vllm.preload [PRELOAD_OPTIONS] -- WORKER_ARGS...\n")
        return 2
    split = argv.index("--")
    known, dropped = split_known(argv[split + 1 :])
    if dropped:
        sys.stderr.write(f"belayer preload: not for the weight cache, dropped: {' '.join(dropped)}\n")
    from vllm.entrypoints.cli.preload import PreloadSubcommand

    PreloadSubcommand.cmd(_parser().parse_args([*known, *argv[:split]]))
    return 0


def _parser() -> argparse.ArgumentParser:
    """vLLM's own parser of ``vllm preload`` (the engine's arguments and the daemon's)."""
    from vllm.entrypoints.cli.preload import PreloadSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm preload")  # type: ignore[no-untyped-call]
    PreloadSubcommand.add_cli_args(parser)
    return cast(argparse.ArgumentParser, parser)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
