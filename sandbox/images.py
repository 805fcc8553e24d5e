"""Sandbox base images, built locally: no registry is needed.

- `belayer-sandbox-busybox`: a static busybox and its applet links (about 2 MB, built in memory).
- `belayer-sandbox-python`: Debian bookworm `--variant=minbase` with python3, made by debootstrap
  (about a minute, needs root and a Debian mirror). Its trimmed rootfs tarball is cached in
  `cache_dir`, so later builds only import it.

Each `ensure_*` returns the image name and does nothing when the image already exists.
Build both from a shell::

    python -m sandbox.images all            # or: busybox | python
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Protocol

from core.errors import ImageBuildError

BUSYBOX_IMAGE = "belayer-sandbox-busybox"
PYTHON_IMAGE = "belayer-sandbox-python"
DEFAULT_CACHE_DIR = Path("/var/cache/belayer/images")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TRIM = ("./var/cache/apt/archives/*.deb", "./var/lib/apt/lists/*", "./usr/share/doc/*",
         "./usr/share/locale/*", "./usr/share/man/*")  # fmt: skip


class ImageStore(Protocol):
    """What image building needs from an engine (`DockerSandboxBackend` provides it)."""

    def has_image(self, name: str) -> bool: ...

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None: ...

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None: ...


def ensure_harness_image(store: ImageStore, harness: str, version: str, files: dict[str, Path]) -> str:
    """`belayer-harness-<harness>:<version>`: the python sandbox image plus the harness's files
    (e.g. Claude Code's native binary), built unless it exists; returns its name."""
    name = f"belayer-harness-{harness}:{version}"
    if not store.has_image(name):
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise ImageBuildError(f"cannot build {name}: missing {missing}; install the harness first")
        store.derive_image(name, ensure_python_image(store), files)
    return name


def ensure_busybox_image(store: ImageStore, busybox: Path = Path("/bin/busybox")) -> str:
    """Import `belayer-sandbox-busybox` unless it exists; return its name."""
    if not store.has_image(BUSYBOX_IMAGE):
        tar = busybox_rootfs_tar(busybox)
        store.import_image(BUSYBOX_IMAGE, tar, [f"ENV {_PATH}", 'CMD ["/bin/sh"]'])
    return BUSYBOX_IMAGE


def ensure_python_image(
    store: ImageStore,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    *,
    suite: str = "bookworm",
    mirror: str | None = None,
) -> str:
    """Import `belayer-sandbox-python` unless it exists (debootstrap on a cache miss); return it."""
    if not store.has_image(PYTHON_IMAGE):
        tarball = python_rootfs_tarball(cache_dir, suite=suite, mirror=mirror)
        changes = [f"ENV {_PATH}", "ENV LANG=C.UTF-8", 'CMD ["/bin/bash"]']
        store.import_image(PYTHON_IMAGE, tarball, changes)
    return PYTHON_IMAGE


def busybox_rootfs_tar(busybox: Path) -> bytes:
    """A minimal root filesystem: /bin/busybox, a link per applet, /etc/passwd, empty dirs."""
    applets = _busybox_applets(busybox)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode in (("bin", 0o755), ("dev", 0o755), ("etc", 0o755), ("proc", 0o555),
                           ("root", 0o700), ("sys", 0o555), ("tmp", 0o1777), ("workspace", 0o755)):  # fmt: skip
            _add(tar, name, tarfile.DIRTYPE, mode)
        tar.add(str(busybox), arcname="bin/busybox", filter=_as_root)
        for applet in applets:
            if applet != "busybox":
                _add(tar, f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox")
        _add(tar, "etc/passwd", tarfile.REGTYPE, 0o644, data=b"root:x:0:0:root:/root:/bin/sh\n")
        _add(tar, "etc/group", tarfile.REGTYPE, 0o644, data=b"root:x:0:\n")
    return buf.getvalue()


def python_rootfs_tarball(cache_dir: Path, *, suite: str = "bookworm", mirror: str | None = None) -> Path:
    """The cached, trimmed debootstrap rootfs tarball; built on a cache miss (needs root)."""
    tarball = cache_dir / f"{PYTHON_IMAGE}-{suite}.tar"
    if tarball.is_file():
        return tarball
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise ImageBuildError("building the python image needs root and debootstrap")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", "--include=python3", suite, str(rootfs),
              mirror or debian_mirror()])  # fmt: skip
        partial = tarball.with_suffix(".tar.partial")
        excludes = [f"--exclude={pattern}" for pattern in _TRIM]
        _run(["tar", "-C", str(rootfs), *excludes, "-cf", str(partial), "."])
        partial.rename(tarball)  # only a complete tarball is ever cached
    return tarball


def debian_mirror() -> str:
    """The host's Debian mirror (from apt's deb822 sources), else deb.debian.org."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    return DEFAULT_MIRROR


def _busybox_applets(busybox: Path) -> list[str]:
    if not busybox.is_file():
        raise ImageBuildError(f"no busybox at {busybox} (install busybox-static)")
    listed = _run([str(busybox), "--list"])
    return [name for name in listed.split() if "/" not in name]


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        raise ImageBuildError(f"{argv[0]} failed: {exc} {detail[-2000:]}") from exc
    return done.stdout


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _add(
    tar: tarfile.TarFile, name: str, kind: bytes, mode: int, *, link: str = "", data: bytes = b""
) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data) if data else None)


def main(argv: list[str]) -> int:
    """CLI: `python -m sandbox.images [busybox|python|all]` against the local engine."""
    from sandbox.backends import backend_for

    which = argv[0] if argv else "all"
    if which not in ("busybox", "python", "all"):
        sys.stderr.write("usage: python -m sandbox.images [busybox|python|all]\n")
        return 2
    with backend_for() as backend:
        for kind, build in (("busybox", ensure_busybox_image), ("python", ensure_python_image)):
            if which in (kind, "all"):
                started = time.monotonic()
                name = build(backend)
                sys.stderr.write(f"[images] {name}: ready in {time.monotonic() - started:.1f}s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
