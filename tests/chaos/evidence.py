"""What a run leaves behind, read for judging: shard digests, the longest episode, log excerpts."""

from __future__ import annotations

import hashlib
from pathlib import Path


def shard_digests(shards_dir: Path) -> dict[str, str]:
    """sha256 of every shard file, by path relative to ``shards_dir``."""
    return {str(p.relative_to(shards_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(shards_dir.glob("batch-*/dp-*.safetensors"))}


def longest_episode_tokens(shards_dir: Path) -> int:
    """Response tokens of the longest episode in the shards (its segments summed, per rollout)."""
    from rollout_bus.model.shards import load_shard  # safetensors: only the runs that ask pay for it

    totals: dict[tuple[int, int, int], int] = {}
    for path in sorted(shards_dir.glob("batch-*/dp-*.safetensors")):
        for sample in load_shard(path).samples():
            key = (sample.adapter_slot, sample.group_index, sample.rollout_id)
            totals[key] = totals.get(key, 0) + int(sample.response_length)
    return max(totals.values(), default=0)


def log_excerpt(path: Path, lines: int, warnings: int) -> str:
    """The last ``warnings`` WARNING/ERROR/Traceback lines before the last ``lines`` lines, then those
    lines: a stage's failure usually shows in a warning long before its log ends."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    head = len(text) - lines
    flagged = [line for line in text[:max(0, head)] if " WARNING " in line or " ERROR " in line
               or line.startswith("Traceback")][-warnings:]
    gap = ["..."] if flagged else []
    return "\n".join(flagged + gap + text[-lines:])
