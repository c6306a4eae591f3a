"""The policy model and its checkpoints: one seed gives one set of weights, a batch gives each context's
own logits, and a checkpoint gives back exactly the weights it was written from, or a CheckpointError.

Proven here: ``build_policy`` is a function of its seed and leaves the global torch RNG as it was;
right-padded batches of contexts of different lengths give each context the logits it gets alone, the
same as the matching positions of ``sequence_logits``; ``save_checkpoint``/``read_checkpoint`` (and
``rollout_bus.load_policy``) round-trip to identical logits; a ``CheckpointRef`` carries the file's real
sha256 and size; a wrong digest, a truncated file and a file that is not a safetensors checkpoint are
refused by name.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_tensors

import rollout_bus
from rollout_bus.errors import ContractError
from rollout_bus.policy.checkpoint import (FORMAT, CheckpointError, CheckpointRef, checkpoint_path, read_checkpoint,
                                           save_checkpoint, sha256_of)
from rollout_bus.policy.model import MAX_POSITIONS, build_policy, last_logits, policy_config, sequence_logits
from rollout_bus.policy.vocab import VOCAB

CONTEXTS = [VOCAB.encode("^3+5?"), VOCAB.encode("^1+2?@=3"), VOCAB.encode("^9"), VOCAB.encode("^0+0?@=0$7")]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logits(model, CONTEXTS)


@pytest.fixture(scope="module")
def model():
    return build_policy(7)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> CheckpointRef:
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"), version=3, step=11)


# ---------------------------------------------------------------------------- the model


def test_one_seed_gives_one_set_of_weights_and_another_seed_others():
    first, again, other = build_policy(1).state_dict(), build_policy(1).state_dict(), build_policy(2).state_dict()
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    differing = [k for k in first if not torch.equal(first[k], other[k])]
    assert "model.embed_tokens.weight" in differing and len(differing) >= 5


def test_building_a_policy_leaves_the_global_rng_as_it_was():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_policy(5)
    assert torch.equal(torch.get_rng_state(), before)
    expected = torch.Generator().manual_seed(1234)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=expected))


def test_the_policy_is_float32_in_eval_mode_over_the_character_vocabulary(model):
    assert model.training is False
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.vocab_size == len(VOCAB) == policy_config().vocab_size
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_batch_of_contexts_of_different_lengths_gives_each_its_own_logits(model):
    assert len({len(c) for c in CONTEXTS}) == len(CONTEXTS)
    with torch.no_grad():
        batched = last_logits(model, CONTEXTS)
        every = sequence_logits(model, CONTEXTS)
        assert batched.shape == (len(CONTEXTS), len(VOCAB)) and batched.dtype == torch.float32
        assert every.shape == (len(CONTEXTS), max(len(c) for c in CONTEXTS), len(VOCAB))
        for i, context in enumerate(CONTEXTS):
            alone = last_logits(model, [context])[0]
            torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(batched[i], every[i, len(context) - 1], atol=1e-5, rtol=0)
            alone_every = sequence_logits(model, [context])[0]
            torch.testing.assert_close(every[i, : len(context)], alone_every, atol=1e-5, rtol=0)
    # the rows really differ: a bug that returned one row for all would not pass the checks above
    assert not torch.allclose(batched[0], batched[1], atol=1e-3)


def test_contexts_may_be_lists_or_arrays_up_to_the_position_limit(model):
    long = np.resize(VOCAB.encode("^1+2?"), MAX_POSITIONS)
    with torch.no_grad():
        as_arrays = last_logits(model, [long, CONTEXTS[0]])
        as_lists = last_logits(model, [long.tolist(), CONTEXTS[0].tolist()])
    assert torch.equal(as_arrays, as_lists)
    assert torch.isfinite(as_arrays).all()


# ---------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_is_named_by_its_version(tmp_path):
    assert checkpoint_path(tmp_path, 3) == tmp_path / "policy-v000003.safetensors"
    assert checkpoint_path(str(tmp_path), 123456).name == "policy-v123456.safetensors"
    assert checkpoint_path(tmp_path, 1234567).name == "policy-v1234567.safetensors"


def test_a_checkpoint_reads_back_to_identical_logits_and_its_metadata(model, saved):
    assert saved.path == checkpoint_path(saved.path.parent, 3) and saved.path.is_file()
    assert (saved.version, saved.step) == (3, 11)
    restored, meta = read_checkpoint(saved.path, saved.sha256)
    assert torch.equal(_logits(restored), _logits(model))
    assert meta["format"] == FORMAT and meta["version"] == "3" and meta["step"] == "11"
    assert json.loads(meta["config"])["vocab_size"] == len(VOCAB)
    original = model.state_dict()
    for key, tensor in restored.state_dict().items():
        assert torch.equal(tensor, original[key]), key
    assert restored.get_output_embeddings().weight.data_ptr() == restored.get_input_embeddings().weight.data_ptr()
    assert not list(saved.path.parent.glob("*.tmp*")), "the atomic write left a temporary file behind"


def test_a_checkpoint_ref_carries_the_files_real_sha256_and_size(saved):
    data = saved.path.read_bytes()
    assert saved.sha256 == hashlib.sha256(data).hexdigest() == sha256_of(saved.path)
    assert saved.bytes == len(data) == saved.path.stat().st_size


def test_a_checkpoint_of_perturbed_weights_reads_back_the_perturbation(tmp_path):
    changed = build_policy(7)
    with torch.no_grad():
        changed.model.embed_tokens.weight.add_(0.5)
    ref = save_checkpoint(changed, tmp_path, version=1, step=1)
    assert torch.equal(_logits(read_checkpoint(ref.path, ref.sha256)[0]), _logits(changed))
    assert not torch.allclose(_logits(changed), _logits(build_policy(7)), atol=1e-3)


def test_the_public_load_returns_the_checkpoints_model(model, saved):
    loaded = rollout_bus.load_policy(saved.path, saved.sha256)
    assert torch.equal(_logits(loaded), _logits(model))
    assert torch.equal(_logits(rollout_bus.load_policy(str(saved.path))), _logits(model))


def test_a_checkpoint_whose_sha256_differs_is_refused_naming_the_file_and_both_digests(saved):
    wrong = hashlib.sha256(b"another file").hexdigest()
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(saved.path, wrong)
    assert str(saved.path) in str(refused.value)
    assert wrong in str(refused.value) and saved.sha256 in str(refused.value)
    assert isinstance(refused.value, ContractError)
    with pytest.raises(CheckpointError, match=str(saved.path)):
        rollout_bus.load_policy(saved.path, wrong)


def test_a_checkpoint_altered_after_saving_is_refused_by_its_published_sha256(saved, tmp_path):
    data = bytearray(saved.path.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight
    altered = tmp_path / saved.path.name
    altered.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match"):
        read_checkpoint(altered, saved.sha256)


@pytest.mark.parametrize("keep", [0, 4, 8, 100, 0.5, -1])
def test_a_truncated_checkpoint_is_refused_by_name(saved, tmp_path, keep):
    data = saved.path.read_bytes()
    cut = {0.5: len(data) // 2, -1: len(data) - 1}.get(keep, keep)
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="torn.safetensors"):
        read_checkpoint(torn)
    with pytest.raises(CheckpointError, match="torn.safetensors"):  # with its digest: refused by the digest
        read_checkpoint(torn, saved.sha256)


@pytest.mark.parametrize("content", [
    b"hello, this is not a checkpoint at all",
    b"\xff" * 64,
    save_tensors({"x": torch.zeros(3)}),  # a safetensors file, but not a policy checkpoint
    save_tensors({"x": torch.zeros(3)}, metadata={"format": "pt"}),
], ids=["text", "binary", "foreign-safetensors", "other-format"])
def test_a_file_that_is_not_a_policy_checkpoint_is_refused_by_name(tmp_path, content):
    path = tmp_path / "other.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="other.safetensors"):
        read_checkpoint(path)


@pytest.mark.parametrize("header", [b"[]", b'"text"', b"3", b'{"__metadata__": "x"}', b'{"__metadata__": [1]}'],
                         ids=["array", "string", "number", "metadata-string", "metadata-array"])
def test_a_safetensors_header_that_is_json_but_not_an_object_is_refused_by_name(tmp_path, header):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="odd.safetensors"):
        read_checkpoint(path)


def test_a_checkpoint_of_the_right_format_missing_tensors_is_refused(model, tmp_path):
    meta = {"format": FORMAT, "config": model.config.to_json_string(use_diff=False), "version": "0", "step": "0"}
    path = tmp_path / "partial.safetensors"
    path.write_bytes(save_tensors({"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()},
                                  metadata={"rollout_bus": json.dumps(meta)}))
    with pytest.raises(CheckpointError, match="partial.safetensors.*tensors missing"):
        read_checkpoint(path)


def test_the_same_weights_make_the_same_file(model, tmp_path):
    """A version a restarted trainer publishes again must be the same sha256 (one metadata key, sorted)."""
    first = save_checkpoint(model, tmp_path / "a", 5, 4)
    second = save_checkpoint(model, tmp_path / "b", 5, 4)
    assert first.path.read_bytes() == second.path.read_bytes() and first.sha256 == second.sha256


def test_a_missing_checkpoint_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="absent.safetensors"):
        read_checkpoint(tmp_path / "absent.safetensors")


def test_a_refusal_says_what_is_wrong_in_words_a_log_line_can_carry(saved, tmp_path):
    """``problem``: ``missing`` for an absent file, ``sha256 mismatch (...)`` for other bytes (what a generator's
    line puts after ``version N at URI:``); an unreadable path says why instead."""
    with pytest.raises(CheckpointError) as absent:
        read_checkpoint(tmp_path / "absent.safetensors", saved.sha256)
    assert absent.value.problem == "missing" and absent.value.path == str(tmp_path / "absent.safetensors")
    wrong = hashlib.sha256(b"another file").hexdigest()
    with pytest.raises(CheckpointError) as mismatch:
        read_checkpoint(saved.path, wrong)
    assert mismatch.value.problem == f"sha256 mismatch (the file's {saved.sha256} does not match the published {wrong})"
    with pytest.raises(CheckpointError) as directory:
        read_checkpoint(tmp_path, saved.sha256)
    assert directory.value.problem.startswith("cannot be read (")
