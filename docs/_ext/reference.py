"""Generates the reference pages from the code at each build (and ``tests/test_docs.py`` fails
when the committed copies differ, naming ``make docs``), so that they cannot drift:
``reference/flags.md`` from :class:`~megatron_diffckpt.config.DiffCkptConfig` and
:class:`~megatron_diffckpt.config.DiffCkptOptions` (each field's docstring), and
``reference/cli.md`` from the argparse parsers of ``megatron-diffckpt`` and the usage of
``megatron-diffckpt-launch``."""

from __future__ import annotations

import argparse
import io
import os
from contextlib import redirect_stdout
from dataclasses import MISSING, fields

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(HERE, "reference")


def _default(f, none: str) -> str:
    if f.default_factory is not MISSING:
        return "(the defaults below)"
    return none if f.default is None else f"`{f.default}`"


def flags_page() -> str:
    from megatron_diffckpt.config import (
        RETIRED_FLAGS,
        DiffCkptConfig,
        DiffCkptOptions,
        field_docs,
        flag_of,
    )

    lines = [
        "# Training flags",
        "",
        "Every flag below is added to both training entries (`examples/gpt/pretrain_gpt.py` and",
        "Megatron-LM's `pretrain_gpt.py` through `examples/gpt/pretrain_gpt_diffckpt.py`) and",
        "shown by their `--help`. Generated from `megatron_diffckpt/config.py`.",
        "",
        "| flag | default | what it does |",
        "|---|---|---|",
    ]
    docs = field_docs(DiffCkptConfig)
    for f in fields(DiffCkptConfig):
        name = flag_of(f.name) + (" NAME=VALUE" if f.name == "options" else "")
        lines.append(f"| `{name}` | {_default(f, '-')} | {docs[f.name]} |")
    lines += [
        "",
        "## Options (`--diffckpt-option NAME=VALUE`)",
        "",
        "Fine-grained settings for tests, benchmarks and experts; several may be given",
        "comma-separated or by repeating the flag (the last value of a name wins). Booleans",
        "take `true`/`false` (`on`/`off`, `1`/`0`); a keeper choice also takes `auto`, what",
        "`--diffckpt-keeper auto` picks.",
        "",
        "| option | default | what it does |",
        "|---|---|---|",
    ]
    docs = field_docs(DiffCkptOptions)
    for f in fields(DiffCkptOptions):
        lines.append(f"| `{f.name}` | {_default(f, 'auto')} | {docs[f.name]} |")
    lines += [
        "",
        "## Retired flags",
        "",
        "Refused in one line that names the replacement:",
        "",
        "| flag | use instead |",
        "|---|---|",
    ]
    lines += [f"| `{old}` | {new} |" for old, new in RETIRED_FLAGS.items()]
    return "\n".join(lines) + "\n"


def _help(parser: argparse.ArgumentParser) -> str:
    """The parser's help at a fixed width (argparse wraps to the terminal's, ``COLUMNS``)."""
    out, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with redirect_stdout(out):
            parser.print_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def cli_page() -> str:
    from megatron_diffckpt import cli, launch

    parser = cli.build_parser()
    lines = [
        "# Command lines",
        "",
        "Generated from the parsers in `megatron_diffckpt/cli.py` and",
        "`megatron_diffckpt/launch.py`.",
        "",
        "## `megatron-diffckpt-launch`",
        "",
        "```text",
        launch.USAGE.rstrip(),
        "```",
        "",
        "## `megatron-diffckpt`",
        "",
        "```text",
        _help(parser).rstrip(),
        "```",
    ]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        lines += ["", f"### `megatron-diffckpt {name}`", "", "```text", _help(p).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def generate(_app=None) -> None:
    os.makedirs(OUT, exist_ok=True)
    write_if_changed(os.path.join(OUT, "flags.md"), flags_page())
    write_if_changed(os.path.join(OUT, "cli.md"), cli_page())


def setup(app):
    app.connect("builder-inited", generate)
    return {"parallel_read_safe": True}
