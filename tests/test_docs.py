"""The docs stay in step with the code: the committed reference pages are what the generator
makes from the config and the parsers (``make docs`` rewrites them), every page is in the site's
table of contents, and the README stays one screen with the two commands first."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import reference  # noqa: E402


@pytest.mark.parametrize(("page", "make"), [("flags.md", "flags_page"), ("cli.md", "cli_page")])
def test_the_committed_reference_is_what_the_code_generates(page, make):
    committed = (DOCS / "reference" / page).read_text()
    assert committed == getattr(reference, make)(), (
        f"docs/reference/{page} is stale: run `make docs` and commit it"
    )


def test_every_flag_of_the_config_is_on_the_flag_page():
    from dataclasses import fields

    from megatron_diffckpt.config import DiffCkptConfig, DiffCkptOptions, flag_of

    page = reference.flags_page()
    for f in fields(DiffCkptConfig):
        assert f"| `{flag_of(f.name)}" in page, f.name
    for f in fields(DiffCkptOptions):
        assert f"| `{f.name}` |" in page, f.name


def test_every_page_is_in_the_table_of_contents():
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"^([\w/-]+)$", index, re.M))
    pages = {
        str(p.relative_to(DOCS).with_suffix(""))
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and p.name != "index.md"
    }
    assert pages == listed, (pages - listed, listed - pages)


def test_the_readme_is_one_screen_starting_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "The two commands", sections
    first = text.split("## The two commands")[1].split("\n## ")[0]
    assert "make demo" in first and "make test" in first


def test_the_readmes_links_to_files_resolve():
    text = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (REPO / target).exists(), target
