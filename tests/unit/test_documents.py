"""Every document the code cites exists: a docstring or comment that names a ``.md`` file the
repository does not hold sends its reader nowhere.

The checker reads the docstrings (every string that stands alone as a statement) and the comments
of each Python file under ``rollout_bus/``, ``tests/``, ``bench/`` and ``compose/``, finds names of
Markdown documents in them (``WIRE.md``, ``docs/pipeline.md``, ``compose/README.md``, ...) and
resolves each against the repository root; a bare name (no folder) may also be the citing file's
neighbour, as ``tests/vectors/__init__.py`` cites the ``README.md`` beside it. Code strings (a path
a test opens, an error message) are not citations and are not checked.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("rollout_bus", "tests", "bench", "compose")
SKIPPED_PARTS = {".venv", "__pycache__", ".git"}
# A document name: path segments of word characters, dots and dashes, ending in ``.md``; it must not
# continue a longer token (``*.md`` is a glob, ``x.mdx`` another extension).
DOCUMENT = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?(?:[\w.-]+/)*[\w-]+\.md)(?![\w-])")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)


@dataclass(frozen=True)
class Citation:
    line: int
    name: str


def _cited_in(text: str, first_line: int) -> list[Citation]:
    """Document names in one docstring or comment whose text starts on ``first_line``."""
    urls = [match.span() for match in URL.finditer(text)]
    found = []
    for match in DOCUMENT.finditer(text):
        if any(start <= match.start() < end for start, end in urls):
            continue  # a web address is not a document of this repository
        found.append(Citation(first_line + text.count("\n", 0, match.start()), match.group(1)))
    return found


def citations(source: str) -> list[Citation]:
    """Every document named in the source's docstrings and comments, with the line it is on."""
    found: list[Citation] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += _cited_in(ast.get_source_segment(source, node.value) or "", node.value.lineno)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found += _cited_in(token.string, token.start[0])
    return sorted(found, key=lambda c: (c.line, c.name))


def _exists(name: str, citing_file: Path, root: Path) -> bool:
    if name.startswith(("./", "../")):
        return (citing_file.parent / name).is_file()
    if (root / name).is_file():
        return True
    return "/" not in name and (citing_file.parent / name).is_file()


def missing_documents(path: Path, root: Path = REPO, source: str | None = None) -> list[str]:
    """One message per document ``path`` cites that is not in the repository rooted at ``root``."""
    relative = path.relative_to(root) if path.is_absolute() else path
    citing_file = root / relative
    if source is None:
        source = citing_file.read_text(encoding="utf-8")
    try:
        found = citations(source)
    except (SyntaxError, tokenize.TokenError) as exc:
        return [f"{relative}: cannot be read for citations: {exc}"]
    return [f"{relative}:{c.line} cites {c.name}, which is not in the repository"
            for c in found if not _exists(c.name, citing_file, root)]


def python_files(root: Path = REPO) -> list[Path]:
    files = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if not SKIPPED_PARTS.intersection(path.relative_to(root).parts):
                files.append(path)
    return files


def test_every_cited_document_is_in_the_repository():
    files = python_files()
    assert len(files) > 100, f"expected the whole tree to be scanned, found {len(files)} files"
    problems = [message for path in files for message in missing_documents(path)]
    assert not problems, "documents cited but missing:\n" + "\n".join(problems)


def test_the_checker_sees_citations_in_docstrings_and_comments_but_not_in_code():
    source = (
        '"""Module docstring citing WIRE.md section 4 and docs/pipeline.md."""\n'
        "\n"
        "PATH = 'docs/only-in-code.md'  # a comment citing bench/README.md\n"
        "\n"
        "def f():\n"
        '    """Line one.\n'
        "\n"
        '    See https://example.org/README.md and compose/README.md.\n'
        '    """\n'
        "    return '*.md'\n"
    )
    assert citations(source) == [Citation(1, "WIRE.md"), Citation(1, "docs/pipeline.md"),
                                 Citation(3, "bench/README.md"), Citation(8, "compose/README.md")]


def test_the_checker_reports_a_cited_document_that_does_not_exist():
    source = (
        '"""Explained in docs/no-such-document.md, section 2."""\n'
        "\n"
        "X = 1  # and in NO-SUCH-NOTES.md\n"
        "# while README.md and WIRE.md do exist\n"
    )
    problems = missing_documents(Path("rollout_bus/fake_module.py"), source=source)
    assert problems == [
        "rollout_bus/fake_module.py:1 cites docs/no-such-document.md, which is not in the repository",
        "rollout_bus/fake_module.py:3 cites NO-SUCH-NOTES.md, which is not in the repository",
    ]


def test_a_bare_name_may_be_the_citing_files_neighbour_but_a_path_is_from_the_root(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "NOTES.md").write_text("notes\n")
    (tmp_path / "other").mkdir()
    source = "# see NOTES.md\n# and pkg/NOTES.md\n"
    assert missing_documents(Path("pkg/module.py"), root=tmp_path, source=source) == []
    assert missing_documents(Path("other/module.py"), root=tmp_path, source=source) == [
        "other/module.py:1 cites NOTES.md, which is not in the repository"]
    assert missing_documents(Path("other/module.py"), root=tmp_path, source="# see other/NOTES.md\n") == [
        "other/module.py:1 cites other/NOTES.md, which is not in the repository"]
