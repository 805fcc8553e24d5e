"""What a Dockerfile needs from the engine before it is built: its base images, found and mapped.

Belayer builds task images offline: a ``docker build`` whose ``FROM`` image is missing would ask a
registry for it (and hang, or fail after a long timeout, on an air-gapped host). So every image a
Dockerfile names (``FROM``, and ``COPY --from=`` an image rather than a stage) is read here first
(`base_images`), mapped to a local image where the operator says so (``--base-image NAME=LOCAL``,
`map_bases`), and checked on the engine before anything is built (`sandbox.task_images`).

Only what the classic builder reads is understood: ``ARG`` defaults declared before the first ``FROM``
(``FROM $BASE``, ``${BASE}``, ``${BASE:-x}``), ``--platform=``, ``AS name`` and stage references, line
continuations and comments. A ``FROM`` that needs a build argument without a default is refused: Belayer
passes none.

>>> text = "ARG V=24.04\\nFROM ubuntu:${V} AS build\\nRUN make\\nFROM build\\nCOPY --from=alpine /x /x\\n"
>>> [b.image for b in base_images(text)]
['ubuntu:24.04', 'alpine']
>>> new, needed = map_bases(text, {"ubuntu:24.04": "belayer-sandbox-python"})
>>> needed
['belayer-sandbox-python', 'alpine']
>>> new.splitlines()[1], new.splitlines()[4]
('FROM belayer-sandbox-python AS build', 'COPY --from=alpine /x /x')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import ImageBuildError

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_FLAG = re.compile(r"--([a-z-]+)=(\S+)")


@dataclass(frozen=True, slots=True)
class BaseRef:
    """An image a Dockerfile builds from: ``FROM image`` or ``COPY --from=image``."""

    image: str
    """As the builder will read it (build arguments replaced by their defaults)."""
    line: int
    """The instruction's first line (1-based)."""
    instruction: str
    """``FROM`` or ``COPY --from``."""


@dataclass(frozen=True, slots=True)
class _Instruction:
    first: int  # 0-based physical lines [first, last]
    last: int
    keyword: str
    args: str


def normalize_ref(ref: str) -> str:
    """The reference as the engine names it: ``docker.io/library/`` dropped, ``:latest`` added.

    >>> normalize_ref("docker.io/library/ubuntu"), normalize_ref("ubuntu:24.04"), normalize_ref("a/b@sha256:0")
    ('ubuntu:latest', 'ubuntu:24.04', 'a/b@sha256:0')
    """
    ref = ref.strip()
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "library/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    if "@" in ref or ":" in ref.rsplit("/", 1)[-1]:
        return ref
    return f"{ref}:latest"


def base_images(dockerfile: str) -> list[BaseRef]:
    """Every image `dockerfile` builds from, in order (stages it names itself and ``scratch`` left out)."""
    return [ref for ref, _ in _bases(dockerfile)]


def map_bases(dockerfile: str, mapping: Mapping[str, str]) -> tuple[str, list[str]]:
    """`dockerfile` with each base image that `mapping` names (``NAME`` → ``LOCAL``, compared as
    `normalize_ref` writes them) replaced by its local image, and the images the result needs, each once,
    in order."""
    wanted = {normalize_ref(k): v for k, v in mapping.items()}
    lines = dockerfile.splitlines()
    needed: list[str] = []
    for ref, instruction in reversed(_bases(dockerfile)):  # from the end: line numbers stay valid
        local = wanted.get(normalize_ref(ref.image), ref.image)
        if local != ref.image or instruction.first != instruction.last or "$" in instruction.args:
            lines[instruction.first : instruction.last + 1] = [_rewrite(instruction, ref, local)]
        needed.append(local)
    order = list(dict.fromkeys(reversed(needed)))
    return "\n".join(lines) + "\n", order


def missing_base_message(task: str, where: str, missing: list[str]) -> str:
    """The offline error: which images are missing, and the two ways to provide them.

    >>> print(missing_base_message("t", "environment/Dockerfile", ["ubuntu:24.04"]))  # doctest: +ELLIPSIS
    task t: environment/Dockerfile builds from ubuntu:24.04, which is not on this host's Docker engine...
    """
    names = ", ".join(missing)
    first = missing[0]
    file = re.sub(r"[^A-Za-z0-9_.-]+", "-", first)
    return (
        f"task {task}: {where} builds from {names}, which is not on this host's Docker engine; Belayer "
        f"never pulls images (no registry is reached). Provide it: `docker load -i {file}.tar` (an image "
        f"saved with `docker save {first}` on a host that has it), or build from a local image instead "
        f"with --base-image {first}=LOCAL (e.g. --base-image {first}=belayer-sandbox-python)"
    )


def _bases(dockerfile: str) -> list[tuple[BaseRef, _Instruction]]:
    args: dict[str, str] = {}
    stages: set[str] = set()
    found: list[tuple[BaseRef, _Instruction]] = []
    seen_from = False
    for ins in _instructions(dockerfile):
        if ins.keyword == "ARG" and not seen_from:
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif ins.keyword == "FROM":
            seen_from = True
            words = [w for w in ins.args.split() if not w.startswith("--")]
            if not words:
                raise ImageBuildError(f"Dockerfile line {ins.first + 1}: FROM names no image")
            image = _expand(words[0], args, ins.first + 1)
            if len(words) >= 3 and words[1].lower() == "as":
                stages.add(words[2].lower())
            if image.lower() not in stages and image != "scratch":
                found.append((BaseRef(image, ins.first + 1, "FROM"), ins))
        elif ins.keyword == "COPY":
            flags = dict(_FLAG.findall(ins.args))
            source = flags.get("from")
            if source and not source.isdigit() and source.lower() not in stages:
                found.append(
                    (BaseRef(_expand(source, args, ins.first + 1), ins.first + 1, "COPY --from"), ins)
                )
    return found


def _instructions(dockerfile: str) -> list[_Instruction]:
    """Logical instructions: continuation lines joined, comments and blank lines left out."""
    out: list[_Instruction] = []
    lines = dockerfile.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        first, parts = i, []
        while True:
            text = lines[i].strip()
            if not text.startswith("#"):
                parts.append(text[:-1] if text.endswith("\\") else text)
            if not text.endswith("\\") or i + 1 >= len(lines):
                break
            i += 1
        keyword, _, rest = " ".join(parts).strip().partition(" ")
        out.append(_Instruction(first, i, keyword.upper(), rest.strip()))
        i += 1
    return out


def _expand(word: str, args: Mapping[str, str], line: int) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        if args.get(name):
            return args[name]
        if match.group(2) is not None:
            return match.group(2)
        raise ImageBuildError(
            f"Dockerfile line {line}: {word} needs build argument {name}, which has no default (Belayer "
            f"passes no build arguments); give it one (ARG {name}=...) before the first FROM"
        )

    return _VAR.sub(value, word)


def _rewrite(ins: _Instruction, ref: BaseRef, local: str) -> str:
    if ins.keyword == "FROM":
        words = ins.args.split()
        index = next(i for i, w in enumerate(words) if not w.startswith("--"))
        words[index] = local
        return " ".join(["FROM", *words])
    return "COPY " + re.sub(r"--from=\S+", f"--from={local}", ins.args, count=1)
