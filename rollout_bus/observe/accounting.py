"""Reconciling a run: every valid episode the generator finished is in exactly one batch.

The generator's summary lists the episodes it finished as (rollout key string, attempt), and the
deliberate faults it injected (``rollout_bus/sim/faults.py``). Each batch's manifest lists the episodes
it holds; each dead letter carries the original record key. An episode is accounted for when it is
in exactly one written batch (with the attempt that was sent last), or, when in no batch, has at
least one dead letter saying why (``settled``: nothing more is awaited).

The run is ``ok`` only when, besides, every *valid* episode is in a batch. The rule for an episode
found only in the DLQ:

* a deliberate fault's own episode (``replay-gap`` in the summary's faults) is expected there;
* when the run injected faults, an episode whose dead letter is of kind ``mask-check`` is expected
  there too: the replay-gap episode fails the whole-batch mask check and takes every episode of its
  batch to the DLQ with it. Without injected faults a failed mask check is a real failure;
* any other finished episode only in the DLQ is a valid episode lost: counted in
  ``valid_in_dlq_only`` and reported as a problem.

A group written short (the run ended before all its members came: ``complete: false`` in its manifest) is
listed in ``incomplete_groups`` and shown, not a failure: its episodes are whole, and a member whose generator
died mid-episode is in the DLQ as ``unfinished`` (then abandoned, and the group is complete without it).

Records a stage found deleted before it read them (``lost`` dead letters: no key, a range) are problems
of their own, each named by topic, partition and offsets (``lost``): the episodes they held are then
``missing`` or in the DLQ as ``gap``, and the range says why.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from rollout_bus.wire.dead_letter import DeadLetter, DlqKind
from rollout_bus.model.shards import MANIFEST_NAME, verify_batch

FAULT_EPISODE_KINDS = ("replay-gap",)  # faults whose own episode is meant to end in the DLQ
BATCH_MATE_DLQ_KIND = DlqKind.MASK_CHECK     # what the replay-gap episode's batch-mates are dead-lettered as


@dataclass
class Reconciliation:
    """What the run did with every episode it was sent."""

    sent: int = 0
    in_shards: int = 0
    in_dlq_only: int = 0
    valid_in_dlq_only: dict[str, list[str]] = field(default_factory=dict)  # key -> its dead letters' kinds
    missing: list[str] = field(default_factory=list)
    duplicated: dict[str, list[int]] = field(default_factory=dict)
    wrong_attempt: dict[str, tuple[int, int]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    dlq_reasons: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    bad_batches: dict[str, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # records deleted before a stage read them: where, how many
    incomplete_groups: list[str] = field(default_factory=list)  # groups written short: batch, group, members held

    @property
    def settled(self) -> bool:
        """Every episode sent is in a batch or in the DLQ: nothing more is awaited."""
        return not self.missing

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.wrong_attempt or self.unexpected or self.bad_batches
                    or self.valid_in_dlq_only or self.lost)

    def problems(self, limit: int = 5) -> list[str]:
        out = [f"LOST: {where}" for where in self.lost]
        if self.missing:
            out.append(f"{len(self.missing)} episodes in no batch and not in the DLQ, e.g. {self.missing[:limit]}")
        if self.valid_in_dlq_only:
            out.append(f"{len(self.valid_in_dlq_only)} valid episodes only in the DLQ (not deliberate faults), "
                       f"e.g. {list(self.valid_in_dlq_only.items())[:limit]}")
        if self.duplicated:
            out.append(f"{len(self.duplicated)} episodes in more than one batch, e.g. "
                       f"{list(self.duplicated.items())[:limit]}")
        if self.wrong_attempt:
            out.append(f"{len(self.wrong_attempt)} episodes written with an older attempt (sent, written), e.g. "
                       f"{list(self.wrong_attempt.items())[:limit]}")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} episodes in batches that the generator never finished, "
                       f"e.g. {self.unexpected[:limit]}")
        out += [f"batch {name}: {why}" for name, why in self.bad_batches.items()]
        return out


def written_batches(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Manifests of the complete batches under ``out_dir``, by directory name."""
    found = {}
    for manifest_path in sorted(Path(out_dir).glob(f"batch-*/{MANIFEST_NAME}")):
        found[manifest_path.parent.name] = json.loads(manifest_path.read_text())
    return found


def incomplete_groups(manifest: dict[str, Any]) -> list[str]:
    """The groups a batch was written with short (``complete: false``), each as batch, group and what it holds."""
    return [f"batch {manifest.get('seq')}: group (adapter={g.get('adapter')}, group_index={g.get('group_index')}) "
            f"holds {g.get('episodes', 0)} episodes and {g.get('abandoned', 0)} abandoned of {g.get('group_size')}"
            for g in manifest.get("extra", {}).get("groups", []) if g.get("complete") is False]


def reconcile(sent: Iterable[tuple[str, int]], out_dir: Path, dead_letters: Iterable[DeadLetter],
              *, verify: bool = True, faults: Iterable[dict] | None = None) -> Reconciliation:
    """Match the episodes sent against the batches on disk and the dead letters.

    ``faults`` are the generator summary's deliberate faults (none: the run injected none).
    """
    faults = list(faults or [])
    expected_dead = {f.get("key") for f in faults if f.get("kind") in FAULT_EPISODE_KINDS}
    result = Reconciliation()
    sent_attempt = {key: attempt for key, attempt in sent}
    result.sent = len(sent_attempt)
    placed: dict[str, list[int]] = defaultdict(list)
    placed_attempt: dict[str, int] = {}
    for name, manifest in written_batches(out_dir).items():
        result.batches += 1
        if verify:
            try:
                verify_batch(Path(out_dir) / name)
            except ValueError as exc:
                result.bad_batches[name] = str(exc)
        result.incomplete_groups += incomplete_groups(manifest)
        for episode in manifest.get("extra", {}).get("episodes", []):
            placed[episode["key"]].append(int(manifest.get("seq", -1)))
            placed_attempt[episode["key"]] = int(episode["attempt"])
    dead_keys: dict[str, list[str]] = defaultdict(list)
    reasons: dict[str, int] = defaultdict(int)
    for letter in dead_letters:
        if letter.kind == DlqKind.LOST:
            first = int(letter.source.rsplit(":", 1)[1]) if letter.source.count(":") >= 2 else 0
            result.lost.append(f"{letter.stage}: {letter.source.rsplit(':', 1)[0]} offsets {first}.."
                               f"{first + letter.lost - 1} ({letter.lost} records deleted before they were read)")
        key = letter.key.decode(errors="replace") if letter.key else ""
        dead_keys[key].append(letter.kind)
        reasons[f"{letter.stage}/{letter.kind}"] += 1
    result.dlq_reasons = dict(sorted(reasons.items()))
    for key, attempt in sent_attempt.items():
        batches = placed.get(key, [])
        if len(batches) > 1:
            result.duplicated[key] = batches
        elif batches:
            result.in_shards += 1
            if placed_attempt[key] != attempt:
                result.wrong_attempt[key] = (attempt, placed_attempt[key])
        elif dead_keys.get(key):
            result.in_dlq_only += 1
            batch_mate = bool(faults) and BATCH_MATE_DLQ_KIND in dead_keys[key]
            if key not in expected_dead and not batch_mate:
                result.valid_in_dlq_only[key] = sorted(set(dead_keys[key]))
        else:
            result.missing.append(key)
    result.unexpected = sorted(set(placed) - set(sent_attempt))
    return result
