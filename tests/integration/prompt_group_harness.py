"""Prompt groups on the bus for the generator-group tests: loaded prompts, member processes, a stream worker and
a shard writer, and the shards' digests to compare runs by."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

from rollout_bus.kafka.clients import new_producer
from rollout_bus.kafka.prompt_ledger import LedgerLog, read_ledger
from rollout_bus.wire.prompt_record import LedgerEvent, PromptGroup
from rollout_bus.wire.topics import Topics

MEMBER_FLAGS = ["--max-turns", "2", "--min-response-len", "4", "--max-response-len", "12", "--vocab-size", "512",
                "--retry-prob", "0.2", "--seed", "5"]


def synthetic_prompts(count: int, n_samples: int = 4, seed: int = 0, first_index: int = 0) -> list[PromptGroup]:
    """``count`` prompt groups of random token ids, group indices from ``first_index``."""
    rng = np.random.default_rng(seed)
    return [PromptGroup(f"q-{seed}-{i}", first_index + i, [int(t) for t in rng.integers(5, 500, size=8)], n_samples,
                        label=f"answer-{i}") for i in range(count)]


def put_prompts(client_kwargs: dict, topics: Topics, prompts: list[PromptGroup]) -> None:
    """Prompt records and the ``loaded`` event, acknowledged (what `rollout-bus prompts load` sends)."""
    producer = new_producer(client_kwargs, acks="all")
    try:
        for prompt in prompts:
            producer.send(topics.prompts, key=prompt.key(), value=prompt.value(), headers=prompt.headers())
        producer.flush()
    finally:
        producer.close()
    log = LedgerLog(client_kwargs, topics)
    try:
        log.write(LedgerEvent("loaded", count=len(prompts)))
    finally:
        log.close()


class Member:
    """One `rollout-bus generate --from-prompts` process."""

    def __init__(self, bootstrap: str, topics: Topics, tmp_path: Path, *extra: str, name: str = "") -> None:
        self.name = name or f"m{uuid.uuid4().hex[:6]}"
        self.log_path = tmp_path / f"{self.name}.log"
        self.summary_path = tmp_path / f"{self.name}.json"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "rollout_bus.cli.generate", "--from-prompts", "--bootstrap-servers", bootstrap,
               "--topic-prefix", topics.prefix, "--member-id", self.name, "--summary-out", str(self.summary_path),
               *MEMBER_FLAGS, *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 180.0) -> int:
        code = self.proc.wait(timeout=timeout)
        if not self._log.closed:
            self._log.close()
        return code

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def summary(self) -> dict:
        return json.loads(self.summary_path.read_text())


def ledger_counts(client_kwargs: dict, topics: Topics) -> dict[str, int]:
    return read_ledger(client_kwargs, topics).counts()


def shard_digests(root: Path) -> dict[str, str]:
    """sha256 of every shard file, by path relative to ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("batch-*/dp-*.safetensors"))}
