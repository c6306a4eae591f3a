"""Benchmark and table: what the engine adapter makes of each SGLang answer shape, and the publishing client's
turns/s against a local server in those shapes, next to the raw publisher's.

1. Every fixture in ``tests/fixtures/sglang`` (SGLang's native ``return_sampling_mask`` shapes) and a few broken
   variants through ``turn_from_engine_response``: one row each, "accepted" with what the turn holds, or the
   one-line refusal.
2. Against the broker (the local one started when ``--bootstrap-servers`` is not given), ``--turns N`` turns,
   run in turn: ``publish_from_engine`` (one HTTP POST to the fixture server, the answer read and checked, the
   turn published) and the raw ``TurnPublisher.publish_turn`` of the same sample; turns/s of each after a flush,
   and their ratio. The fixture server answers at once: the client's own cost, not an engine's.

``.venv/bin/python bench/engine_client.py [--turns 2000] [--bootstrap-servers HOST:PORT]``
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_bus.errors import ContractError  # noqa: E402
from rollout_bus.kafka.admin import ensure_topics  # noqa: E402
from rollout_bus.local_kafka.local_broker import BrokerLease  # noqa: E402
from rollout_bus.model.sample import Sample  # noqa: E402
from rollout_bus.producers.engine_adapter import engine_output, turn_from_engine_response  # noqa: E402
from rollout_bus.producers.engine_client import EngineClient, publish_from_engine  # noqa: E402
from rollout_bus.producers.publisher import TurnPublisher  # noqa: E402
from rollout_bus.wire.topics import Topics  # noqa: E402
from tests.engine_server import FixtureEngine, fixture  # noqa: E402

TEMPLATE = Sample(group_index=0, index=0, rollout_id=0, prompt="bench")
PARAMS = {"temperature": 1.0, "top_p": 0.8, "top_k": -1, "max_new_tokens": 3}


def _meta(doc):
    """The answer's meta info, found as the adapter finds it (a chat answer's first choice)."""
    return engine_output(doc)[1]


def _broken(name, change):
    doc = copy.deepcopy(fixture(name))
    change(doc)
    return doc


SHAPES = [
    ("/generate, mask only", fixture("generate_mask_only")),
    ("/generate, mask + return_logprob", fixture("generate_mask_and_logprob")),
    ("/v1/chat/completions choice", fixture("chat_completion")),
    ("/generate, prefill only (max_new_tokens 0)", fixture("generate_prefill_only")),
    ("/generate, aborted before any token", fixture("generate_aborted_empty")),
    ("broken: a sampled token outside its support", _broken("generate_mask_only", lambda d: _meta(d)[
        "output_token_sampling_mask"].__setitem__(1, [99]))),
    ("broken: mask_length disagrees", _broken("generate_mask_only", lambda d: _meta(d).update(
        output_token_sampling_mask_length=2))),
    ("broken: a non-finite log-prob", _broken("generate_mask_only", lambda d: _meta(d)[
        "output_token_sampling_logprobs"].__setitem__(2, math.inf))),
    ("broken: output_ids vs output_token_logprobs", _broken("generate_mask_and_logprob", lambda d: _meta(d)[
        "output_token_logprobs"][0].__setitem__(1, 7))),
    ("broken: no supports", _broken("generate_mask_only", lambda d: _meta(d).pop("output_token_sampling_mask"))),
]


def shapes_table() -> None:
    print(f"{'response shape':46} outcome")
    for label, doc in SHAPES:
        try:
            sample = turn_from_engine_response(doc, context_tokens=[1, 2], template=TEMPLATE)
            outcome = f"accepted: {sample.response_length} tokens, status {sample.status.value}"
        except ContractError as exc:
            outcome = f"refused: {exc}"
        print(f"{label:46} {outcome}")


def throughput(bootstrap: str, turns: int) -> None:
    topics = Topics(prefix=f"bench{uuid.uuid4().hex[:8]}.")
    ensure_topics({"bootstrap_servers": bootstrap}, topics)
    with FixtureEngine() as engine, TurnPublisher(bootstrap, topic=topics.turns) as publisher:
        client = EngineClient(engine.url)
        began = time.perf_counter()
        samples = []
        for i in range(turns):
            template = Sample(group_index=i // 4, index=i % 4, rollout_id=i % 4, prompt="bench")
            samples.append(publish_from_engine(client, publisher, template=template, context_tokens=[5, 6, 7],
                                               sampling_params=PARAMS, turn=0, final=True, group_size=4))
        publisher.flush()
        client_s = time.perf_counter() - began
        began = time.perf_counter()
        for sample in samples:
            publisher.publish_turn(sample, turn=0, final=True, group_size=4)
        publisher.flush()
        raw_s = time.perf_counter() - began
    print(f"publish-from-engine (POST, read, check, publish): {turns / client_s:8.0f} turns/s  ({client_s:.2f}s)")
    print(f"raw TurnPublisher.publish_turn, same turns:       {turns / raw_s:8.0f} turns/s  ({raw_s:.2f}s)")
    print(f"client / raw: {raw_s / client_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--bootstrap-servers", default=None)
    args = parser.parse_args()
    shapes_table()
    with BrokerLease(args.bootstrap_servers, echo=print) as bootstrap:
        throughput(bootstrap, args.turns)


if __name__ == "__main__":
    main()
