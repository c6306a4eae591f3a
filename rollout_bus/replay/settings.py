"""The original run's manifests, and the batching settings a replay takes from them.

Why a module of its own: a replay rebuilds batches byte for byte only with the settings the original
writer used; they come from flags, else the manifests (read from a shards directory or from the
announcements on rollout.shards), else the shard writer's defaults, and a flag that disagrees with
the manifests is warned about (``rollout_bus.replay.rerun`` has the whole contract).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.wire.run_record import BATCHING_MODES
from rollout_bus.config import ShardSettings
from rollout_bus.errors import ConfigError, ContractError, must_be
from rollout_bus.wire.shard_announcement import parse_announcement
from rollout_bus.model.train_data import NORMALIZATIONS
from rollout_bus.model.shards import read_manifest

logger = logging.getLogger(__name__)

SETTING_NAMES = ("batching", "dp_size", "groups_per_batch", "normalization")


@dataclass(frozen=True)
class ReplaySettings:
    """The batching settings of the original run, and where each value came from."""

    batching: str
    dp_size: int
    groups_per_batch: int
    normalization: str
    sources: dict[str, str]
    warnings: tuple[str, ...] = ()
    max_staleness: int | None = None  # the writer's staleness net, as its manifests record it


def manifests_in_dir(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every readable ``batch-*/manifest.json`` under ``directory`` by seq (read only, nothing cleaned)."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(must_be("--compare", "an existing shards directory", str(root)))
    found = {}
    for batch_dir in sorted(p for p in root.glob("batch-*") if p.is_dir()):
        try:
            manifest = read_manifest(batch_dir)
        except ContractError as exc:
            logger.warning("unreadable manifest dir=%s: %s", batch_dir, exc)
            continue
        if manifest is not None:
            found[int(manifest["seq"])] = manifest
    return found


def manifests_from_announcements(values: Iterable[bytes | None]) -> dict[int, dict[str, Any]]:
    """The manifests announced on rollout.shards by seq (the last announcement of a seq wins)."""
    found = (parse_announcement(value) for value in values)
    return {a.seq: a.manifest for a in found if a is not None}


def _inferred_groups_per_batch(manifests: Mapping[int, dict[str, Any]], batching: str) -> tuple[int, int] | None:
    """(G, seq) from the first full batch: its distinct group indices (step) or its groups (arrival)."""
    for seq, manifest in sorted(manifests.items()):
        extra = manifest.get("extra") or {}
        groups = extra.get("groups") or []
        if extra.get("partial") or not groups:
            continue
        count = len({g.get("group_index") for g in groups}) if batching == "step" else len(groups)
        return count, seq
    return None


def _from_manifests(manifests: Mapping[int, dict[str, Any]], batching: str | None) -> dict[str, tuple[Any, str]]:
    if not manifests:
        return {}
    first_seq, first = min(manifests.items())
    extra = first.get("extra") or {}
    found: dict[str, tuple[Any, str]] = {"dp_size": (first.get("dp_size"), f"manifest of batch {first_seq}")}
    for name in ("batching", "normalization"):
        if extra.get(name) is not None:
            found[name] = (extra[name], f"manifest extra of batch {first_seq}")
    inferred = _inferred_groups_per_batch(manifests, batching or found.get("batching", ("step",))[0])
    if inferred is not None:
        found["groups_per_batch"] = (inferred[0], f"inferred from the groups of batch {inferred[1]}")
    return {k: v for k, v in found.items() if v[0] is not None}


def settle_settings(flags: Mapping[str, Any], manifests: Mapping[int, dict[str, Any]]) -> ReplaySettings:
    """Flags first, then the manifests, then the shard writer's defaults; warn where a flag disagrees."""
    found = _from_manifests(manifests, flags.get("batching"))
    defaults = ShardSettings.model_fields
    values, sources, warnings = {}, {}, []
    for name in SETTING_NAMES:
        flag = flags.get(name)
        if flag is not None:
            values[name], sources[name] = flag, "flag"
            if name in found and found[name][0] != flag:
                warnings.append(f"--{name.replace('_', '-')} {flag} differs from {found[name][0]} "
                                f"({found[name][1]}): rebuilt shards will not match the originals")
        elif name in found:
            values[name], sources[name] = found[name]
        else:
            values[name], sources[name] = defaults[name].default, "default"
    if values["batching"] not in BATCHING_MODES:
        raise ConfigError(must_be("batching", f"one of {', '.join(BATCHING_MODES)}", values["batching"]))
    if values["normalization"] not in NORMALIZATIONS:
        raise ConfigError(must_be("normalization", f"one of {', '.join(NORMALIZATIONS)}", values["normalization"]))
    for name in ("dp_size", "groups_per_batch"):
        if isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 1:
            raise ConfigError(must_be(name, "an integer >= 1", values[name]))
    max_staleness = next(((m.get("extra") or {}).get("max_staleness") for _, m in sorted(manifests.items())), None)
    return ReplaySettings(values["batching"], values["dp_size"], values["groups_per_batch"], values["normalization"],
                          sources, tuple(warnings), max_staleness if values["batching"] == "step" else None)
