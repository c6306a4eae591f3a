"""Ragged top-p/top-k sampling supports in CSR form (docs/data-model.md section 2).

Contract:

* ``RolloutSamplingMask(ids, offsets)`` holds the support of every response token: ``ids`` is
  the flat int32 concatenation of all supports, ``offsets`` (int64, ``len + 1`` entries) says
  where each row starts; row ``t`` is ``ids[offsets[t]:offsets[t + 1]]``. Nothing is ever
  padded to ``[tokens, top_k]``.
* A mask owns its storage (inputs are copied) and is frozen: its arrays are read-only and its
  attributes cannot be rebound. Construction validates strictly and raises ``ContractError``
  (a ``ValueError``): inputs must be one-dimensional integers (no bool, float or 2-D); ids must
  be non-negative and fit int32; offsets must be non-empty, start at 0, end at ``len(ids)`` and
  be strictly increasing (every token has a non-empty support). ``offsets=[0], ids=[]`` is the
  empty mask.
* ``SamplingMaskBuilder`` grows a mask turn by turn in amortised O(1) per id (buffers double),
  so a T-token mask costs O(T) in total instead of the O(T^2) of concatenating after each turn.

``RolloutSamplingMask._from_trusted`` is an internal fast path for the codec and the builder:
it skips validation and takes ownership of the arrays it is given.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be

IDS_DTYPE = np.dtype(np.int32)
OFFSETS_DTYPE = np.dtype(np.int64)
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)
_REPR_ROWS = 4


def _to_numpy(name: str, value: Any) -> np.ndarray:
    """Turn a sequence, numpy array or torch tensor into a 1-D integer numpy array (maybe a view)."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError) as exc:
            raise ContractError(must_be(name, "a one-dimensional integer sequence", value)) from exc
        if arr.size == 0 and arr.dtype.kind == "f" and arr.ndim == 1:
            arr = arr.astype(np.int64)  # np.asarray([]) is float64; an empty sequence is fine
    if arr.ndim != 1:
        raise ContractError(must_be(name, "one-dimensional", f"array of shape {arr.shape}"))
    if arr.dtype.kind not in "iu":
        raise ContractError(must_be(name, "integers (not bool, float or object)", f"dtype {arr.dtype}"))
    return arr


def _check_ids(name: str, arr: np.ndarray) -> None:
    """Ids are vocabulary indices: non-negative and within int32."""
    if arr.size == 0:
        return
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise ContractError(must_be(name, "non-negative token ids", low))
    if high > _INT32_MAX:
        raise ContractError(must_be(name, f"token ids that fit int32 (<= {_INT32_MAX})", high))


def _check_offsets(offsets: np.ndarray, n_ids: int) -> np.ndarray:
    """Validate CSR offsets against the ids length; return them as an owned int64 array."""
    if offsets.size == 0:
        raise ContractError(must_be("offsets", "non-empty (the empty mask is offsets=[0])", []))
    if offsets.dtype.kind == "u" and int(offsets.max()) > _INT64_MAX:
        raise ContractError(must_be("offsets", "values that fit int64", int(offsets.max())))
    owned = np.array(offsets, dtype=OFFSETS_DTYPE, copy=True)
    if owned[0] != 0:
        raise ContractError(must_be("offsets[0]", "0", int(owned[0])))
    if owned[-1] != n_ids:
        raise ContractError(must_be("offsets[-1]", f"len(ids)={n_ids}", int(owned[-1])))
    steps = np.diff(owned)
    if steps.size and int(steps.min()) <= 0:
        bad = int(np.argmax(steps <= 0))
        raise ContractError(
            must_be("offsets", "strictly increasing (every token needs a non-empty support)",
                    f"offsets[{bad}]={int(owned[bad])}, offsets[{bad + 1}]={int(owned[bad + 1])}")
        )
    return owned


def _check_index(name: str, value: Any, low: int, high: int) -> int:
    """An integer (not bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ContractError(must_be(name, "an integer", value))
    if not low <= int(value) <= high:
        raise ContractError(must_be(name, f"in [{low}, {high}]", int(value)))
    return int(value)


class RolloutSamplingMask:
    """The sampling support of every response token, ragged, as CSR (ids int32, offsets int64)."""

    __slots__ = ("_ids", "_offsets")
    __hash__ = None  # equality is by content of mutable-typed arrays; like numpy, not hashable

    def __init__(self, ids: Any, offsets: Any) -> None:
        ids_arr = _to_numpy("ids", ids)
        _check_ids("ids", ids_arr)
        owned_ids = np.array(ids_arr, dtype=IDS_DTYPE, copy=True)
        owned_offsets = _check_offsets(_to_numpy("offsets", offsets), owned_ids.size)
        self._adopt(owned_ids, owned_offsets)

    def _adopt(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        for arr in (ids, offsets):
            if arr.flags.writeable:  # views of a bytes payload are read-only already (cheaper to ask)
                arr.flags.writeable = False
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_offsets", offsets)

    @classmethod
    def _from_trusted(cls, ids: np.ndarray, offsets: np.ndarray) -> RolloutSamplingMask:
        """Internal: wrap arrays already known to be a valid CSR, without validating or copying.

        The caller hands over ownership: ``ids`` must be a contiguous int32 array and ``offsets``
        a valid int64 offsets array that nobody else writes to. Both are made read-only.
        """
        mask = cls.__new__(cls)
        mask._adopt(ids, offsets)
        return mask

    @classmethod
    def empty(cls) -> RolloutSamplingMask:
        """The mask of zero tokens."""
        return cls._from_trusted(np.empty(0, IDS_DTYPE), np.zeros(1, OFFSETS_DTYPE))

    @classmethod
    def from_mask_list(cls, rows: Iterable[Any]) -> RolloutSamplingMask:
        """Build from ragged rows ``[[ids of token 0], [ids of token 1], ...]`` (engine output)."""
        builder = SamplingMaskBuilder()
        builder.append_rows(rows)
        return builder.build()

    @classmethod
    def concatenate(cls, masks: Sequence[RolloutSamplingMask]) -> RolloutSamplingMask:
        """Join masks in response order, rebasing offsets. No masks gives the empty mask."""
        masks = list(masks)
        for i, mask in enumerate(masks):
            if not isinstance(mask, RolloutSamplingMask):
                raise ContractError(must_be(f"masks[{i}]", "a RolloutSamplingMask", type(mask).__name__))
        if not masks:
            return cls.empty()
        ids = np.concatenate([m._ids for m in masks])
        parts = [np.zeros(1, OFFSETS_DTYPE)]
        base = 0
        for mask in masks:
            parts.append(mask._offsets[1:] + base)
            base += mask._ids.size
        return cls._from_trusted(ids, np.concatenate(parts))

    def prefix(self, n: int) -> RolloutSamplingMask:
        """The first ``n`` tokens, as a mask that owns a trimmed copy."""
        n = _check_index("n", n, 0, len(self))
        end = int(self._offsets[n])
        return type(self)._from_trusted(self._ids[:end].copy(), self._offsets[: n + 1].copy())

    def row(self, t: int) -> np.ndarray:
        """The support of token ``t`` (a read-only view)."""
        t = _check_index("t", t, 0, len(self) - 1)
        return self._ids[self._offsets[t] : self._offsets[t + 1]]

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, offsets)`` as the mask's own read-only numpy arrays (no copy)."""
        return self._ids, self._offsets

    def as_tensors(self) -> tuple[Any, Any]:
        """``(ids, offsets)`` as torch tensors sharing the mask's memory (no copy); do not write to them."""
        import torch

        with warnings.catch_warnings():
            # from_numpy warns that the array is not writable; sharing read-only memory is the point
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._ids), torch.from_numpy(self._offsets)

    @property
    def nbytes(self) -> int:
        """Bytes held by ids and offsets."""
        return int(self._ids.nbytes + self._offsets.nbytes)

    @property
    def num_ids(self) -> int:
        """Total support size over all tokens."""
        return int(self._ids.size)

    def to_dense(self, vocab_size: int) -> np.ndarray:
        """A bool ``[len, vocab_size]`` matrix; for tests and small cases only."""
        vocab_size = _check_index("vocab_size", vocab_size, 1, _INT32_MAX + 1)
        if self._ids.size and int(self._ids.max()) >= vocab_size:
            raise ContractError(must_be("ids", f"< vocab_size={vocab_size}", int(self._ids.max())))
        dense = np.zeros((len(self), vocab_size), dtype=bool)
        rows = np.repeat(np.arange(len(self)), np.diff(self._offsets))
        dense[rows, self._ids] = True
        return dense

    def __len__(self) -> int:
        return int(self._offsets.size - 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutSamplingMask):
            return NotImplemented
        return (
            self._ids.dtype == other._ids.dtype
            and self._offsets.dtype == other._offsets.dtype
            and np.array_equal(self._offsets, other._offsets)
            and np.array_equal(self._ids, other._ids)
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RolloutSamplingMask is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"RolloutSamplingMask is frozen: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._ids, self._offsets))

    def __copy__(self) -> RolloutSamplingMask:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RolloutSamplingMask:
        return self

    def __repr__(self) -> str:
        n = len(self)
        shown = [self.row(t).tolist() for t in range(min(n, _REPR_ROWS))]
        rows = ", ".join(map(str, shown)) + (", ..." if n > _REPR_ROWS else "")
        return f"RolloutSamplingMask(tokens={n}, ids={self._ids.size}, nbytes={self.nbytes}, rows=[{rows}])"


class SamplingMaskBuilder:
    """Accumulates rows into doubling numpy buffers; ``build()`` returns a trimmed, owned mask."""

    __slots__ = ("_ids", "_n_ids", "_offsets", "_n_rows")

    def __init__(self, capacity_ids: int = 256, capacity_rows: int = 64) -> None:
        self._ids = np.empty(max(1, int(capacity_ids)), IDS_DTYPE)
        self._offsets = np.zeros(max(1, int(capacity_rows)) + 1, OFFSETS_DTYPE)
        self._n_ids = 0
        self._n_rows = 0

    def _reserve(self, more_ids: int, more_rows: int) -> None:
        """Grow buffers geometrically so appends cost amortised O(1) per id."""
        need_ids = self._n_ids + more_ids
        if need_ids > self._ids.size:
            grown = np.empty(max(need_ids, 2 * self._ids.size), IDS_DTYPE)
            grown[: self._n_ids] = self._ids[: self._n_ids]
            self._ids = grown
        need_offsets = self._n_rows + more_rows + 1
        if need_offsets > self._offsets.size:
            grown = np.empty(max(need_offsets, 2 * self._offsets.size), OFFSETS_DTYPE)
            grown[: self._n_rows + 1] = self._offsets[: self._n_rows + 1]
            self._offsets = grown

    def _push(self, ids: np.ndarray, row_ends: np.ndarray) -> None:
        """Append validated ids and the (relative, increasing, last == len(ids)) ends of their rows."""
        self._reserve(ids.size, row_ends.size)
        self._ids[self._n_ids : self._n_ids + ids.size] = ids
        self._offsets[self._n_rows + 1 : self._n_rows + 1 + row_ends.size] = row_ends + self._n_ids
        self._n_ids += ids.size
        self._n_rows += row_ends.size

    def append_row(self, ids: Any) -> None:
        """Append the support of one token (must be non-empty)."""
        arr = _to_numpy("ids", ids)
        if arr.size == 0:
            raise ContractError(must_be("ids", "a non-empty support", []))
        _check_ids("ids", arr)
        self._push(arr, np.array([arr.size], OFFSETS_DTYPE))

    def append_rows(self, rows: Iterable[Any]) -> None:
        """Append the supports of several tokens; an empty row raises and appends nothing."""
        rows = list(rows)
        if not rows:
            return
        try:
            lengths = np.fromiter((len(r) for r in rows), dtype=OFFSETS_DTYPE, count=len(rows))
        except TypeError as exc:
            raise ContractError(must_be("rows", "a sequence of id sequences", rows[:_REPR_ROWS])) from exc
        if int(lengths.min()) == 0:
            bad = int(np.argmin(lengths))
            raise ContractError(must_be(f"rows[{bad}]", "a non-empty support", []))
        if all(isinstance(r, (list, tuple)) for r in rows):
            flat = _to_numpy("rows", list(chain.from_iterable(rows)))
        else:
            flat = np.concatenate([_to_numpy(f"rows[{i}]", r) for i, r in enumerate(rows)])
            if flat.dtype.kind not in "iu":
                raise ContractError(must_be("rows", "integers", f"dtype {flat.dtype}"))
        _check_ids("rows", flat)
        self._push(flat, np.cumsum(lengths))

    def append_forced(self, token_ids: Any) -> None:
        """Append one singleton row per token: tokens the environment inserted were not sampled."""
        arr = _to_numpy("token_ids", token_ids)
        _check_ids("token_ids", arr)
        self._push(arr, np.arange(1, arr.size + 1, dtype=OFFSETS_DTYPE))

    def extend(self, mask: RolloutSamplingMask) -> None:
        """Append every row of an existing mask."""
        if not isinstance(mask, RolloutSamplingMask):
            raise ContractError(must_be("mask", "a RolloutSamplingMask", type(mask).__name__))
        ids, offsets = mask.as_arrays()
        self._push(ids, offsets[1:])

    @property
    def num_ids(self) -> int:
        """Total support size appended so far."""
        return self._n_ids

    def __len__(self) -> int:
        return self._n_rows

    def build(self) -> RolloutSamplingMask:
        """A mask owning a trimmed copy of what was appended; the builder stays usable."""
        ids = self._ids[: self._n_ids].copy()
        offsets = self._offsets[: self._n_rows + 1].copy()
        return RolloutSamplingMask._from_trusted(ids, offsets)

    def __repr__(self) -> str:
        return f"SamplingMaskBuilder(tokens={self._n_rows}, ids={self._n_ids})"
