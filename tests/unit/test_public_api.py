"""The public API: every name listed imports from ``rollout_bus`` itself, is its home module's object, and is
the list the README shows; ``import rollout_bus`` alone loads neither torch nor a Kafka client."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import rollout_bus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", rollout_bus.__all__)
def test_every_public_name_imports_from_the_package_and_is_its_home_module_s(name):
    namespace: dict = {}
    exec(f"from rollout_bus import {name}", namespace)  # noqa: S102 - the spelling a user writes
    home = __import__(rollout_bus.PUBLIC_API[name], fromlist=[name])
    assert namespace[name] is getattr(home, name)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name"):
        rollout_bus.no_such_name  # noqa: B018


def readme_public_api(readme: str) -> set[str]:
    """The names in the first column of the README's Public API table."""
    section = readme.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row)}


def test_the_readme_lists_exactly_the_public_api():
    assert readme_public_api((ROOT / "README.md").read_text()) == set(rollout_bus.__all__)


def test_a_readme_missing_a_name_is_caught():
    shown = "## Public API\n\n| names | for |\n| --- | --- |\n| `Sample`, `merge_samples` | x |\n## Next\n| `Other` | y |\n"
    assert readme_public_api("intro\n" + shown) == {"Sample", "merge_samples"}


def test_importing_the_package_loads_no_torch_and_no_kafka_client():
    code = "import sys, rollout_bus; print(sorted(m for m in ('torch', 'kafka', 'aiokafka', 'faust') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
