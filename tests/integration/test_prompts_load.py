"""On the real broker: a prompt file loaded onto rollout.prompts, once per run, numbered in file order, with its
``loaded`` event on rollout.prompt_ledger; the CLI end to end; and a malformed file sends nothing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.kafka.reader import read_topic
from rollout_bus.producers.prompt_file import PromptFileOptions, read_prompt_file
from rollout_bus.producers.prompt_loader import LoadSummary, load_prompts
from rollout_bus.wire.headers import HEADER_SCHEMA
from rollout_bus.wire.prompt_record import LOADED_KEY, LedgerEvent, PromptGroup
from rollout_bus.wire.topics import Topics
from tests.prompt_tokenizer import ids, make_tokenizer

runner = CliRunner()


def _jsonl(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _groups(client_kwargs, topics: Topics) -> list[PromptGroup]:
    records = read_topic(client_kwargs, topics.prompts, stall_s=10)
    assert all(dict(r.headers).get(HEADER_SCHEMA) for r in records)
    assert all(r.key == PromptGroup.from_value(r.value).id.encode() for r in records)
    return sorted((PromptGroup.from_value(r.value) for r in records), key=lambda g: g.group_index)


def _ledger(client_kwargs, topics: Topics) -> list[LedgerEvent]:
    records = read_topic(client_kwargs, topics.prompt_ledger, stall_s=10)
    assert all(r.key == LOADED_KEY and dict(r.headers).get(HEADER_SCHEMA) for r in records)
    return [LedgerEvent.from_value(r.value) for r in records]


def test_a_file_loads_once_in_file_order_and_its_load_is_on_the_ledger(client_kwargs, tmp_path):
    topics = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    first = _jsonl(tmp_path / "first.jsonl", *({"input_ids": [i + 1, i + 2], "label": i} for i in range(5)))
    calls: list[tuple[int, int]] = []
    summary = load_prompts(client_kwargs, topics, read_prompt_file(first), progress=lambda d, t: calls.append((d, t)))
    assert summary == LoadSummary(loaded=5, skipped=0, first_index=0, last_index=4, ledger_count=5)
    assert calls == [(d, 5) for d in range(1, 6)]
    groups = _groups(client_kwargs, topics)
    assert [g.group_index for g in groups] == [0, 1, 2, 3, 4] and [g.label for g in groups] == [0, 1, 2, 3, 4]
    assert [g.n_samples for g in groups] == [4] * 5
    assert [(e.event, e.count) for e in _ledger(client_kwargs, topics)] == [("loaded", 5)]

    # the same file again adds nothing and writes no event
    again = load_prompts(client_kwargs, topics, read_prompt_file(first))
    assert again == LoadSummary(loaded=0, skipped=5) and again.describe() == ("loaded 0 prompt groups, skipped 5 "
                                                                              "already in the run")
    assert len(_groups(client_kwargs, topics)) == 5 and len(_ledger(client_kwargs, topics)) == 1

    # a second file sharing two lines: only the new ones, numbered after the run's
    second = _jsonl(tmp_path / "second.jsonl", {"input_ids": [99], "id": "new-a"}, {"input_ids": [1, 2], "label": 0},
                    {"input_ids": [98], "id": "new-b"}, {"input_ids": [2, 3], "label": 1})
    more = load_prompts(client_kwargs, topics, read_prompt_file(second))
    assert more == LoadSummary(loaded=2, skipped=2, first_index=5, last_index=6, ledger_count=2)
    assert more.describe() == "loaded 2 prompt groups (group_index 5..6), skipped 2 already in the run"
    assert [(g.id, g.group_index) for g in _groups(client_kwargs, topics)][5:] == [("new-a", 5), ("new-b", 6)]
    assert [e.count for e in _ledger(client_kwargs, topics)] == [5, 2]


def test_prompt_groups_a_failed_load_left_are_counted_by_the_next_loaded_event(client_kwargs, tmp_path):
    """Records acknowledged before a load failed carry no ``loaded`` event: the next load counts them, so the
    ledger's counts add up to the run's prompt groups."""
    from rollout_bus.kafka.clients import new_producer

    topics = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    lines = read_prompt_file(_jsonl(tmp_path / "p.jsonl", *({"input_ids": [i + 1]} for i in range(4))))
    load_prompts(client_kwargs, topics, [])  # creates the topics, sends nothing, writes no event
    producer = new_producer(client_kwargs, acks="all")
    try:
        for index, line in enumerate(lines[:2]):  # what a load that failed after two sends left
            group = line.group(index)
            producer.send(topics.prompts, key=group.key(), value=group.value(), headers=group.headers())
        producer.flush()
    finally:
        producer.close()
    summary = load_prompts(client_kwargs, topics, lines)
    assert summary == LoadSummary(loaded=2, skipped=2, first_index=2, last_index=3, ledger_count=4)
    assert [e.count for e in _ledger(client_kwargs, topics)] == [4]
    assert [g.group_index for g in _groups(client_kwargs, topics)] == [0, 1, 2, 3]


def test_the_cli_loads_text_and_chat_prompts_through_a_local_tokenizer(kafka_bootstrap, client_kwargs, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}."
    tokenizer = make_tokenizer(tmp_path / "tiny-tok")
    path = _jsonl(tmp_path / "prompts.jsonl",
                  {"question": "what is two plus three ?", "answer": 5, "id": "q0"},
                  {"question": [{"role": "user", "content": "what is two ?"}], "answer": 2, "n_samples": 2})
    args = ["prompts", "load", str(path), "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix,
            "--prompt-key", "question", "--label-key", "answer", "--tokenizer", str(tokenizer), "--n-samples", "8",
            "--adapter", "math"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "loaded 2 prompt groups (group_index 0..1), skipped 0 already in the run" in done.output
    text, chat = _groups(client_kwargs, Topics(prefix=prefix))
    assert (text.id, text.input_ids, text.label, text.n_samples, text.adapter, text.tokenizer) == (
        "q0", ids("<s> what is two plus three ?"), 5, 8, "math", "tiny-tok")
    assert chat.input_ids == ids("<s> <|user|> what is two ? <|assistant|>") and chat.n_samples == 2
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "loaded 0 prompt groups, skipped 2 already in the run" in again.output
    assert [e.count for e in _ledger(client_kwargs, Topics(prefix=prefix))] == [2]


def test_a_malformed_file_or_flag_is_one_line_exit_2_and_sends_nothing(kafka_bootstrap, client_kwargs, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}."
    on = ["--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix]
    path = _jsonl(tmp_path / "prompts.jsonl", {"input_ids": [1]}, {"input_ids": [2]}, {"prompt": "no tokenizer"})
    for args, problem in [([str(path)], "prompts.jsonl:3: 'prompt' is text: give --tokenizer DIR"),
                          ([str(path), "--n-samples", "0"], "--n-samples: Input should be greater than or equal to 1"),
                          ([str(tmp_path / "nowhere.jsonl")], "nowhere.jsonl: no such file")]:
        done = runner.invoke(app, ["prompts", "load", *args, *on])
        lines = [line for line in done.output.splitlines() if line.strip()]
        assert done.exit_code == 2 and len(lines) == 1 and problem in lines[0], done.output
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**client_kwargs)
    try:
        assert [t for t in admin.list_topics() if t.startswith(prefix)] == []  # nothing created, nothing sent
    finally:
        admin.close()


def test_a_parquet_file_loads_like_jsonl(client_kwargs, tmp_path):
    import pytest

    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: Parquet prompt files cannot be read")
    import pyarrow.parquet as pq

    topics = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"input_ids": [3, 4], "label": "a", "adapter": None},
                                         {"input_ids": [5], "label": "b", "adapter": "code"}]), path)
    summary = load_prompts(client_kwargs, topics, read_prompt_file(path, PromptFileOptions(adapter="math")))
    assert summary.loaded == 2
    assert [(g.input_ids, g.adapter) for g in _groups(client_kwargs, topics)] == [([3, 4], "math"), ([5], "code")]
