"""`NodeImages`: images on every node of the cluster, without a registry.

An image that the backend builds (`import_image`, `derive_image`, `build_image`) is built on every node
alive that lacks it, and the recipe is kept for nodes that join later. An image missing on a node when
a sandbox goes there (`ensure`) is built there by its recipe, else copied from the gateway host's own
Docker engine (``docker save`` here, ``docker load`` there), as a registry would give it; an image on
neither is `ImageNotFound`.

Example::

    images = NodeImages(registry, docker_config)
    images.build_image("belayer-task:t-0", "belayer-sandbox-python", tar, "pip install -e .")
    images.ensure(node, "belayer-task:t-0")       # before a sandbox of that image goes to `node`
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import ImageNotFound, SandboxUnavailable
from sandbox.cluster.nodes import Node, NodeRegistry
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend

log = logging.getLogger("belayer.sandbox.cluster")


class NodeImages:
    """Images on the cluster's nodes (module docstring). Methods block."""

    def __init__(self, registry: NodeRegistry, docker: DockerBackendConfig) -> None:
        self._registry = registry
        self._recipes: dict[str, Callable[[Node], None]] = {}  # image -> how to build it on a node
        self._source = _image_source(docker)

    def ensure(self, node: Node, image: str) -> None:
        """Image `image` on `node`: there already, or built as this backend built it elsewhere, or copied
        from the gateway host's own Docker engine (`_image_source`), as a registry would give it."""
        if self._registry.call(node, "call", "has_image", image):
            return
        build = self._recipes.get(image)
        if build is not None:
            build(node)
            return
        if self._source is not None and self._source.has_image(image):
            with tempfile.TemporaryFile() as tar:
                self._source.save_image(image, tar)
                tar.seek(0)
                data = tar.read()
            log.info("image %s: copied to sandbox node %s (%d MB)", image, node.ip, len(data) >> 20)
            self._registry.call(node, "call", "load_image", data)
            return
        raise ImageNotFound(
            f"image {image} is on neither sandbox node {node.ip} nor this gateway's Docker engine: build it "
            "here (belayer sandbox build-image, or the task's image) or on every node"
        )

    def has_image(self, name: str) -> bool:
        """Whether every alive node has image `name`."""
        return all(self._registry.call(n, "call", "has_image", name) for n in self._registry.alive())

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        data = rootfs_tar.read_bytes() if isinstance(rootfs_tar, Path) else rootfs_tar
        self._everywhere(
            name, lambda node: self._registry.call(node, "call", "import_image", name, data, changes)
        )

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None:
        data = {target: path.read_bytes() for target, path in files.items()}

        def build(node: Node) -> None:
            self.ensure(node, base)
            self._registry.call(node, "derive_image", name, base, data)

        self._everywhere(name, build)

    def build_image(self, name: str, base: str, tar: bytes, script: str, **kwargs: Any) -> str:
        """`SandboxBackend.build_image` on every node; a setup with network fences each node first."""
        outputs: list[str] = []

        def build(node: Node) -> None:
            if kwargs.get("network"):
                self._registry.fence(node)
            self.ensure(node, base)
            outputs.append(
                self._registry.call(node, "call", "build_image", name, base, tar, script, **kwargs)
            )

        self._everywhere(name, build)
        return outputs[0] if outputs else ""

    def image_id(self, name: str) -> str:
        alive = self._registry.alive()
        if not alive:
            raise SandboxUnavailable("no sandbox node is alive")
        image: str = self._registry.call(alive[0], "call", "image_id", name)
        return image

    def close(self) -> None:
        if self._source is not None:
            self._source.close()

    def _everywhere(self, name: str, build: Callable[[Node], None]) -> None:
        """Build image `name` on every alive node that lacks it, and remember how, for nodes that join
        later (`ensure`)."""
        self._recipes[name] = build
        for node in self._registry.alive():
            if not self._registry.call(node, "call", "has_image", name):
                build(node)


def _image_source(docker: DockerBackendConfig) -> DockerSandboxBackend | None:
    """The gateway host's own Docker engine, where images missing on a node are copied from (None when
    this host has no engine answering)."""
    try:
        return DockerSandboxBackend(docker.model_copy(update={"checkpoint_store": None}))
    except SandboxUnavailable:
        return None
