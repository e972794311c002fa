"""The console's page scripts, read as source: what Streamlit would show that nobody meant to.

Streamlit's "magic" writes every bare expression statement of a page script to the page; only the
module's docstring is exempt. A string meant as a note for the reader (an attribute docstring
under a constant) is drawn as a paragraph: the Usage page showed "The records table's headers:
the tiles' words, not the ledger's column names." above its filters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.procs import ROOT

SCRIPTS = sorted([ROOT / "admin_ui" / "app.py", *(ROOT / "admin_ui" / "screens").glob("*.py")])


def stray_strings(path: Path) -> list[str]:
    """Bare string statements at the top level of a script, after its docstring (magic writes them)."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [f"line {node.lineno}: {node.value.value!r}" for node in body
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_note_for_the_reader_is_drawn_on_the_page(path: Path) -> None:
    assert not stray_strings(path), f"{path.name}: Streamlit's magic draws these on the page: {stray_strings(path)}"


def test_the_check_sees_a_stray_string(tmp_path: Path) -> None:
    script = tmp_path / "page.py"
    script.write_text('"""Module docstring: not drawn."""\nX = 1\n"""drawn by magic"""\n')
    assert stray_strings(script) == ["line 3: 'drawn by magic'"]


def tables_without_placeholder(path: Path) -> list[int]:
    """Lines of ``st.dataframe(...)`` calls that do not say what a missing value reads as."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dataframe"
            and not any(k.arg == "placeholder" for k in node.keywords)]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_table_says_what_a_missing_value_reads_as(path: Path) -> None:
    """st.dataframe draws a missing value as the word "None" unless told otherwise: the Cluster page's
    processes table read "Up for: None" for a process that was down (the members table above it said "—")."""
    assert not tables_without_placeholder(path), f"{path.name}: st.dataframe without placeholder= at lines " \
                                                 f"{tables_without_placeholder(path)}"
