"""Benchmark: the wire codec against a cold memory copy and against pickle, side by side.

One realistic turn (a prompt of a few hundred tokens, 4,096 response tokens, log-probs, a loss
mask, and a sampling mask whose supports hold 1-64 ids, about 8 on average) is encoded and
decoded with the mask fields on. In the same loop, interleaved so that all three see the same
machine state, we time:

* copy: one ``np.copyto`` of as many bytes as the payload, from sources cycled through >= 256 MB
  of distinct memory, so the source is not in cache (the floor any codec must pay once);
* pickle: protocol-5 ``dumps`` + ``loads`` of the same Sample (the unsafe alternative).

The three run in a rotating order within each repetition. Reports medians (and 10th percentiles,
steadier on a shared machine) and ``copy_ratio = copy / codec`` (target >= 0.25) and
``pickle_ratio = pickle / codec`` (target >= 1.5). Run:
``.venv/bin/python bench/codec.py [--reps 2000] [--response-tokens 4096] [--chars-per-token 4]``.
The text (prompt and response strings) travels in the JSON document; the codec writes long
texts without escaping and cuts long responses out before parsing, so text costs it about a copy
and one scan each way rather than CPython's ~4 ns a character of JSON string escaping.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import numpy as np

from rollout_bus.wire.codec import COMPUTED_FIELDS, SAMPLING_MASK_FIELDS, decode_samples, encode_samples
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask

FIELDS = COMPUTED_FIELDS + SAMPLING_MASK_FIELDS
COLD_BYTES = 256 * 1024 * 1024


def make_turn(rng: np.random.Generator, prompt_tokens: int, response_tokens: int, as_lists: bool,
              chars_per_token: int = 4) -> Sample:
    """A turn as a generator would publish it (numpy arrays, or plain lists with ``as_lists``).

    Its text has ``chars_per_token`` characters per token (about 4 for English under BPE).
    """
    tokens = rng.integers(0, 150_000, prompt_tokens + response_tokens, dtype=np.int64)
    support = np.clip(rng.geometric(1 / 8, response_tokens), 1, 64)
    offsets = np.concatenate([[0], np.cumsum(support)]).astype(np.int64)
    ids = rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32)
    loss_mask = (rng.random(response_tokens) > 0.1).astype(np.uint8)
    log_probs = np.log(rng.random(response_tokens))
    convert = (lambda a: a.tolist()) if as_lists else (lambda a: a)
    return Sample(
        group_index=17, index=4242, rollout_id=4242, prompt=[{"role": "user", "content": "solve " * (prompt_tokens * chars_per_token // 6)}],
        tokens=convert(tokens), response="word " * (response_tokens * chars_per_token // 5), response_length=response_tokens, label="42",
        reward=1.0, loss_mask=convert(loss_mask), weight_versions=["12", "12", "13"],
        rollout_log_probs=convert(log_probs), rollout_sampling_mask=RolloutSamplingMask(ids, offsets),
        status=Status.COMPLETED, metadata={"turn": 3, "tool_calls": 2}, adapter=AdapterRef("math", 1),
    )


def _timed(fn) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def run(reps: int, prompt_tokens: int, response_tokens: int, as_lists: bool, chars_per_token: int) -> dict:
    rng = np.random.default_rng(0)
    sample = make_turn(rng, prompt_tokens, response_tokens, as_lists, chars_per_token)
    payload = encode_samples([sample], FIELDS)
    nbytes = len(payload)
    slots = max(2, COLD_BYTES // nbytes)
    cold = np.ones(slots * nbytes, dtype=np.uint8)  # written once, so every page is really there
    dst = np.empty(nbytes, dtype=np.uint8)

    def codec() -> None:
        decode_samples(encode_samples([sample], FIELDS), FIELDS)

    def pickled() -> None:
        pickle.loads(pickle.dumps(sample, protocol=5))

    for _ in range(50):  # warm up code paths, not data
        codec()
        pickled()
    times: dict[str, list[int]] = {"codec": [], "copy": [], "pickle": []}
    order = list(times)
    for k in range(reps):
        src = cold[(k % slots) * nbytes:(k % slots + 1) * nbytes]
        work = {"copy": lambda: np.copyto(dst, src), "codec": codec, "pickle": pickled}
        for name in order[k % 3:] + order[:k % 3]:  # rotate, so none always runs after the same one
            times[name].append(_timed(work[name]))
    result = {"sample_holds": "lists" if as_lists else "numpy arrays",
              "text_chars": len(sample.response) + len(sample.prompt[0]["content"]), "payload_bytes": nbytes}
    for stat, pick in (("median", statistics.median), ("p10", lambda v: sorted(v)[len(v) // 10])):
        us = {name: pick(values) / 1000 for name, values in times.items()}
        result[stat] = {"codec_us": round(us["codec"], 1), "copy_us": round(us["copy"], 1),
                        "pickle_us": round(us["pickle"], 1), "copy_ratio": round(us["copy"] / us["codec"], 3),
                        "pickle_ratio": round(us["pickle"] / us["codec"], 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--response-tokens", type=int, default=4096)
    parser.add_argument("--chars-per-token", type=int, default=4, help="text length; 0 sends no text")
    args = parser.parse_args()
    for as_lists in (False, True):
        result = run(args.reps, args.prompt_tokens, args.response_tokens, as_lists, args.chars_per_token)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
