"""The Kafka jars and the Java that runs them, fetched once into a cache outside the repo.

The broker is real Apache Kafka from Maven Central: ``mvn dependency:copy-dependencies`` on the
pom shipped beside this module copies ``kafka_2.13`` and a log4j2 binding into
``{cache}/kafka-{version}/libs``. A completed fetch is marked by a ``.complete`` file, so an
interrupted one is redone rather than trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from rollout_bus.errors import BrokerError

logger = logging.getLogger(__name__)

POM_NAME = "kafka-runtime.pom.xml"
MIN_JAVA = 17


def kafka_version() -> str:
    """The Kafka version the shipped pom pins."""
    text = resources.files(__package__).joinpath(POM_NAME).read_text()
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", text)
    if match is None:
        raise BrokerError(f"{POM_NAME} does not pin <kafka.version>")
    return match.group(1)


def cache_root() -> Path:
    """Where jars and local broker state live: ``$ROLLOUT_BUS_CACHE_DIR`` or ``~/.cache/rollout-bus``."""
    env = os.environ.get("ROLLOUT_BUS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "rollout-bus"


def java_executable() -> str:
    """Path of a Java 17+ ``java``; raises BrokerError saying how to install one."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise BrokerError(
            "Java 17 or newer is needed to run the local Kafka broker, and no `java` was found "
            "(on Debian/Ubuntu: `apt-get install openjdk-17-jre-headless`, or set JAVA_HOME)."
        )
    probe = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', probe.stderr + probe.stdout)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < MIN_JAVA:
        raise BrokerError(
            f"the local Kafka broker needs Java {MIN_JAVA}+, but {java} is Java {major or 'unknown'} "
            "(install openjdk-17 or newer, or point JAVA_HOME at one)."
        )
    return java


def jars_dir(version: str | None = None) -> Path:
    """Directory holding the cached jars of ``version`` (may not exist yet)."""
    return cache_root() / f"kafka-{version or kafka_version()}" / "libs"


def _pom_digest() -> str:
    """What the cached jars were fetched for: a changed pom (a dependency added) fetches them again."""
    return hashlib.sha256(resources.files(__package__).joinpath(POM_NAME).read_bytes()).hexdigest()


def ensure_jars(echo=print) -> Path:
    """Return the jar directory, fetching it through Maven on first use (and when the pom changed)."""
    libs = jars_dir()
    marker = libs / ".complete"
    if marker.exists() and _pom_digest() in marker.read_text():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "Maven (`mvn`) is needed once to fetch the Kafka jars from Maven Central "
            "(on Debian/Ubuntu: `apt-get install maven`), or point --bootstrap-servers at an existing cluster."
        )
    workdir = libs.parent
    workdir.mkdir(parents=True, exist_ok=True)
    pom = workdir / "pom.xml"
    pom.write_text(resources.files(__package__).joinpath(POM_NAME).read_text())
    partial = workdir / "libs.partial"
    shutil.rmtree(partial, ignore_errors=True)
    echo(f"fetching Apache Kafka {kafka_version()} jars through Maven into {libs} (first run only) ...")
    cmd = [mvn, "-B", "-q", "-f", str(pom), "dependency:copy-dependencies",
           f"-DoutputDirectory={partial}", "-DincludeScope=runtime"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise BrokerError(f"Maven could not fetch the Kafka jars (exit {done.returncode}):\n{tail}")
    if not any(partial.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"Maven finished but no kafka_2.13 jar is in {partial}")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    marker.write_text(f"{kafka_version()} {_pom_digest()}\n")
    echo(f"fetched {len(list(libs.glob('*.jar')))} jars")
    return libs


def classpath(libs: Path) -> str:
    return os.pathsep.join(sorted(str(p) for p in libs.glob("*.jar")))


if __name__ == "__main__":  # pragma: no cover - manual use: python -m rollout_bus.local_kafka.runtime
    print(ensure_jars(echo=lambda m: print(m, file=sys.stderr)))
