"""Engines come and go: a pool of engines behind the prompt-fed generator, against local engines that answer
in SGLang's shapes (tests/engine_server.py): a request to an engine that dies goes to the next and the dead
one is passed over for a while, a 4xx is raised at once with no other engine asked, every engine failing is
one error naming each, calls spread over the pool, and one URL behaves as the plain client."""

from __future__ import annotations

import logging

import pytest

from rollout_bus.errors import ConfigError, EngineError, EngineRefused
from rollout_bus.producers.engine_pool import EnginePool, engine_urls
from rollout_bus.producers.engine_request import generate_request
from tests.engine_server import FixtureEngine

GOOD = generate_request([5, 6, 7], {"top_p": 0.9, "max_new_tokens": 4})
UNTRUNCATED = {**GOOD, "sampling_params": {"max_new_tokens": 4}}  # SGLang answers 400: nothing truncated


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_dead_engine_is_passed_over_and_the_request_answered_by_the_next(caplog):
    clock = Clock()
    with FixtureEngine() as a, FixtureEngine() as b, caplog.at_level(logging.WARNING):
        pool = EnginePool([a.url, b.url], down_s=10, clock=clock)
        a.die_next(1)
        assert pool.post("/generate", GOOD)["meta_info"]
        assert len(a.requests) == 1 and len(b.requests) == 1  # the same request, again on b
        assert f"engine {a.url} failed" in caplog.text and f"goes to {b.url}" in caplog.text
        for _ in range(4):  # a is down for 10 s: every call goes to b
            pool.post("/generate", GOOD)
        assert len(a.requests) == 1 and len(b.requests) == 5
        clock.now = 11.0
        for _ in range(2):  # back in turn
            pool.post("/generate", GOOD)
        assert len(a.requests) == 2 and len(b.requests) == 6


def test_calls_spread_over_the_pool():
    with FixtureEngine() as a, FixtureEngine() as b, FixtureEngine() as c:
        pool = EnginePool(f"{a.url},{b.url}/", timeout_s=5)
        pool2 = EnginePool([c.url])
        for _ in range(6):
            pool.post("/generate", GOOD)
        assert (len(a.requests), len(b.requests)) == (3, 3)
        assert pool2.post("/generate", GOOD)["meta_info"] and pool.base_url == "{" + f"{a.url}, {b.url}" + "}"


def test_a_4xx_is_raised_at_once_and_no_other_engine_is_asked():
    with FixtureEngine() as a, FixtureEngine() as b:
        pool = EnginePool([a.url, b.url])
        with pytest.raises(EngineRefused, match=r"answered 400") as refused:
            pool.post("/generate", UNTRUNCATED)
        assert refused.value.status == 400 and len(a.requests) + len(b.requests) == 1


def test_every_engine_failing_is_one_error_naming_each():
    with FixtureEngine() as a, FixtureEngine() as b:
        a.die_next(1)
        b.die_next(1)
        with pytest.raises(EngineError, match=r"every engine failed this request: .*did not answer.*; .*did not answer"):
            EnginePool([a.url, b.url]).post("/generate", GOOD)


def test_one_url_is_the_plain_client_and_no_url_is_refused():
    with FixtureEngine() as a:
        a.die_next(1)
        with pytest.raises(EngineError, match=r"did not answer") as failed:
            EnginePool(a.url).post("/generate", GOOD)
        assert "every engine" not in str(failed.value)
    with pytest.raises(ConfigError, match="no engine URL"):
        engine_urls(" , ")
    assert engine_urls(["http://a:1/", "http://b:2,http://c:3"]) == ["http://a:1", "http://b:2", "http://c:3"]
