"""A policy generator following the trainer, on the real broker, when a published checkpoint is corrupted or gone.

A version record on rollout.weights whose file fails its sha256, or is missing: ``generate --engine policy
--follow-weights --weights-wait-s 2`` says ``version 0 at URI: sha256 mismatch`` / ``missing`` and that it has
no weights, then exits 66 (``EXIT_NO_USABLE_WEIGHTS``) in one line naming the version and the problem, having
sent nothing. A generator that already runs a verified version and is then told of a refused newer one says the
refusal once, still using the one it has, is not stopped by the 2 s wait, and goes on once a good version comes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollout_bus.consumers.feed.weights import WeightPublisher
from rollout_bus.errors import EXIT_NO_USABLE_WEIGHTS
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.policy.checkpoint import CheckpointRef, save_checkpoint
from rollout_bus.policy.model import build_policy
from rollout_bus.wire.topics import Topics

pytestmark = pytest.mark.kafka

TIMEOUT_S = 120


def _fresh(client_kwargs) -> Topics:
    topics = Topics(prefix=f"wr{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    return topics


def _publish(client_kwargs, topics: Topics, ref: CheckpointRef, version: int | None = None) -> str:
    """Publish ``ref`` on rollout.weights as the trainer does; its URI."""
    publisher, uri = WeightPublisher(client_kwargs, topics), f"file://{ref.path}"
    try:
        publisher.publish(ref.version if version is None else version, ref.step, uri=uri, sha256=ref.sha256,
                          size=ref.bytes)
    finally:
        publisher.close()
    return uri


def _generate(bootstrap: str, topics: Topics, log: Path, *more: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout_bus.cli.generate", "--bootstrap-servers", bootstrap, "--topic-prefix",
           topics.prefix, "--engine", "policy", "--follow-weights", "--weights-wait-s", "2", "--episodes", "8",
           "--n-samples-per-prompt", "4", *more]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "400"})


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of one weight, after its digest was published
    path.write_bytes(bytes(data))


def test_a_corrupted_or_missing_checkpoint_ends_the_generator_with_exit_66_naming_it(client_kwargs,
                                                                                      kafka_bootstrap, tmp_path):
    runs = {}
    for problem, spoil in (("sha256 mismatch", _corrupt), ("missing", Path.unlink)):
        topics = _fresh(client_kwargs)
        ref = save_checkpoint(build_policy(1), tmp_path / problem.split()[0], version=0, step=0)
        uri = _publish(client_kwargs, topics, ref)
        spoil(ref.path)
        log = tmp_path / f"{problem.split()[0]}.log"
        runs[problem] = (uri, log, _generate(kafka_bootstrap, topics, log))  # both at once: seconds, not minutes
    for problem, (uri, log, proc) in runs.items():
        rc = proc.wait(timeout=TIMEOUT_S)
        text = log.read_text()
        assert rc == EXIT_NO_USABLE_WEIGHTS, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        said = f"weights version 0 at {uri}: {problem}"
        refusals = [line for line in text.splitlines() if said in line and "ERROR" in line]
        assert len(refusals) == 1 and refusals[0].endswith("refused; no published weights loaded yet: none to "
                                                           "generate from"), text[-3000:]
        final = [line for line in text.splitlines() if line.startswith("error: no usable weights after waiting ")]
        assert len(final) == 1 and f"version 0 at {uri}: {problem}" in final[0], text[-3000:]
        assert "refused, keeping version=0" not in text and "sent " not in text  # nothing was generated


def test_a_generator_with_verified_weights_says_a_refused_newer_version_once_and_goes_on(client_kwargs,
                                                                                          kafka_bootstrap, tmp_path):
    topics, log = _fresh(client_kwargs), tmp_path / "generate.log"
    refs = {v: save_checkpoint(build_policy(v), tmp_path, version=v, step=v) for v in (0, 1, 2)}
    _publish(client_kwargs, topics, refs[0])
    # synchronous: group 1 (batch 1) needs version 1, so the generator waits at the gate after group 0
    proc = _generate(kafka_bootstrap, topics, log, "--max-staleness", "0", "--groups-per-batch", "1")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "waiting for weights version 1 (live 0)" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        refs[1].path.unlink()  # version 1's file is gone before the generator reads it
        missing = _publish(client_kwargs, topics, refs[1])
        while "missing, refused" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(4)  # twice --weights-wait-s: a generator with weights is not stopped by it
        assert proc.poll() is None, log.read_text()[-3000:]
        _publish(client_kwargs, topics, refs[2])
        rc = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    refusals = [line for line in text.splitlines() if "refused" in line and "ERROR" in line]
    assert len(refusals) == 1, refusals
    assert refusals[0].endswith(f"weights version 1 at {missing}: missing, refused; still using version 0")
    assert "loaded weights version=2" in text and " of 8 episodes" in text, text[-3000:]
