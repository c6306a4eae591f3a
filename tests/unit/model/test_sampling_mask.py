"""RolloutSamplingMask and SamplingMaskBuilder: CSR validation, operations, and list-of-lists properties."""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.sampling_mask import RolloutSamplingMask, SamplingMaskBuilder

INT32_MAX = 2**31 - 1
rows_strategy = st.lists(st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=6), max_size=16)
FAST = settings(max_examples=60, deadline=None)


def as_rows(mask: RolloutSamplingMask) -> list[list[int]]:
    return [mask.row(t).tolist() for t in range(len(mask))]


def csr(mask: RolloutSamplingMask) -> tuple[list[int], list[int]]:
    ids, offsets = mask.as_arrays()
    return ids.tolist(), offsets.tolist()


# --- construction and validation -------------------------------------------------------------


def test_a_mask_stores_ids_as_int32_and_offsets_as_int64():
    mask = RolloutSamplingMask([10, 4, 20], [0, 2, 3])
    ids, offsets = mask.as_arrays()
    assert ids.dtype == np.int32 and offsets.dtype == np.int64
    assert csr(mask) == ([10, 4, 20], [0, 2, 3])
    assert len(mask) == 2


def test_the_empty_mask_is_offsets_zero_and_no_ids():
    mask = RolloutSamplingMask([], [0])
    assert len(mask) == 0 and csr(mask) == ([], [0])
    assert mask == RolloutSamplingMask.from_mask_list([]) == RolloutSamplingMask.concatenate([])


@pytest.mark.parametrize(
    "make",
    [
        lambda: (np.array([1, 2], dtype=np.int64), np.array([0, 1, 2], dtype=np.int32)),
        lambda: (np.array([1, 2], dtype=np.uint16), np.array([0, 1, 2], dtype=np.uint64)),
        lambda: (torch.tensor([1, 2]), torch.tensor([0, 1, 2])),
        lambda: ((1, 2), (0, 1, 2)),
    ],
    ids=["numpy-int64", "numpy-unsigned", "torch", "tuples"],
)
def test_a_mask_accepts_sequences_numpy_arrays_and_torch_tensors(make):
    ids, offsets = make()
    assert csr(RolloutSamplingMask(ids, offsets)) == ([1, 2], [0, 1, 2])


def test_a_mask_owns_its_storage_so_later_input_changes_do_not_leak_in():
    ids, offsets = np.array([5, 6], dtype=np.int32), np.array([0, 1, 2], dtype=np.int64)
    mask = RolloutSamplingMask(ids, offsets)
    ids[0], offsets[1] = 99, 2
    tensor_ids = torch.tensor([5, 6], dtype=torch.int32)
    from_tensor = RolloutSamplingMask(tensor_ids, [0, 1, 2])
    tensor_ids[0] = 99
    assert csr(mask) == ([5, 6], [0, 1, 2]) == csr(from_tensor)


@pytest.mark.parametrize(
    ("ids", "offsets", "message"),
    [
        pytest.param([1.0], [0, 1], "'ids' must be integers", id="float-ids"),
        pytest.param([True], [0, 1], "'ids' must be integers", id="bool-ids"),
        pytest.param(np.array([[1]]), [0, 1], "'ids' must be one-dimensional", id="2d-ids"),
        pytest.param([1], [0.0, 1.0], "'offsets' must be integers", id="float-offsets"),
        pytest.param([1], np.array([[0, 1]]), "'offsets' must be one-dimensional", id="2d-offsets"),
        pytest.param([1], [False, True], "'offsets' must be integers", id="bool-offsets"),
        pytest.param([-1], [0, 1], "non-negative", id="negative-id"),
        pytest.param([2**31], [0, 1], "fit int32", id="id-too-large"),
        pytest.param([2**70], [0, 1], "'ids' must be integers", id="id-beyond-int64"),
        pytest.param([1], [], "'offsets' must be non-empty", id="empty-offsets"),
        pytest.param([1], [1, 1], "'offsets[0]' must be 0", id="offsets-not-from-zero"),
        pytest.param([1, 2], [0, 1], "'offsets[-1]' must be len(ids)=2", id="offsets-short-of-ids"),
        pytest.param([1], [0, 2], "'offsets[-1]' must be len(ids)=1", id="offsets-past-ids"),
        pytest.param([1, 2], [0, 0, 2], "strictly increasing", id="empty-row"),
        pytest.param([1, 2], [0, 2, 1, 2], "strictly increasing", id="decreasing"),
        pytest.param([], [0, 0], "strictly increasing", id="empty-support-only"),
        pytest.param(torch.tensor([1.5]), [0, 1], "'ids' must be integers", id="float-tensor"),
        pytest.param(np.array([1], dtype=np.uint64), np.array([0, 2**63], dtype=np.uint64), "fit int64",
                     id="offsets-beyond-int64"),
    ],
)
def test_construction_rejects_malformed_csr_with_a_value_error_naming_the_field(ids, offsets, message):
    with pytest.raises(ContractError, match=re.escape(message)):
        RolloutSamplingMask(ids, offsets)
    assert issubclass(ContractError, ValueError)


def test_from_mask_list_builds_ragged_rows_in_order():
    mask = RolloutSamplingMask.from_mask_list([[10, 4], [20], [30, 7, 8]])
    assert csr(mask) == ([10, 4, 20, 30, 7, 8], [0, 2, 3, 6])


def test_from_mask_list_accepts_numpy_and_torch_rows():
    mask = RolloutSamplingMask.from_mask_list([np.array([1, 2]), torch.tensor([3]), [4]])
    assert as_rows(mask) == [[1, 2], [3], [4]]


@pytest.mark.parametrize(
    "rows",
    [[[1], []], [[1.5]], [[[1, 2]]], [np.array([0.5])], [[-3]], [7]],
    ids=["empty-row", "float", "nested", "float-array", "negative", "not-a-row"],
)
def test_from_mask_list_rejects_bad_rows(rows):
    with pytest.raises(ContractError):
        RolloutSamplingMask.from_mask_list(rows)


# --- operations --------------------------------------------------------------------------------


def test_concatenate_rebases_offsets_in_response_order():
    first = RolloutSamplingMask.from_mask_list([[10, 4]])
    second = RolloutSamplingMask.from_mask_list([[20], [30, 7, 8]])
    assert csr(RolloutSamplingMask.concatenate([first, second])) == ([10, 4, 20, 30, 7, 8], [0, 2, 3, 6])
    assert RolloutSamplingMask.concatenate((m for m in [first])) == first


def test_concatenate_rejects_things_that_are_not_masks():
    with pytest.raises(ContractError, match="masks\\[1\\]"):
        RolloutSamplingMask.concatenate([RolloutSamplingMask([], [0]), [[1]]])


def test_prefix_keeps_the_first_n_tokens_and_rejects_n_outside_the_mask():
    mask = RolloutSamplingMask.from_mask_list([[10, 4], [20], [21]])
    assert csr(mask.prefix(1)) == ([10, 4], [0, 2])
    assert mask.prefix(0) == RolloutSamplingMask([], [0])
    assert mask.prefix(3) == mask
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(ContractError, match="'n'"):
            mask.prefix(bad)


def test_row_returns_a_read_only_view_and_rejects_out_of_range_tokens():
    mask = RolloutSamplingMask.from_mask_list([[10, 4], [20]])
    assert mask.row(0).tolist() == [10, 4] and mask.row(1).tolist() == [20]
    with pytest.raises(ValueError):
        mask.row(0)[0] = 1
    for bad in (-1, 2):
        with pytest.raises(ContractError, match="'t'"):
            mask.row(bad)


def test_equality_compares_contents_and_is_false_for_other_types():
    mask = RolloutSamplingMask.from_mask_list([[1, 2], [3]])
    assert mask == RolloutSamplingMask([1, 2, 3], [0, 2, 3])
    assert mask != RolloutSamplingMask([1, 2, 3], [0, 1, 3])
    assert mask != RolloutSamplingMask([1, 2, 4], [0, 2, 3])
    assert mask != ([1, 2, 3], [0, 2, 3])
    with pytest.raises(TypeError):
        hash(mask)


def test_a_mask_is_frozen_and_its_arrays_are_read_only():
    mask = RolloutSamplingMask([1], [0, 1])
    ids, offsets = mask.as_arrays()
    assert not ids.flags.writeable and not offsets.flags.writeable
    assert mask.as_arrays()[0] is ids  # no copy
    with pytest.raises(ValueError):
        ids[0] = 2
    with pytest.raises(AttributeError):
        mask._ids = np.array([2], dtype=np.int32)
    with pytest.raises(AttributeError):
        mask.anything = 1


def test_as_tensors_shares_memory_without_warning():
    mask = RolloutSamplingMask.from_mask_list([[1, 2], [3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, offsets = mask.as_tensors()
    assert ids.dtype == torch.int32 and offsets.dtype == torch.int64
    assert ids.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 3]
    assert ids.data_ptr() == mask.as_arrays()[0].ctypes.data


def test_nbytes_counts_ids_and_offsets():
    mask = RolloutSamplingMask.from_mask_list([[1, 2], [3]])
    assert mask.nbytes == 3 * 4 + 3 * 8


def test_to_dense_marks_each_support_and_rejects_ids_outside_the_vocabulary():
    dense = RolloutSamplingMask.from_mask_list([[0, 2], [1]]).to_dense(3)
    assert dense.dtype == np.bool_
    assert dense.tolist() == [[True, False, True], [False, True, False]]
    assert RolloutSamplingMask([], [0]).to_dense(4).shape == (0, 4)
    with pytest.raises(ContractError, match="vocab_size=3"):
        RolloutSamplingMask.from_mask_list([[3]]).to_dense(3)
    with pytest.raises(ContractError, match="'vocab_size'"):
        RolloutSamplingMask.from_mask_list([[0]]).to_dense(0)


def test_repr_shows_size_and_the_first_rows():
    text = repr(RolloutSamplingMask.from_mask_list([[10, 4], [20], [1], [2], [3]]))
    assert text.startswith("RolloutSamplingMask(tokens=5, ids=6")
    assert "[[10, 4], [20], [1], [2], ...]" in text


def test_copies_and_pickles_are_equal_masks():
    mask = RolloutSamplingMask.from_mask_list([[1, 2], [3]])
    assert copy.deepcopy(mask) == mask and copy.copy(mask) == mask
    restored = pickle.loads(pickle.dumps(mask))
    assert restored == mask and not restored.as_arrays()[0].flags.writeable


def test_from_trusted_wraps_arrays_without_copying_and_makes_them_read_only():
    ids, offsets = np.array([1, 2], dtype=np.int32), np.array([0, 2], dtype=np.int64)
    mask = RolloutSamplingMask._from_trusted(ids, offsets)
    assert mask.as_arrays()[0] is ids and not ids.flags.writeable
    assert mask == RolloutSamplingMask([1, 2], [0, 2])


# --- builder -----------------------------------------------------------------------------------


def test_worked_example_forced_tokens_after_a_sampled_token():
    builder = SamplingMaskBuilder()
    builder.extend(RolloutSamplingMask([10, 4], [0, 2]))
    builder.append_forced([20, 21])
    assert csr(builder.build()) == ([10, 4, 20, 21], [0, 2, 3, 4])


def test_builder_appends_rows_forced_tokens_and_masks():
    builder = SamplingMaskBuilder(capacity_ids=1, capacity_rows=1)
    builder.append_row([5, 6])
    builder.append_rows([[7], np.array([8, 9])])
    builder.append_forced(torch.tensor([1, 2]))
    builder.extend(RolloutSamplingMask.from_mask_list([[3, 4]]))
    assert len(builder) == 6 and builder.num_ids == 9
    assert as_rows(builder.build()) == [[5, 6], [7], [8, 9], [1], [2], [3, 4]]


def test_builder_stays_usable_after_build_and_built_masks_are_independent():
    builder = SamplingMaskBuilder()
    builder.append_row([1])
    first = builder.build()
    builder.append_row([2])
    assert as_rows(first) == [[1]] and as_rows(builder.build()) == [[1], [2]]
    assert not np.shares_memory(first.as_arrays()[0], builder.build().as_arrays()[0])


def test_builder_rejects_bad_input_and_appends_nothing():
    builder = SamplingMaskBuilder()
    for call, arg in [
        (builder.append_row, []),
        (builder.append_row, [1.5]),
        (builder.append_row, [-1]),
        (builder.append_rows, [[1], []]),
        (builder.append_forced, [[1]]),
        (builder.append_forced, [2**31]),
        (builder.extend, [[1]]),
    ]:
        with pytest.raises(ContractError):
            call(arg)
    assert len(builder) == 0 and builder.build() == RolloutSamplingMask([], [0])


def test_empty_forced_and_row_lists_append_nothing():
    builder = SamplingMaskBuilder()
    builder.append_forced([])
    builder.append_rows([])
    assert len(builder) == 0


# --- properties against a list-of-lists model ---------------------------------------------------


@FAST
@given(rows_strategy)
def test_from_mask_list_round_trips_rows(rows):
    mask = RolloutSamplingMask.from_mask_list(rows)
    assert as_rows(mask) == rows
    ids, offsets = csr(mask)
    assert RolloutSamplingMask(ids, offsets) == mask


@FAST
@given(st.lists(rows_strategy, max_size=5))
def test_concatenate_matches_list_concatenation(parts):
    masks = [RolloutSamplingMask.from_mask_list(rows) for rows in parts]
    expected = [row for rows in parts for row in rows]
    assert as_rows(RolloutSamplingMask.concatenate(masks)) == expected


@FAST
@given(rows_strategy, st.data())
def test_prefix_matches_list_slicing(rows, data):
    n = data.draw(st.integers(0, len(rows)))
    assert as_rows(RolloutSamplingMask.from_mask_list(rows).prefix(n)) == rows[:n]


@FAST
@given(st.lists(st.tuples(st.sampled_from(["row", "rows", "forced", "mask"]), rows_strategy), max_size=10))
def test_builder_matches_appending_to_a_list_of_lists(operations):
    builder, model = SamplingMaskBuilder(capacity_ids=1, capacity_rows=1), []
    for kind, rows in operations:
        if kind == "row" and rows:
            builder.append_row(rows[0])
            model.append(rows[0])
        elif kind == "rows":
            builder.append_rows(rows)
            model.extend(rows)
        elif kind == "forced":
            tokens = [row[0] for row in rows]
            builder.append_forced(tokens)
            model.extend([t] for t in tokens)
        elif kind == "mask":
            builder.extend(RolloutSamplingMask.from_mask_list(rows))
            model.extend(rows)
        assert len(builder) == len(model)
    assert as_rows(builder.build()) == model


@FAST
@given(rows_strategy)
def test_to_dense_matches_the_rows(rows):
    small = [[v % 50 for v in row] for row in rows]
    dense = RolloutSamplingMask.from_mask_list(small).to_dense(50)
    assert [sorted(np.flatnonzero(r).tolist()) for r in dense] == [sorted(set(row)) for row in small]
