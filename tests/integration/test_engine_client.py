"""``rollout-bus publish-from-engine`` against the real broker and a local server in SGLang's shapes: a turn
with its supports lands on rollout.turns exactly as the engine answered; a refusal publishes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kafka import KafkaConsumer

from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.episode_record import TURN_FIELDS
from tests.engine_server import FixtureEngine, fixture

ROOT = Path(__file__).resolve().parents[2]


def cli(client_kwargs, topics, engine_url: str, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_bus.cli.publish_from_engine", "--bootstrap-servers",
                           client_kwargs["bootstrap_servers"], "--topic-prefix", topics.prefix, "--engine-url",
                           engine_url, "--input-ids", "5,6,7", "--group-index", "2", "--rollout-id", "1",
                           "--group-size", "4", *more], cwd=ROOT, capture_output=True, text=True, timeout=120)


def turns_on(client_kwargs, topics) -> list:
    consumer = KafkaConsumer(topics.turns, **client_kwargs, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=3000)
    try:
        return list(consumer)
    finally:
        consumer.close()


def test_a_turn_from_the_engine_lands_on_rollout_turns_with_its_supports(client_kwargs, topics):
    with FixtureEngine() as engine:
        done = cli(client_kwargs, topics, engine.url, "--top-p", "0.8", "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "3 tokens [12095, 13, 576], supports of [3, 1, 2] ids, status truncated" in " ".join(done.stderr.split())
    (record,) = turns_on(client_kwargs, topics)
    (sample,), _ = decode_samples(record.value, TURN_FIELDS)
    meta = fixture("generate_mask_only")["meta_info"]
    assert list(sample.tokens) == [5, 6, 7, 12095, 13, 576] and (sample.group_index, sample.rollout_id) == (2, 1)
    assert [sample.rollout_sampling_mask.row(t).tolist() for t in range(3)] == meta["output_token_sampling_mask"]
    assert list(sample.rollout_log_probs) == meta["output_token_sampling_logprobs"]
    headers = TurnHeaders.from_kafka(record.headers)
    assert (headers.turn, headers.final, headers.group_size) == (0, True, 4)


def test_refusals_are_one_line_and_publish_nothing(client_kwargs, topics):
    with FixtureEngine() as engine:
        untruncated = cli(client_kwargs, topics, engine.url)  # top-p 1, top-k -1, min-p 0: nothing to return
        absent = cli(client_kwargs, topics, "http://127.0.0.1:9", "--top-k", "20")  # no engine there
        dying = cli(client_kwargs, topics, engine.url, "--top-k", "20", "--input-ids", "666")
    assert untruncated.returncode == 1 and "truncate nothing" in untruncated.stderr
    assert [body["input_ids"] for _path, body in engine.requests] == [[666]]  # the refused request was never sent
    assert absent.returncode == 1 and "did not answer" in absent.stderr
    assert dying.returncode == 1 and "did not answer" in dying.stderr
    assert turns_on(client_kwargs, topics) == []
