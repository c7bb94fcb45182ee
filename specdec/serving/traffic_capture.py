"""Capture from served traffic (issue 62): what a drafter trains on, recorded while the
target answers real requests, in a bounded store on disk.

Opt-in: only a server whose settings carry a `capture` block (config.CaptureConfig;
`specdec serve --capture DIR`) records anything. For each sampled request it keeps the
prompt and output tokens and the target's hidden states at the layers the EAGLE-3 head
reads (its three taps) and the last layer (Medusa's input, and the soft labels' source).
The taps are the ones the forward computes anyway for the served drafters, so recording
them costs a reference per step; compression and the disk write run on a thread of their
own, in numpy: a second thread running torch ops (its own OpenMP team) slowed every later
forward by a third (measured: 62 -> 38 tok/s at c=1, in process), and a full queue drops a
capture rather than slowing a request.

The store (`capture.json` describes it):
- `shard-<ns>.npz`: per sequence its tokens (int32), taps [T, 3H] and last [T, H] (fp16
  where the sequence's values fit, bf16 otherwise), and a JSON list of each one's
  prompt_len, method and salt (read_captures gives one dict per sequence, torch tensors);
- written atomically (a temporary name, then rename), at most `shard_sequences` per file,
  or after `flush_after_s` with fewer;
- rotated: past `max_bytes`, the oldest shards are deleted;
- deleting the directory deletes everything recorded (the server recreates it).

Salts: a request with a cache_salt (a tenant's scope) is recorded only when the settings
list that salt; each sequence keeps its salt, so one tenant's data can be filtered out.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import random
import threading
import time
from pathlib import Path
from typing import Hashable

import numpy as np
import torch
from torch import Tensor

from specdec.config import CaptureConfig, ModelConfig
from specdec.engine.sequences import SequenceRecord

log = logging.getLogger(__name__)

CAPTURE_FORMAT = 1
MANIFEST = "capture.json"
SHARD_GLOB = "shard-*.npz"
FP16_MAX = 65504.0


def feature_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers a capture records: the EAGLE-3 taps, then the last layer (Medusa
    heads read its output through the target's final norm); one pass feeds both heads'
    training."""
    return tuple(cfg.eagle3_tap_layers()) + (cfg.num_layers - 1,)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16's bits (uint16), rounded to nearest even, in numpy."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def encode_rows(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the values as stored, bf16?): fp16 where they fit, else bf16 (as training's compact() does in torch)."""
    if np.abs(x).max(initial=0.0) < FP16_MAX:
        return x.astype(np.float16), False
    return to_bf16_bits(x), True


def decode_rows(stored: np.ndarray, bf16: bool) -> Tensor:
    return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(stored)


def sequence_record(record: SequenceRecord, rows: list[np.ndarray], num_layers: int) -> dict | None:
    """One recorded sequence, in numpy: its taps cover positions 0 .. n-1 (the last emitted
    token has none yet), so the tokens are the first n of prompt + output."""
    hidden = np.concatenate(rows)
    ids = record.all_ids
    n = min(len(hidden), len(ids))
    if n < 2:
        return None
    H = hidden.shape[-1] // num_layers
    taps, taps_bf16 = encode_rows(hidden[:n, :-H])
    last, last_bf16 = encode_rows(hidden[:n, -H:])
    return {"tokens": np.asarray(ids[:n], dtype=np.int32), "prompt_len": len(record.prompt_ids), "taps": taps, "last": last,
            "bf16": (taps_bf16, last_bf16), "method": record.method, "salt": record.params.cache_salt}


def write_shard(path: Path, sequences: list[dict]) -> None:
    """One .npz: each sequence's arrays under its index, and a JSON list of the rest."""
    meta = [{k: s[k] for k in ("prompt_len", "method", "salt", "bf16")} for s in sequences]
    arrays = {f"{name}_{i}": s[name] for i, s in enumerate(sequences) for name in ("tokens", "taps", "last")}
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)


def read_shard(path: Path) -> list[dict]:
    with np.load(path) as z:
        return [{"tokens": torch.from_numpy(z[f"tokens_{i}"]), "taps": decode_rows(z[f"taps_{i}"], m["bf16"][0]),
                 "last": decode_rows(z[f"last_{i}"], m["bf16"][1]), "prompt_len": m["prompt_len"], "method": m["method"],
                 "salt": m["salt"]}
                for i, m in enumerate(json.loads(z["meta"].tobytes()))]


class CaptureStore:
    """The bounded directory of shards: appends, rotation, the manifest."""

    def __init__(self, config: CaptureConfig, manifest: dict):
        self.config = config
        self.directory = Path(config.directory)
        self.manifest = manifest

    def write(self, sequences: list[dict]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = self.directory / MANIFEST
        if not manifest.is_file():
            manifest.write_text(json.dumps(self.manifest, indent=2))
        path = self.directory / f"shard-{time.time_ns():020d}.npz"
        partial = path.with_suffix(".tmp")
        write_shard(partial, sequences)
        os.replace(partial, path)
        self.rotate()
        return path

    def rotate(self) -> None:
        """Delete the oldest shards until the store fits its cap (the newest always stays)."""
        shards = sorted(self.directory.glob(SHARD_GLOB))
        sizes = [p.stat().st_size for p in shards]
        total = sum(sizes)
        for path, size in zip(shards[:-1], sizes):
            if total <= self.config.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


class TrafficCapture:
    """A Speculator observer (engine/speculator.py SequenceObserver): picks requests at
    admission, collects their taps on the scheduler's thread (a reference per step), and
    hands each finished sequence to a writer thread."""

    def __init__(self, config: CaptureConfig, target_cfg: ModelConfig, target_name: str, seed: int | None = None):
        self.config = config
        self.tap_layers = feature_layers(target_cfg)
        self._rng = random.Random(seed)
        self._rows: dict[Hashable, list[np.ndarray]] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=256)
        self.store = CaptureStore(config, {
            "format": CAPTURE_FORMAT, "target": target_name, "hidden_size": target_cfg.hidden_size,
            "layers": list(self.tap_layers), "eagle3_tap_layers": list(target_cfg.eagle3_tap_layers()),
            "stored": "per sequence: tokens (prompt + output, int32), prompt_len, taps (the EAGLE-3 tap layers' outputs side by "
                      "side), last (the last layer's output), method, salt; fp16 (bf16 where fp16 overflows)",
            "delete": "remove this directory (or any shard-*.npz in it); the server recreates it",
        })
        self.captured = 0  # sequences written
        self.dropped = 0  # sequences lost to a full queue
        self._closed = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="specdec-capture", daemon=True)
        self._writer.start()

    # ---- the observer (scheduler's thread) ----------------------------------------------
    def wants(self, record: SequenceRecord) -> bool:
        return self.config.admits(record.params.cache_salt) and self._rng.random() < self.config.sample_rate

    def on_prefill(self, record: SequenceRecord, hidden: Tensor) -> None:
        if hidden is not None:  # a tensor of this step's own (the target pass copies taps out): kept by reference
            self._rows[record.seq_id] = [hidden.numpy()]

    def on_verified(self, seq_id: Hashable, hidden: Tensor) -> None:
        rows = self._rows.get(seq_id)
        if rows is not None and hidden is not None:
            rows.append(hidden.numpy())

    def on_release(self, record: SequenceRecord) -> None:
        rows = self._rows.pop(record.seq_id, None)
        if not rows:
            return
        done = SequenceRecord(record.seq_id, list(record.prompt_ids), record.params, record.method, output_ids=list(record.output_ids))
        try:
            self._queue.put_nowait((done, rows))
        except queue.Full:
            self.dropped += 1

    # ---- the writer thread ----------------------------------------------------------------
    def _write_loop(self) -> None:
        pending: list[dict] = []
        oldest = 0.0
        num_layers = len(self.tap_layers)
        while True:
            try:
                item = self._queue.get(timeout=min(1.0, self.config.flush_after_s))
            except queue.Empty:
                item = None
            if item is not None:
                record, rows = item
                features = sequence_record(record, rows, num_layers)  # numpy only: no torch op on this thread
                if features is not None:
                    if not pending:
                        oldest = time.monotonic()
                    pending.append(features)
            stopping = self._closed.is_set() and self._queue.empty()
            if pending and (len(pending) >= self.config.shard_sequences or stopping
                            or time.monotonic() - oldest >= self.config.flush_after_s):
                try:
                    self.store.write(pending)
                    self.captured += len(pending)
                except OSError as exc:  # a full or read-only disk costs the capture, never a request
                    log.warning("capture: cannot write to %s: %s", self.config.directory, exc)
                    self.dropped += len(pending)
                pending = []
            if stopping:
                return

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is pending, then stop the writer."""
        self._closed.set()
        self._writer.join(timeout_s)


def read_captures(directory: Path, salts: set[str | None] | None = None) -> list[dict]:
    """Every recorded sequence in a store, oldest shard first; `salts`: only the sequences
    recorded under these (None in it: the unsalted ones)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{directory} is not a capture store (no {MANIFEST})")
    fmt = json.loads(manifest.read_text()).get("format")
    if fmt != CAPTURE_FORMAT:
        raise ValueError(f"{directory}: capture format {fmt}, this reader reads {CAPTURE_FORMAT}")
    out = []
    for path in sorted(directory.glob(SHARD_GLOB)):
        out += [s for s in read_shard(path) if salts is None or s.get("salt") in salts]
    return out
