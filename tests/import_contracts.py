"""The import contracts, generated from the packages, checked with import-linter (``make lint``).

The folder tree is the data-flow diagram, and these contracts keep it so:

* layers: ``rollout_bus.cli`` -> ``rollout_bus.tools`` -> (``producers`` | ``streams`` | ``consumers``
  | ``rollout_bus.observe``, independent of each other) -> ``rollout_bus.kafka`` -> the contracts;
* the contracts (every top-level module of ``rollout_bus``, found on disk, so a new one cannot be
  left out) import none of the layers above them and no Kafka client library;
* only ``rollout_bus.kafka`` and ``streams.app`` (the Faust app) import ``kafka``, ``aiokafka`` or
  ``faust``; everything else reaches Kafka through ``rollout_bus.kafka``.

``python -m tests.import_contracts`` writes the configuration to a temporary file, runs
``lint-imports`` on it and exits with its status; ``--print`` shows the configuration.
"""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGES = ("rollout_bus", "producers", "streams", "consumers")
LAYERS = ("rollout_bus.cli", "rollout_bus.tools", "producers | streams | consumers | rollout_bus.observe",
          "rollout_bus.kafka")
CLIENT_LIBRARIES = ("kafka", "aiokafka", "faust")
CLIENT_OWNERS = ("rollout_bus.kafka", "streams.app")


def modules_of(package: str) -> list[tuple[str, bool]]:
    """(dotted name, is a package) of every module directly in ``package``, from the files on disk."""
    path = ROOT / package.replace(".", "/")
    return sorted((f"{package}.{m.name}", m.ispkg) for m in pkgutil.iter_modules([str(path)]))


def contract_modules() -> list[str]:
    """The data model: every top-level module of ``rollout_bus`` (its sub-packages are the layers)."""
    return [name for name, is_package in modules_of("rollout_bus") if not is_package]


def client_users() -> list[str]:
    """Every module that must reach Kafka through ``rollout_bus.kafka``."""
    users = ["rollout_bus.cli", "rollout_bus.tools", "rollout_bus.observe", "producers", "consumers"]
    users += [name for name, _ in modules_of("streams") if name not in CLIENT_OWNERS]
    return users + contract_modules()


def _lines(name: str, values: list[str] | tuple[str, ...]) -> str:
    return f"{name} =\n" + "".join(f"    {v}\n" for v in values)


def config_text() -> str:
    """The import-linter configuration (INI)."""
    above_contracts = ["rollout_bus.cli", "rollout_bus.tools", "rollout_bus.observe", "rollout_bus.kafka",
                       "producers", "streams", "consumers", *CLIENT_LIBRARIES]
    return "\n".join([
        "[importlinter]\n" + _lines("root_packages", ROOT_PACKAGES) + "include_external_packages = True\n"
        "contracts =\n    layers\n    contracts-do-no-io\n    one-place-for-kafka\n",
        "[importlinter:contract:layers]\nname = Layers: cli -> tools -> (stages | observe) -> kafka\n"
        "type = layers\n" + _lines("layers", LAYERS),
        "[importlinter:contract:contracts-do-no-io]\n"
        "name = Contracts do no I/O: the data model imports no layer above it and no Kafka client\n"
        "type = forbidden\n" + _lines("source_modules", contract_modules())
        + _lines("forbidden_modules", above_contracts),
        "[importlinter:contract:one-place-for-kafka]\n"
        "name = One place for Kafka I/O: only rollout_bus.kafka and streams.app import kafka, aiokafka, faust\n"
        "type = forbidden\nallow_indirect_imports = True\n" + _lines("source_modules", client_users())
        + _lines("forbidden_modules", CLIENT_LIBRARIES),
    ])


def run_lint(extra_args: tuple[str, ...] = ("--no-cache",)) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        raise SystemExit("import-linter is a test dependency: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "importlinter.ini"
        config.write_text(config_text())
        return subprocess.run([lint, str(config), *extra_args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)


def main(argv: list[str]) -> int:
    if "--print" in argv:
        print(config_text())
        return 0
    done = run_lint()
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
