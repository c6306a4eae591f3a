"""A user's prompt file read into prompt groups: JSONL and Parquet, the keys, token ids as given, text and chat
messages through a local tokenizer, and every malformed line refused by file and line before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_bus.errors import ConfigError
from rollout_bus.producers.prompt_file import PromptFileOptions, read_prompt_file
from rollout_bus.wire.prompt_record import PromptGroup, prompt_id
from tests.prompt_tokenizer import make_tokenizer, ids


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tiny-tok")


def _jsonl(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: Parquet prompt files cannot be read")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _refused(path: Path, match: str, **options) -> str:
    with pytest.raises(ConfigError, match=match) as refused:
        read_prompt_file(path, PromptFileOptions(**options))
    return str(refused.value)


def test_token_ids_are_used_as_given_with_every_optional_field_and_the_defaults(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl",
                  {"input_ids": [5, 6, 7], "label": {"answer": 5}, "id": "q1", "n_samples": 2, "adapter": "math",
                   "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 64},
                   "metadata": {"source": "gsm8k"}, "extra": "ignored"},
                  "",
                  {"input_ids": [9]})
    first, second = read_prompt_file(path, PromptFileOptions(n_samples=8, adapter="code"))
    group = first.group(3)
    assert (group.id, group.group_index, group.input_ids, group.n_samples, group.adapter) == ("q1", 3, [5, 6, 7], 2,
                                                                                              "math")
    assert group.label == {"answer": 5} and group.metadata == {"source": "gsm8k"}
    assert group.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 64}
    assert (group.text, group.tokenizer) == (None, None) and first.where == "prompts.jsonl:1"
    # the defaults, and the blank line counted: the third line is line 3
    other = second.group(4)
    assert (other.n_samples, other.adapter, other.label, other.sampling, second.where) == (8, "code", None, {},
                                                                                           "prompts.jsonl:3")
    assert PromptGroup.from_value(group.value()) == group


def test_a_line_without_an_id_gets_the_hash_of_its_content_the_same_every_time(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", {"input_ids": [1, 2], "label": 3}, {"input_ids": [1, 2], "label": 4})
    a, b = read_prompt_file(path)
    assert a.id.startswith("p-") and a.id != b.id
    assert [line.id for line in read_prompt_file(path)] == [a.id, b.id]
    content = {"input_ids": [1, 2], "label": 3, "n_samples": 4, "adapter": None, "metadata": {}, "sampling": {},
               "text": None, "tokenizer": None}
    assert a.id == prompt_id(content)
    # the defaults are content: another --n-samples is another prompt group
    assert read_prompt_file(path, PromptFileOptions(n_samples=2))[0].id != a.id


def test_prompt_and_label_keys_name_the_fields_like_miles_input_key_and_label_key(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "p.jsonl", {"question": "what is two plus three ?", "answer": "5", "prompt": 1})
    (line,) = read_prompt_file(path, PromptFileOptions(prompt_key="question", label_key="answer",
                                                       tokenizer_dir=tokenizer_dir))
    assert line.group(0).label == "5" and line.group(0).text == "what is two plus three ?"


def test_text_is_tokenized_with_the_tokenizers_special_tokens_and_named_by_its_directory(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": "what is two plus three ?", "label": 5})
    group = read_prompt_file(path, PromptFileOptions(tokenizer_dir=tokenizer_dir))[0].group(0)
    assert group.input_ids == ids("<s> what is two plus three ?")
    assert (group.text, group.tokenizer) == ("what is two plus three ?", "tiny-tok")


def test_chat_messages_go_through_the_chat_template_with_the_generation_prompt(tmp_path, tokenizer_dir):
    messages = [{"role": "system", "content": "you are a calculator ."}, {"role": "user", "content": "what is two ?"}]
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": messages, "label": 2})
    group = read_prompt_file(path, PromptFileOptions(tokenizer_dir=tokenizer_dir))[0].group(0)
    assert group.text == "<s><|system|> you are a calculator . <|user|> what is two ? <|assistant|>"
    # the template writes <s> itself: tokenized without special tokens, so it is there once
    assert group.input_ids == ids("<s> <|system|> you are a calculator . <|user|> what is two ? <|assistant|>")
    assert group.tokenizer == "tiny-tok"


def test_a_parquet_file_reads_like_jsonl_and_its_rows_have_the_same_ids(tmp_path, tokenizer_dir):
    rows = [{"prompt": "what is two ?", "label": 2, "sampling": {"temperature": 0.5, "top_k": None}},
            {"prompt": "what is three ?", "label": 3, "sampling": None}]
    parquet = read_prompt_file(_parquet(tmp_path / "p.parquet", rows), PromptFileOptions(tokenizer_dir=tokenizer_dir))
    jsonl = read_prompt_file(_jsonl(tmp_path / "p.jsonl", {"prompt": "what is two ?", "label": 2,
                                                          "sampling": {"temperature": 0.5}},
                                    {"prompt": "what is three ?", "label": 3}),
                             PromptFileOptions(tokenizer_dir=tokenizer_dir))
    assert [line.id for line in parquet] == [line.id for line in jsonl]
    assert [line.where for line in parquet] == ["p.parquet row 0", "p.parquet row 1"]
    assert parquet[0].group(0).sampling == {"temperature": 0.5}  # a struct's null member: not given


def test_a_parquet_row_with_input_ids_and_messages(tmp_path, tokenizer_dir):
    rows = [{"input_ids": [4, 5], "prompt": None, "id": "a"},
            {"input_ids": None, "prompt": [{"role": "user", "content": "what is two ?"}], "id": "b"}]
    a, b = read_prompt_file(_parquet(tmp_path / "p.parquet", rows), PromptFileOptions(tokenizer_dir=tokenizer_dir))
    assert a.group(0).input_ids == [4, 5]
    assert b.group(0).input_ids == ids("<s> <|user|> what is two ? <|assistant|>")


def test_a_malformed_parquet_row_is_named_by_its_row(tmp_path):
    path = _parquet(tmp_path / "bad.parquet", [{"input_ids": [1], "n_samples": None}, {"input_ids": [1, 2], "n_samples": 0}])
    assert _refused(path, "n_samples").startswith("bad.parquet row 1: ")
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("not parquet")
    _refused(not_parquet, "text.parquet: not a readable Parquet file")


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "what is', "prompts.jsonl:2: not a JSON object on one line"),
    ('["a", "list"]', "prompts.jsonl:2: a line must be a JSON object"),
    ('{"label": 1}', "prompts.jsonl:2: no prompt: the line has no 'prompt'"),
    ('{"prompt": "what is two ?"}', "prompts.jsonl:2: 'prompt' is text: give --tokenizer DIR"),
    ('{"prompt": [{"role": "user", "content": "hi"}]}', "prompts.jsonl:2: 'prompt' is chat messages: give --tokenizer"),
    ('{"prompt": 42}', "prompts.jsonl:2: 'prompt' must be text or a list of chat messages"),
    ('{"prompt": ""}', "prompts.jsonl:2: 'prompt' is an empty string"),
    ('{"prompt": []}', "prompts.jsonl:2: 'prompt' is an empty list of chat messages"),
    ('{"prompt": [{"content": "hi"}]}', "prompts.jsonl:2: 'prompt' message 0 must be an object with a string 'role'"),
    ('{"input_ids": []}', "prompts.jsonl:2: 'input_ids' must be a non-empty list of token ids"),
    ('{"input_ids": "1 2 3"}', "prompts.jsonl:2: 'input_ids' must be a non-empty list"),
    ('{"input_ids": [1, -2]}', "prompts.jsonl:2: .*'input_ids'.* must be a non-empty list of token ids"),
    ('{"input_ids": [1], "prompt": "hi"}', "prompts.jsonl:2: give either 'prompt' .* or 'input_ids'"),
    ('{"input_ids": [1], "n_samples": "4"}', "prompts.jsonl:2: .*'n_samples'.* must be an integer >= 1"),
    ('{"input_ids": [1], "n_samples": true}', "prompts.jsonl:2: .*'n_samples'"),
    ('{"input_ids": [1], "sampling": {"temprature": 1.0}}', "prompts.jsonl:2: .*'sampling.temprature'"),
    ('{"input_ids": [1], "sampling": [1.0]}', "prompts.jsonl:2: 'sampling' must be an object"),
    ('{"input_ids": [1], "adapter": 3}', "prompts.jsonl:2: .*'adapter'.* must be a string or null"),
    ('{"input_ids": [1], "metadata": "x"}', "prompts.jsonl:2: .*'metadata'.* must be a JSON object"),
    ('{"input_ids": [1], "id": 7}', "prompts.jsonl:2: .*'id'.* must be a string of 1-256 bytes"),
    ('{"input_ids": [1], "label": NaN}', "prompts.jsonl:2: not a JSON object on one line .*NaN"),
])
def test_every_malformed_line_is_refused_naming_the_file_and_line(tmp_path, line, problem):
    path = _jsonl(tmp_path / "prompts.jsonl", {"input_ids": [1]}, line, {"input_ids": [2]})
    message = _refused(path, problem)
    assert "\n" not in message


def test_text_that_tokenizes_to_nothing_and_a_template_less_tokenizer_are_refused(tmp_path):
    plain = make_tokenizer(tmp_path / "plain", chat_template=None, add_bos=False)
    blank = _jsonl(tmp_path / "blank.jsonl", {"input_ids": [1]}, {"prompt": "   "})
    _refused(blank, "blank.jsonl:2: 'prompt' tokenizes to no tokens with 'plain'", tokenizer_dir=plain)
    chat = _jsonl(tmp_path / "chat.jsonl", {"prompt": [{"role": "user", "content": "hi"}]})
    _refused(chat, "chat.jsonl:1: the tokenizer 'plain' has no chat template", tokenizer_dir=plain)


def test_duplicate_ids_in_one_file_are_refused_naming_both_lines(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", {"input_ids": [1], "id": "a"}, {"input_ids": [2], "id": "b"},
                  {"input_ids": [3], "id": "a"})
    _refused(path, r"p.jsonl:3: id 'a' is also the id of p.jsonl:1")
    same = _jsonl(tmp_path / "same.jsonl", {"input_ids": [1]}, {"input_ids": [1]})  # the same content twice
    _refused(same, r"same.jsonl:2: id 'p-[0-9a-f]{24}' is also the id of same.jsonl:1")


def test_an_unknown_suffix_a_missing_file_and_a_bad_tokenizer_directory_are_refused(tmp_path):
    _refused(tmp_path / "p.csv", "unknown prompt file type '.csv'")
    _refused(tmp_path / "missing.jsonl", "missing.jsonl: no such file")
    path = _jsonl(tmp_path / "p.jsonl", {"input_ids": [1]})
    _refused(path, "--tokenizer .*nowhere: not a directory", tokenizer_dir=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    _refused(path, "--tokenizer .*empty: not a tokenizer directory \\(none of tokenizer.json",
             tokenizer_dir=tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    _refused(path, "--tokenizer .*broken: not a tokenizer directory \\(", tokenizer_dir=tmp_path / "broken")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"input_ids": [1]}\n\xff\xfe\n')
    _refused(binary, "b.jsonl: not UTF-8 text")


def test_a_value_json_cannot_hold_is_refused_by_line(tmp_path):
    path = _parquet(tmp_path / "p.parquet", [{"input_ids": [1], "label": b"\x00bytes"}])
    _refused(path, "p.parquet row 0: .*label")
    nan = _parquet(tmp_path / "nan.parquet", [{"input_ids": [1], "metadata": {"score": float("nan")}}])
    _refused(nan, "nan.parquet row 0: a value JSON cannot hold")
