"""Every word the bus carries and reports is spelled in one place: a name written out again as a string literal
elsewhere is a name that can drift from its writer (a reader looking for a key nobody writes shows nothing,
and says nothing).

The names and their homes:

* the flow metric keys, ``wire/flow_metrics.py``: a string constant that starts with ``flow/`` (every flow key
  does: ``flow/generator/...``, ``flow/trainer/...``, ``flow/sample_age_s/...``, ``flow/response_tokens``,
  ``flow/discarded_tokens/<cause>``, ``flow/discarded_token_fraction[/<cause>]``), including the literal parts
  of an f-string (``f"flow/discarded_tokens/{cause}"``);
* the discarded-token causes, ``wire/flow_metrics.py``: a module that spells two or more of them
  (``aborted``, ``removed``, ``stale``, ``takeover``) as string constants. One alone is not the group, and is a word in
  its own right elsewhere (``stale`` is also a dead-letter kind, ``aborted`` a sample status);
* the metric prefix, ``wire/metrics_records.py``: a string constant that starts with ``rollout/``;
* the base topic names, ``wire/topics.py``: a string constant equal to one (``rollout.turns``,
  ``rollout.episodes``, ...); a sentence that names a topic (``"poll rollout.episodes"``) is not one.

Scanned: every ``.py`` under ``rollout_bus/``, ``producers/``, ``streams/`` and ``consumers/``, through its
syntax tree, so comments are never read, and docstrings (the first statement of a module, class or function,
when it is a string) are skipped: they explain the names, they do not use them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollout_bus.wire.flow_metrics import DISCARD_CAUSES, FLOW_PREFIX
from rollout_bus.wire.metrics_records import METRIC_PREFIX
from rollout_bus.wire.topics import Topics

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("rollout_bus", "producers", "streams", "consumers")
FLOW_HOME = "rollout_bus/wire/flow_metrics.py"
PREFIX_HOME = "rollout_bus/wire/metrics_records.py"
TOPICS_HOME = "rollout_bus/wire/topics.py"
BASE_TOPICS = frozenset(Topics().names())


@dataclass(frozen=True)
class Spelling:
    """A name spelled outside its home."""

    path: str
    line: int
    text: str
    what: str
    home: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r} is {self.what}; import it from {self.home}"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of every module, class and function in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _strings(source: str) -> Iterator[ast.Constant]:
    tree = ast.parse(source)
    skipped = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            yield node


def spellings(path: str, source: str) -> list[Spelling]:
    """The names of the bus that ``source`` (the file at ``path``, relative to the repository) spells itself."""
    found, causes = [], []
    for node in _strings(source):
        text = node.value
        if text.startswith((FLOW_PREFIX, METRIC_PREFIX + FLOW_PREFIX)) and path != FLOW_HOME:
            found.append(Spelling(path, node.lineno, text, "a flow metric key", FLOW_HOME))
        elif text.startswith(METRIC_PREFIX) and path != PREFIX_HOME:
            found.append(Spelling(path, node.lineno, text, "the metric prefix", PREFIX_HOME))
        if text in BASE_TOPICS and path != TOPICS_HOME:
            found.append(Spelling(path, node.lineno, text, "a base topic name", TOPICS_HOME))
        if text in DISCARD_CAUSES:
            causes.append(node)
    if len({node.value for node in causes}) >= 2 and path != FLOW_HOME:
        found += [Spelling(path, node.lineno, node.value, "a discarded-token cause", FLOW_HOME) for node in causes]
    return sorted(found, key=lambda s: (s.line, s.text))


def test_no_name_of_the_bus_is_spelled_outside_its_home():
    found = []
    for folder in SCANNED:
        for file in sorted((ROOT / folder).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            found += spellings(path, file.read_text(encoding="utf-8"))
    assert not found, "\n".join(map(str, found))


def test_the_homes_hold_the_names():
    homes = {FLOW_HOME: ("flow/generator/gate_blocked_s", '"aborted"'), PREFIX_HOME: ('"rollout/"',),
             TOPICS_HOME: ('"rollout.turns"', '"rollout.weights"')}
    for home, names in homes.items():
        text = (ROOT / home).read_text(encoding="utf-8")
        assert all(name in text for name in names), home


def test_each_kind_of_spelling_is_caught_and_docstrings_and_lone_words_are_not():
    source = '''"""Docstrings may say flow/trainer/wait_s, rollout/x, "rollout.turns", aborted, removed and stale."""
KEY = "flow/trainer/wait_s"
TOKENS = f"rollout/flow/discarded_tokens/{cause}"
SCOPE = f"rollout/adapter/{name}/"
TOPIC = "rollout.turns"
MESSAGE = "poll rollout.episodes"
KINDS = ("stale", "gap")
STATUS = "aborted"


def f():
    """A function's docstring: flow/x."""
    return "removed"
'''
    found = [(s.line, s.text, s.what) for s in spellings("rollout_bus/x.py", source)]
    assert found == [(2, "flow/trainer/wait_s", "a flow metric key"),
                     (3, "rollout/flow/discarded_tokens/", "a flow metric key"),
                     (4, "rollout/adapter/", "the metric prefix"),
                     (5, "rollout.turns", "a base topic name"),
                     (7, "stale", "a discarded-token cause"),
                     (8, "aborted", "a discarded-token cause"),
                     (13, "removed", "a discarded-token cause")]
    lone = 'KINDS = ("stale", "gap")\nMESSAGE = "poll rollout.episodes"\n'
    assert spellings("rollout_bus/x.py", lone) == []
    assert spellings(FLOW_HOME, 'CAUSES = ("aborted", "removed", "stale")\nKEY = "flow/x"\n') == []
