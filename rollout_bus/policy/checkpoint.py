"""Policy checkpoints: safetensors files written atomically and named by their sha256.

Weights travel by reference: the trainer writes ``policy-v{version:06d}.safetensors`` and publishes
its path, size and sha256 on rollout.weights; a generator loads it between engine calls. A file whose
bytes do not hash to the published sha256 (a torn copy, a wrong mount, a tampered file) is refused
by name and the generator keeps the weights it has: never trust a checkpoint you cannot verify.

Contract:

* ``save_checkpoint(model, directory, version, step)`` -> ``CheckpointRef(path, version, step, sha256,
  bytes)``: the state dict (the tied unembedding once) with one safetensors metadata key,
  ``rollout_bus``, holding the JSON of ``format``, ``config`` (the ``LlamaConfig`` as JSON), ``version``
  and ``step`` (keys sorted: the same weights give the same bytes); written to a temporary file,
  fsync'd, renamed.
* ``read_checkpoint(path, sha256=None, device=None)`` -> ``(model, metadata)``; with ``sha256`` the file's
  digest must match, else ``CheckpointError`` naming the file and both digests (``problem``: ``sha256
  mismatch (...)``); an absent file is one whose ``problem`` is ``missing``. A file that is not such a
  checkpoint is a ``CheckpointError`` too.
* ``checkpoint_path(directory, version)``: where version ``version`` is written.
* ``load_policy(path, sha256=None, device=None)``: just the model (the public API's way in).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_bus.errors import ContractError
from rollout_bus.model.files import write_atomic
from rollout_bus.policy.model import model_from_config

FORMAT = "rollout-bus-policy/1"
_TIED = "lm_head.weight"
_META_KEY = "rollout_bus"


class CheckpointError(ContractError):
    """A checkpoint that is not what was published, or not a checkpoint at all: ``problem`` says what, in words
    a log line can put after the version and its URI (``missing``, ``sha256 mismatch ...``)."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}")
        self.path, self.problem = str(path), problem


@dataclass(frozen=True)
class CheckpointRef:
    """Where a version's weights are, and how to know them."""

    path: Path
    version: int
    step: int
    sha256: str
    bytes: int


def checkpoint_path(directory: str | Path, version: int) -> Path:
    return Path(directory) / f"policy-v{int(version):06d}.safetensors"


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_checkpoint(model: LlamaForCausalLM, directory: str | Path, version: int, step: int) -> CheckpointRef:
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()
             if not (k == _TIED and model.config.tie_word_embeddings)}
    metadata = {"format": FORMAT, "config": model.config.to_json_string(use_diff=False), "version": str(int(version)),
                "step": str(int(step))}
    # one metadata key: safetensors writes a metadata map in no fixed order, and the same weights must make
    # the same file (a version published twice is one sha256)
    data = save_tensors(state, metadata={_META_KEY: json.dumps(metadata, sort_keys=True)})
    path = checkpoint_path(directory, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return CheckpointRef(path, int(version), int(step), hashlib.sha256(data).hexdigest(), len(data))


def _metadata(data: bytes, path: Path) -> dict[str, str]:
    try:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_len])
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"not a safetensors file ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    try:
        meta = json.loads(meta[_META_KEY]) if isinstance(meta, dict) and _META_KEY in meta else {}
    except (ValueError, TypeError) as exc:
        raise CheckpointError(path, f"metadata {_META_KEY!r} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise CheckpointError(path, f"format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_checkpoint(path: str | Path, sha256: str | None = None,
                    device: torch.device | str | None = None) -> tuple[LlamaForCausalLM, dict[str, str]]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read ({exc.strerror or exc})") from None
    if sha256 is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise CheckpointError(path, f"sha256 mismatch (the file's {digest} does not match the published "
                                        f"{sha256})")
    meta = _metadata(data, path)
    try:
        state = load_tensors(data)
        model = model_from_config(LlamaConfig.from_dict(json.loads(meta["config"])), device)
    except (SafetensorError, KeyError, ValueError) as exc:
        raise CheckpointError(path, f"unreadable ({exc})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not (k == _TIED and model.config.tie_word_embeddings)]:
        raise CheckpointError(path, f"tensors missing {missing} or unexpected {unexpected}")
    model.tie_weights()
    return model, meta


def load_policy(path: str | Path, sha256: str | None = None, device: torch.device | str | None = None) -> torch.nn.Module:
    """The policy of checkpoint ``path`` (verified against ``sha256`` when given): a ``LlamaForCausalLM``
    whose forward maps input ids ``[B, T]`` to logits ``[B, T, V]``. The public way in
    (``rollout_bus.load_policy``)."""
    return read_checkpoint(path, sha256, device)[0]
