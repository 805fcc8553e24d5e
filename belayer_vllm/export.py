"""``python -m belayer_vllm.export --dir BASE [--checkpoint NAME] -- VLLM_ARGS...``: lay a model's weights out in the store.

The weight owner (``engine_pool.weights.owner``) runs this once, with the same vLLM arguments as its
workers: it builds vLLM's model for that configuration (as ``vllm preload`` does for a GPU), loads the
checkpoint into it with vLLM's default loader, and writes every parameter and buffer, in vLLM's layout
and before any post-processing, to ``BASE/<checkpoint>/<layout>/`` (``belayer_vllm.layout``; NAME:
the owner's directory, by default the model's ``checkpoint_hash``; an owner for an update's weights names
its own, ``shm_weights.weights_id``). A layout
already complete there (from an owner before this one) is kept. Prints the layout's directory and size
as one JSON line, and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from core import shm_weights


def _engine_config(vllm_argv: list[str]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser_class: Any = FlexibleArgumentParser  # its constructor is untyped
    args = make_arg_parser(parser_class()).parse_args(vllm_argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args.load_format = "auto"  # the owner reads the checkpoint itself
    engine_args.model_loader_extra_config = {}
    return engine_args.create_engine_config()


def export(base: str, vllm_argv: list[str], checkpoint: str | None = None) -> dict[str, object]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.utils.network_utils import get_open_port
    from vllm.utils.torch_utils import set_default_torch_dtype

    from belayer_vllm import layout

    started = time.perf_counter()
    cfg = _engine_config(vllm_argv)
    model_config = cfg.model_config
    parallel = cfg.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise SystemExit("the CPU weight owner lays out one rank: a tensor/pipeline-parallel size of 1")
    key = layout.layout_key(model_config, (1, 0), (1, 0), checkpoint)
    directory = layout.layout_dir(base, key)
    done = shm_weights.read_json(directory / shm_weights.MANIFEST)
    if done is not None and done.get("key") == key and (directory / shm_weights.WEIGHTS).is_file():
        return {"dir": str(directory), "bytes": done.get("bytes"), "reused": True,
                "seconds": round(time.perf_counter() - started, 3)}  # fmt: skip
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
    )  # fmt: skip
    with set_current_vllm_config(cfg):
        ensure_model_parallel_initialized(1, 1)
        loader = DefaultModelLoader(cfg.load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = loader.create_model(cfg, model_config)
        loader.load_weights(model, model_config)
        size = layout.write_layout(directory, key, layout.model_tensors(model))
    return {"dir": str(directory), "bytes": size, "reused": False,
            "seconds": round(time.perf_counter() - started, 3)}  # fmt: skip


def main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.stderr.write(
            "usage: python -m belayer_vllm.export --dir BASE [--checkpoint NAME] -- VLLM_ARGS...\n"
        )
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m belayer_vllm.export")
    p.add_argument("--dir", default=shm_weights.DEFAULT_BASE)
    p.add_argument("--checkpoint", default=None)
    opts = p.parse_args(argv[:split])
    sys.stdout.write(json.dumps(export(opts.dir, argv[split + 1 :], opts.checkpoint)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
