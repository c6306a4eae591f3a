"""The import contracts, generated from the packages, checked with import-linter (``make lint``).

The folder tree is the data-flow diagram (docs/architecture.md), and these contracts keep it so:

* layers, top down: ``cli`` -> ``demo`` -> (``sim`` | ``learn`` | ``observe`` | ``replay`` | ``local_kafka``) -> the
  stages (``producers`` | ``streams`` | ``consumers.shard_writer`` | ``consumers.feed``, independent of each other) ->
  ``kafka`` -> ``config`` -> ``policy`` (the model both ends run) -> ``wire`` (how a rollout travels) -> ``model``
  (what a rollout is) -> ``errors``;
* the contracts (``wire``, ``model`` and the modules loose at the package root, found on disk, so a
  new one cannot be left out) import none of the layers above them and no Kafka client library;
* only ``rollout_bus.kafka`` and ``rollout_bus.streams.app`` (the Faust app) import ``kafka``,
  ``aiokafka`` or ``faust``; everything else reaches Kafka through ``rollout_bus.kafka``;
* settings end in the CLI: no stage imports ``rollout_bus.config`` (they take small plain values).

``python -m tests.import_contracts`` writes the configuration to a temporary file, runs
``lint-imports`` on it and exits with its status; ``--print`` shows the configuration.

``producers/``, ``streams/`` and ``consumers/`` sit at the repository root and install as sub-packages of
``rollout_bus`` (setup.py). import-linter reads a package from one folder, so the check runs on the layout a wheel
installs, assembled in a temporary directory (``installed_tree``).
"""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rollout_bus"
TOP_LEVEL = ("producers", "streams", "consumers")  # root folders installed as rollout_bus.<name> (setup.py)
STAGES = ("producers", "streams", "consumers.shard_writer", "consumers.feed")
# Top down; names in one tuple are independent of each other.
LAYERS = (("cli",), ("demo",), ("sim", "learn", "observe", "replay", "local_kafka"), STAGES, ("kafka",), ("config",),
          ("policy",), ("wire",), ("model",), ("errors",))
CONTAINERS = ("consumers",)  # packages that only hold layered packages
CONTRACT_PACKAGES = ("wire", "model")
CLIENT_LIBRARIES = ("kafka", "aiokafka", "faust")
CLIENT_OWNERS = ("rollout_bus.kafka", "rollout_bus.streams.app")


def folder_of(package: str) -> Path:
    """Where ``package`` lives in the repository: a root folder for ``rollout_bus.producers`` and the like."""
    parts = package.split(".")
    if len(parts) > 1 and parts[1] in TOP_LEVEL:
        return ROOT.joinpath(*parts[1:])
    return ROOT.joinpath(*parts)


def modules_of(package: str) -> list[tuple[str, bool]]:
    """(dotted name, is a package) of every module directly in ``package``, from the files on disk."""
    found = [(f"{package}.{m.name}", m.ispkg) for m in pkgutil.iter_modules([str(folder_of(package))])]
    if package == PACKAGE:
        found += [(f"{PACKAGE}.{name}", True) for name in TOP_LEVEL]
    return sorted(found)


def layered() -> set[str]:
    return {f"{PACKAGE}.{name}" for layer in LAYERS for name in layer}


def contract_modules() -> list[str]:
    """The contracts: the data model, the wire, and every module loose at the package root."""
    loose = [name for name, is_package in modules_of(PACKAGE) if not is_package]
    return [f"{PACKAGE}.{p}" for p in CONTRACT_PACKAGES] + loose


def unlayered() -> list[str]:
    """Sub-packages or root modules on disk that no layer names: a new one must be placed."""
    names = [name for name, _ in modules_of(PACKAGE)]
    for container in CONTAINERS:
        names.remove(f"{PACKAGE}.{container}")
        names += [name for name, _ in modules_of(f"{PACKAGE}.{container}")]
    return [name for name in names if name not in layered()]


def client_users() -> list[str]:
    """Every module that must reach Kafka through ``rollout_bus.kafka``."""
    users = [f"{PACKAGE}.{name}" for layer in LAYERS for name in layer if name not in ("kafka", "streams")]
    users += [name for name, _ in modules_of(f"{PACKAGE}.streams") if name not in CLIENT_OWNERS]
    return users


def installed_tree(into: Path) -> Path:
    """The package as a wheel installs it (the root folders inside ``rollout_bus/``), copied under ``into``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / PACKAGE, into / PACKAGE, ignore=ignore)
    for name in TOP_LEVEL:
        shutil.copytree(ROOT / name, into / PACKAGE / name, ignore=ignore)
    return into


def _lines(name: str, values) -> str:
    return f"{name} =\n" + "".join(f"    {v}\n" for v in values)


def config_text() -> str:
    """The import-linter configuration (INI)."""
    layer_lines = [" | ".join(f"{PACKAGE}.{n}" for n in layer) for layer in LAYERS]
    contracts = set(contract_modules())
    above_contracts = sorted(layered() - contracts - {f"{PACKAGE}.errors"}) + list(CLIENT_LIBRARIES)
    return "\n".join([
        "[importlinter]\n" + _lines("root_packages", (PACKAGE,)) + "include_external_packages = True\n"
        "contracts =\n    layers\n    contracts-do-no-io\n    one-place-for-kafka\n    settings-end-in-cli\n",
        "[importlinter:contract:layers]\nname = Layers: cli -> demo -> (sim | learn | observe | replay | local_kafka) -> "
        "stages -> kafka -> "
        "config -> policy -> wire -> model -> errors\ntype = layers\n" + _lines("layers", layer_lines),
        "[importlinter:contract:contracts-do-no-io]\n"
        "name = Contracts do no I/O: the wire and the data model import no layer above them and no Kafka client\n"
        "type = forbidden\n" + _lines("source_modules", contract_modules())
        + _lines("forbidden_modules", above_contracts),
        "[importlinter:contract:one-place-for-kafka]\n"
        "name = One place for Kafka I/O: only rollout_bus.kafka and rollout_bus.streams.app import kafka, "
        "aiokafka, faust\n"
        "type = forbidden\nallow_indirect_imports = True\n" + _lines("source_modules", client_users())
        + _lines("forbidden_modules", CLIENT_LIBRARIES),
        "[importlinter:contract:settings-end-in-cli]\n"
        "name = Settings end in the CLI: the stages take plain values and never import rollout_bus.config\n"
        "type = forbidden\nallow_indirect_imports = True\n"
        + _lines("source_modules", (f"{PACKAGE}.{stage}" for stage in STAGES))
        + _lines("forbidden_modules", (f"{PACKAGE}.config",)),
    ])


def run_lint(extra_args: tuple[str, ...] = ("--no-cache",)) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        raise SystemExit("import-linter is a test dependency: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        tree = installed_tree(Path(tmp) / "installed")
        config = Path(tmp) / "importlinter.ini"
        config.write_text(config_text())
        # lint-imports puts its working directory first on sys.path: the copy is what grimp reads
        return subprocess.run([lint, str(config), *extra_args], cwd=tree, capture_output=True, text=True,
                              timeout=300)


def main(argv: list[str]) -> int:
    if "--print" in argv:
        print(config_text())
        return 0
    missing = unlayered()
    if missing:
        print(f"not in any layer of tests/import_contracts.py LAYERS: {', '.join(missing)}")
        return 1
    done = run_lint()
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
