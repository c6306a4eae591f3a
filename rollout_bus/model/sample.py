"""The rollout sample: one prompt plus one response, with per-token training data (docs/data-model.md section 1).

Contract:

* ``Sample`` is a dataclass built with keyword arguments. ``tokens`` is prompt + response; the
  response is its last ``response_length`` tokens. Token-aligned fields (``tokens``, ``loss_mask``,
  ``rollout_log_probs``) may be any integer/float sequence or a 1-D numpy array; they are kept as
  given (the codec returns arrays). ``loss_mask=None`` means all ones.
* ``validate()`` raises ``ContractError`` (a ``ValueError``) naming the field and both lengths
  when the per-token fields disagree with ``response_length``.
* ``strip_last_output_tokens(n)`` drops the last n tokens and keeps every per-token field aligned;
  ``reset_for_retry()`` keeps identity, prompt, label and metadata and clears everything produced.
* Two samples are equal when every field is; token-aligned fields compare by value, so a list and
  an array with the same numbers are equal.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sampling_mask import RolloutSamplingMask

TOKEN_ALIGNED_FIELDS = ("tokens", "loss_mask", "rollout_log_probs", "rollout_token_versions")
_FLOAT_MAX = sys.float_info.max


@dataclass(frozen=True)
class AdapterRef:
    """The Multi-LoRA adapter a sample belongs to (``Sample.adapter=None`` means no adapter)."""

    name: str
    slot: int


class Status(str, Enum):
    """Where a sample's generation ended."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def reward_number(value: Any) -> int | float | None:
    """The one rule for which rewards count, shared by the metrics and ``train_data``.

    A bool (Python's or numpy's: a pass/fail verifier) counts as 0 or 1; an integer (numpy's
    included) as itself; any other real number when it is finite. NaN, infinities, integers too
    large for a float (the trainer's tensors would hold inf), None, strings, dicts and everything
    else do not count (None is returned): the metrics skip them and ``train_data`` gives them a NaN
    raw reward and a normalised reward of 0.
    """
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value) if abs(int(value)) <= _FLOAT_MAX else None
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def is_version_number(version: Any) -> bool:
    """A weight version is numeric when it is non-empty ASCII decimal digits ("12"; not "²" or "٣")."""
    return isinstance(version, str) and version.isascii() and version.isdigit()


def _values_equal(a: Any, b: Any) -> bool:
    """Token-aligned equality that treats lists and arrays alike (NaN equals NaN)."""
    if a is None or b is None:
        return a is None and b is None
    left, right = np.asarray(a), np.asarray(b)
    if left.shape != right.shape:
        return False
    if left.dtype.kind == "f" or right.dtype.kind == "f":
        return bool(np.array_equal(left, right, equal_nan=True))
    return bool(np.array_equal(left, right))


@dataclass(eq=False)
class Sample:
    """One prompt and its response, with everything the trainer and the metrics need."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict] = ""
    tokens: Any = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict | None = None
    loss_mask: Any = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: Any = None
    rollout_sampling_mask: RolloutSamplingMask | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    adapter: AdapterRef | None = None
    # rollout-bus's extension: per response token, the trainer weight version that generated it
    # (int64; -1 for a token the model did not generate: tool output, observations). None: unknown.
    rollout_token_versions: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            try:
                self.status = Status(self.status)
            except ValueError as exc:
                allowed = ", ".join(s.value for s in Status)
                raise ContractError(must_be("status", f"one of {allowed}", self.status)) from exc

    __hash__ = None  # mutable

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in TOKEN_ALIGNED_FIELDS:
                if not _values_equal(mine, theirs):
                    return False
            elif mine != theirs:
                return False
        return True

    @property
    def effective_response_length(self) -> int:
        """Trainable tokens: ``sum(loss_mask)``, or ``response_length`` when there is no mask."""
        if self.loss_mask is None:
            return int(self.response_length)
        return int(np.sum(np.asarray(self.loss_mask, dtype=np.int64)))

    @property
    def oldest_weight_version(self) -> int | None:
        """The smallest numeric entry (``is_version_number``) of ``weight_versions`` as an int; None if none."""
        numeric = [int(v) for v in self.weight_versions if is_version_number(v)]
        return min(numeric) if numeric else None

    def _where(self) -> str:
        return f"sample group_index={self.group_index}, index={self.index}, rollout_id={self.rollout_id}"

    def validate(self) -> None:
        """Check the per-token fields agree with ``response_length``; raise ContractError if not."""
        rl = self.response_length
        if type(rl) is not int and not _is_int(rl):
            raise ContractError(must_be("response_length", "an integer", rl, where=self._where()))
        if rl < 0:
            raise ContractError(must_be("response_length", ">= 0", rl, where=self._where()))
        if type(self.status) is not Status and not isinstance(self.status, Status):
            raise ContractError(must_be("status", "a Status", self.status, where=self._where()))
        if len(self.tokens) < rl:
            raise ContractError(
                must_be("len(tokens)", f">= response_length={rl}", len(self.tokens), where=self._where())
            )
        for name, value in (("loss_mask", self.loss_mask), ("rollout_log_probs", self.rollout_log_probs),
                            ("rollout_token_versions", self.rollout_token_versions)):
            if value is not None and len(value) != rl:
                raise ContractError(must_be(f"len({name})", f"response_length={rl}", len(value),
                                            where=self._where()))
        if self.rollout_token_versions is not None and len(self.rollout_token_versions):
            versions = np.asarray(self.rollout_token_versions)
            if versions.dtype.kind not in "iu" or (versions.dtype.kind == "u" and versions.dtype.itemsize >= 8):
                raise ContractError(must_be("rollout_token_versions", "int64 weight versions", versions.dtype,
                                            where=self._where()))
            if int(versions.min()) < -1:
                raise ContractError(must_be("rollout_token_versions", "versions >= 0, or -1 for a token not "
                                            "generated", int(versions.min()), where=self._where()))
        mask = self.rollout_sampling_mask
        if mask is not None:
            if not isinstance(mask, RolloutSamplingMask):
                raise ContractError(must_be("rollout_sampling_mask", "a RolloutSamplingMask", type(mask).__name__,
                                            where=self._where()))
            if len(mask) != rl:
                raise ContractError(
                    must_be("len(rollout_sampling_mask)", f"response_length={rl}", len(mask), where=self._where())
                )

    def strip_last_output_tokens(self, n: int, tokenizer: Any = None) -> None:
        """Drop the last ``n`` response tokens and every per-token value aligned with them.

        ``response`` text is re-decoded only when a tokenizer is given (the bus has none).
        """
        if not _is_int(n):
            raise ContractError(must_be("n", "an integer", n, where=self._where()))
        n = int(n)
        if n <= 0:
            return
        if n > self.response_length:
            raise ContractError(
                must_be("n", f"<= response_length={self.response_length}", n, where=self._where())
            )
        self.tokens = self.tokens[:-n]
        self.response_length -= n
        if self.loss_mask is not None:
            self.loss_mask = self.loss_mask[:-n]
        if self.rollout_log_probs is not None:
            self.rollout_log_probs = self.rollout_log_probs[:-n]
        if self.rollout_token_versions is not None:
            self.rollout_token_versions = self.rollout_token_versions[:-n]
        if self.rollout_sampling_mask is not None:
            self.rollout_sampling_mask = self.rollout_sampling_mask.prefix(self.response_length)
        if tokenizer is not None:
            response_tokens = self.tokens[len(self.tokens) - self.response_length :]
            self.response = tokenizer.decode(list(response_tokens))

    def reset_for_retry(self) -> None:
        """Forget everything the aborted attempt produced; keep identity, prompt, label, metadata."""
        self.tokens = []
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = None
        self.rollout_token_versions = None
        self.weight_versions = []
        self.rollout_log_probs = None
        self.rollout_sampling_mask = None
        self.remove_sample = False
        self.status = Status.ABORTED


RolloutKey = tuple[AdapterRef | None, str, int | None, Any]


def get_rollout_key(sample: Sample, position: int) -> RolloutKey:
    """The episode a sample belongs to: ``(adapter, kind, group_index, id)``, kind ``"rollout"`` with
    ``rollout_id`` when set, else ``"sample"`` with ``index``, else ``"position"`` with the sample's batch
    position. Ids are per adapter and per prompt group; on the wire it is ``wire.rollout_key``."""
    if sample.rollout_id is not None:
        return (sample.adapter, "rollout", sample.group_index, sample.rollout_id)
    if sample.index is not None:
        return (sample.adapter, "sample", sample.group_index, sample.index)
    return (sample.adapter, "position", sample.group_index, position)
