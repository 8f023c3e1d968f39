"""Sphinx configuration of the megatron-diffckpt docs (MyST Markdown). ``make docs`` builds them
with warnings as errors; the flag and command-line references are generated at each build from
the code (``_ext/reference.py``)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_ext"))

project = "megatron-diffckpt"
author = "megatron-diffckpt developers"
copyright = "2026, megatron-diffckpt developers"
extensions = ["myst_parser", "reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"
html_title = "megatron-diffckpt"
