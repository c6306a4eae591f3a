"""The repository's top level is the data flow (README, "Layout"): ``producers/``, ``streams/`` and ``consumers/``
sit beside ``pyproject.toml`` and install as ``rollout_bus.producers``, ``rollout_bus.streams`` and
``rollout_bus.consumers``, so no installed name collides with another distribution's (a bare ``streams`` would).
Everything else is in pyproject.toml; this file only lists the packages, which a static table cannot map.
"""

from pathlib import Path

from setuptools import find_packages, setup

TOP_LEVEL = ("producers", "streams", "consumers")  # folders at the root, installed under rollout_bus

packages = find_packages(include=["rollout_bus", "rollout_bus.*"])
package_dir = {}
for folder in TOP_LEVEL:
    if not Path(folder, "__init__.py").is_file():  # the image's dependency layer builds before the sources are copied
        continue
    package_dir[f"rollout_bus.{folder}"] = folder
    packages += [f"rollout_bus.{folder}"] + [f"rollout_bus.{folder}.{p}" for p in find_packages(where=folder)]

setup(packages=packages, package_dir=package_dir)
