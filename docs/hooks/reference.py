"""MkDocs hook: the reference pages are generated from the code at build time, so they cannot drift.

A page holds a marker comment; the build replaces it with tables written from the live objects:

- ``<!-- generated: cli -->``: every ``belayer`` command, from the argparse parser the CLI itself builds
  (``belayer.cli.parser()``), and the benchmarks ``belayer bench`` dispatches to;
- ``<!-- generated: config -->``: every setting of ``GatewayConfig`` and its nested models (key, type,
  default, environment variable, flag, description), with each table's docstring;
- ``<!-- generated: errors -->``: every error the gateway answers (status, code, type, headers), from its
  one table (``gateway.http.errors.TABLE``);
- ``<!-- generated: events -->``: every event kind and its fields (key, type, description), from the
  registry of typed events (``core.events.REGISTRY``) and the fields' docstrings.

``mkdocs.yml`` names this file under ``hooks:``. A marker that renders to nothing, or a parser or model
that can no longer be found, fails the build (``make lint`` runs it with ``--strict``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[2]


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell: pipes, HTML-looking tags and stars escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _code(text: object) -> str:
    return f"`{text}`" if str(text) else ""


# --- the command line ----------------------------------------------------------------------------------


def _subparsers(p: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order the CLI adds them."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _option_rows(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction | argparse._HelpAction):
            continue
        names = ", ".join(a.option_strings) or a.dest
        if a.choices is not None:
            value = "{" + ",".join(str(c) for c in a.choices) + "}"
        elif a.nargs == 0:
            value = ""
        else:
            value = a.metavar if isinstance(a.metavar, str) else (a.dest.upper() if a.option_strings else "")
        help_text = a.help or ""
        if help_text and help_text != argparse.SUPPRESS:
            help_text = help_text % {**vars(a), "prog": p.prog, "default": a.default}
        if a.required:
            default = "required"
        elif a.default in (None, argparse.SUPPRESS, False) or a.nargs == 0:
            default = ""
        else:
            default = _code(a.default)
        rows.append(f"| {_code(names)} | {_cell(value)} | {default} | {_cell(help_text)} |")
    return rows


def _command(lines: list[str], name: str, summary: str, p: argparse.ArgumentParser, depth: int) -> None:
    lines += [f"{'#' * depth} `{p.prog}`", ""]
    about = p.description or summary
    if about:
        lines += [_cell(about).replace("\\*", "*").replace("&lt;", "<"), ""]
    children = list(_subparsers(p))
    if children:
        lines += ["| command | what |", "| --- | --- |"]
        lines += [f"| `{p.prog} {child}` | {_cell(text)} |" for child, text, _ in children]
        lines.append("")
    rows = _option_rows(p)
    if rows and not (children and len(rows) == 1 and "--version" not in rows[0]):
        lines += ["```text", p.format_usage().strip(), "```", ""]
        lines += ["| option | value | default | what |", "| --- | --- | --- | --- |", *rows, ""]
    for child, text, sub in children:
        _command(lines, child, text, sub, min(depth + 1, 4))


def _module_doc(module: str) -> str:
    """A module's docstring, read from its source without importing it (a benchmark imports a lot)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{module} not found: belayer.cli.BENCHES names a module that does not exist")
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def _benches(lines: list[str], cli: types.ModuleType) -> None:
    benches: dict[str, str] = getattr(cli, "BENCHES", {})
    if not benches:
        raise RuntimeError(
            "belayer.cli.BENCHES not found: the bench list in docs/hooks/reference.py is stale"
        )
    lines += [
        "### The benchmarks",
        "",
        "`belayer bench NAME [options]` runs one of these; `belayer bench NAME --help` lists its options. "
        "Each prints its figures as `name: value` lines.",
        "",
        "| benchmark | what |",
        "| --- | --- |",
    ]
    for name, module in benches.items():
        first = _module_doc(module).split("\n\n", 1)[0]
        first = re.sub(r"^``belayer bench [\w-]+``:\s*", "", first).replace("``", "`")
        lines.append(f"| `belayer bench {name}` | {_cell(first)} |")
    lines.append("")


def render_cli() -> str:
    cli = importlib.import_module("belayer.cli")
    p = cli.parser()
    lines: list[str] = []
    _command(lines, "belayer", "", p, 2)
    _benches(lines, cli)
    return "\n".join(lines)


# --- the configuration ---------------------------------------------------------------------------------


def _model_of(annotation: object) -> type[Any] | None:
    from pydantic import BaseModel

    for a in (annotation, *get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _type(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if isinstance(annotation, types.UnionType) or origin is Union:
        return " | ".join(_type(a) for a in get_args(annotation))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type(a) for a in get_args(annotation))}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _first_paragraph(doc: str) -> str:
    """A docstring's first paragraph as Markdown: one line, RST's double backticks single, and a sentence
    that introduces an example (ending in ``::``) dropped, since the example is not shown."""
    text = " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "`")
    if text.endswith("::"):
        text = text[: text.rfind(". ") + 1] if ". " in text else text[:-2] + "."
    return text


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    return _code(repr(field.get_default(call_default_factory=True)))


def _flags(cli: types.ModuleType) -> dict[str, str]:
    """Setting path -> the `belayer serve` flag(s) that set it (the serve parser's dest is the path)."""
    serve = next(sub for name, _, sub in _subparsers(cli.parser()) if name == "serve")
    flags: dict[str, str] = {}
    for a in serve._actions:
        if a.option_strings and a.dest != "help":
            flags[a.dest] = (flags[a.dest] + ", " if a.dest in flags else "") + ", ".join(a.option_strings)
    return flags


def _models(model: type[Any], prefix: str) -> Iterator[tuple[str, type[Any]]]:
    yield prefix, model
    for name, field in model.model_fields.items():
        nested = _model_of(field.annotation)
        if nested is not None:
            yield from _models(nested, f"{prefix}.{name}" if prefix else name)


def render_config() -> str:
    from gateway.config import ENV_NESTING, ENV_PREFIX, GatewayConfig

    flags = _flags(importlib.import_module("belayer.cli"))
    lines: list[str] = []
    for prefix, model in _models(GatewayConfig, ""):
        title = f"`[{prefix}]`" if prefix else "Top level"
        lines += [f"## {title}: `{model.__name__}`", ""]
        doc = _first_paragraph(inspect.getdoc(model) or "")
        if doc:
            lines += [doc, ""]
        lines += ["| setting | type, default | description |", "| --- | --- | --- |"]
        for name, field in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            nested = _model_of(field.annotation)
            env = ENV_PREFIX + path.upper().replace(".", ENV_NESTING)
            setting = "<br>".join(x for x in (f"**`{name}`**", _code(env), _code(flags.get(path, ""))) if x)
            about = _cell(field.description or "")
            if nested is not None:
                anchor = f"[`[{path}]`](#{path.replace('.', '')}-{nested.__name__.lower()})"
                about = about or "a table of its own (JSON in the variable)"
                lines.append(f"| {setting} | {nested.__name__}, see {anchor} | {about} |")
            else:
                lines.append(
                    f"| {setting} | {_code(_type(field.annotation))}<br>{_default(field)} | {about} |"
                )
        lines.append("")
    return "\n".join(lines)


# --- the error codes ----------------------------------------------------------------------------------


def render_errors() -> str:
    """Every error the gateway answers, from its one table (``gateway.http.errors.TABLE``)."""
    from gateway.http.errors import TABLE

    lines = [
        "| exception | HTTP | code | type | headers | what it means |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cls, entry in TABLE.items():
        headers = ", ".join(f"`{k}: {v}`" for k, v in entry.headers)
        about = _cell(_first_paragraph(inspect.getdoc(cls) or ""))
        code = _code(entry.code or "")
        lines.append(
            f"| `{cls.__name__}` | {entry.status} | {code} | `{entry.error_type}` | {headers} | {about} |"
        )
    return "\n".join(lines)


# --- the events ---------------------------------------------------------------------------------------


def _field_docs(module: types.ModuleType) -> dict[tuple[str, str], str]:
    """(class, field) -> the docstring under the field, read from the module's source."""
    tree = ast.parse(inspect.getsource(module))
    docs: dict[tuple[str, str], str] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for field, after in zip(cls.body, cls.body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[cls.name, field.target.id] = after.value.value
    return docs


def render_events() -> str:
    """Every event kind, by who publishes it, with its fields (``core.events.REGISTRY``)."""
    import dataclasses

    from core import events

    docs = _field_docs(events)
    lines: list[str] = []
    topic = ""
    for kind, cls in events.REGISTRY.items():
        if cls.topic != topic:
            topic = cls.topic
            lines += [f"## {topic[0].upper()}{topic[1:]}", ""]
        lines += [f"### `{kind}`", "", _first_paragraph(inspect.getdoc(cls) or ""), ""]
        lines += ["| key | type | what |", "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            owner = next(c for c in cls.__mro__ if f.name in inspect.get_annotations(c))
            annotation = inspect.get_annotations(owner)[f.name]
            parts = [p for p in str(annotation).split(" | ") if p != "Absent"]
            optional = "<br>may be absent" if len(parts) < len(str(annotation).split(" | ")) else ""
            about = docs.get((owner.__name__, f.name))
            if about is None:
                raise RuntimeError(f"core.events.{owner.__name__}.{f.name} has no docstring")
            key = f.metadata.get("key", f.name)
            lines.append(
                f"| `{key}` | {_code(' | '.join(parts))}{optional} | {_cell(_first_paragraph(about))} |"
            )
        lines.append("")
    return "\n".join(lines)


GENERATED: dict[str, Callable[[], str]] = {
    "<!-- generated: cli -->": render_cli,
    "<!-- generated: config -->": render_config,
    "<!-- generated: errors -->": render_errors,
    "<!-- generated: events -->": render_events,
}


def on_config(config: Any, **kwargs: Any) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    for marker, render in GENERATED.items():
        if marker in markdown:
            text = render()
            if not text.strip():
                raise RuntimeError(f"{marker} rendered nothing on {page.file.src_path}")
            markdown = markdown.replace(marker, text)
    return markdown
