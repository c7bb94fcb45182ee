"""The one shared helper of the Triton Python models: settings, tensor I/O, errors and
metrics (requests are parsed by specdec.serving.request.parse_request). Imported only inside Triton (it needs pb_utils)."""
from __future__ import annotations

import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.config import ServingConfig, team_size
from specdec.errors import ConfigError, InvalidRequestError
from specdec.serving.placement import CoreSplit, pin_process, planned_split

SETTINGS_FILE = "specdec.json"


def load_settings(args: dict[str, Any]) -> ServingConfig:
    """The repository-wide settings file next to the model directories; a model's
    config.pbtxt may point elsewhere with parameter `settings_file`."""
    model_config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    default = Path(args["model_repository"]).resolve().parent / SETTINGS_FILE
    path = Path(os.environ.get("SPECDEC_SETTINGS", params.get("settings_file") or default))
    settings = ServingConfig.from_file(path)
    import torch

    global _core_split
    split = _core_split = engine_core_split(settings)
    if split is not None:  # this stub's threads off the forward's cores; the engine host's scheduler moves back onto them
        pin_process(split.rest)
    threads = team_size(settings.threads, model_config["name"], torch.get_num_threads())
    if split is not None:  # no more threads than the cores it has left
        threads = min(threads or torch.get_num_threads(), len(split.rest))
    if threads:
        torch.set_num_threads(threads)
    logging.getLogger("specdec").info("%s: settings from %s%s", model_config["name"], path,
                                      f"; cores {sorted(split.rest)} (the forward's: {sorted(split.forward)})" if split else "")
    return settings


_core_split: CoreSplit | None = None  # this stub process's, set once by load_settings (one model per stub)


def engine_core_split(settings: ServingConfig) -> CoreSplit | None:
    """The forward's cores and the rest's (specdec.serving.placement), for the engine host's
    team of `threads.verifier` (torch's default where unset), or None."""
    import torch

    default = torch.get_num_threads()
    return planned_split(settings, team_size(settings.threads, C.VERIFIER_THREADS, default) or default)


def core_split() -> CoreSplit | None:
    """This stub's split (the engine host's scheduler thread builds the engine and runs every
    forward on `forward`), or None where nothing is pinned."""
    return _core_split


def check_max_batch_size(args: dict[str, Any], settings: ServingConfig) -> None:
    """The sequence batcher and the KV-cache slots must agree, or sequences would queue
    for slots that do not exist (or slots would sit idle)."""
    model_config = json.loads(args["model_config"])
    if model_config["max_batch_size"] != settings.engine.max_batch_size:
        raise ConfigError(
            "max_batch_size",
            f"{model_config['name']}/config.pbtxt has {model_config['max_batch_size']} but specdec.json has "
            f"engine.max_batch_size={settings.engine.max_batch_size}",
        )


# ---- tensor I/O ----------------------------------------------------------------------
def array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def scalar(request, name: str, default: Any, cast=lambda v: v) -> Any:
    value = array(request, name)
    if value is None:
        return default
    if value.size != 1:
        raise InvalidRequestError(name, f"expected one value, got shape {list(value.shape)}")
    return cast(value.reshape(-1)[0])


def strings(request, name: str) -> list[str]:
    value = array(request, name)
    if value is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in value.reshape(-1)]


def inputs_of(request, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """name -> array (None when absent): what specdec.serving.request.parse_request reads."""
    return {name: array(request, name) for name in names}


def batched(name: str, value: np.ndarray) -> "pb_utils.Tensor":
    """A tensor for a model with max_batch_size > 0: one request = batch of one."""
    return pb_utils.Tensor(name, np.ascontiguousarray(value)[None])


def text_tensor(name: str, text: str) -> "pb_utils.Tensor":
    return batched(name, np.array([text.encode("utf-8")], dtype=np.object_))


def control(request, name: str) -> bool:
    value = array(request, name)
    return bool(value is not None and value.reshape(-1)[0])


def internal_key() -> bytes | None:
    """The per-server secret `specdec serve` puts in the environment (None: not set, e.g. a
    plain `tritonserver` start; the internal models then accept any caller)."""
    key = os.environ.get(C.INTERNAL_KEY_ENV)
    return key.encode() if key else None


def _carries(request, name: str, key: bytes) -> bool:
    """The request's `name` input holds `key` (compared in constant time)."""
    sent = array(request, name)
    value = sent.reshape(-1)[0] if sent is not None and sent.size == 1 else b""
    return hmac.compare_digest(value if isinstance(value, bytes) else str(value).encode(), key)


def from_the_loop(request, key: bytes | None) -> bool:
    """A call to an internal model carries the secret (compared in constant time)."""
    return key is None or _carries(request, C.INTERNAL_KEY, key)


def from_an_admin(request) -> bool:
    """An administrative request carries the server's admin key (P.ADMIN_KEY_ENV, which
    `specdec serve` always sets); where none is set, no request is an admin's."""
    key = os.environ.get(P.ADMIN_KEY_ENV)
    return bool(key) and _carries(request, P.ADMIN_KEY, key.encode())


def refused() -> "pb_utils.InferenceResponse":
    return error_response(PermissionError("the verifier and the drafter serve the speculative loop only"))


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))


# ---- metrics --------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics on Triton's metrics port (pb_utils.MetricFamily), one metric per
    label set, created lazily. Every metric update is a round trip from the stub to the
    server process, so counter increments are summed and histogram observations queued
    here and sent at most every `flush_every_s` (and on flush()); gauges are sent only when
    they change."""

    KINDS = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}

    def __init__(self, families: dict[str, tuple], flush_every_s: float = 0.25):
        # families: name -> (kind "counter" | "gauge" | "histogram", help[, buckets])
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=spec[1], kind=getattr(pb_utils.MetricFamily, self.KINDS[spec[0]]))
            for name, spec in families.items()
        }
        self._buckets = {name: [float(b) for b in spec[2]] for name, spec in families.items() if spec[0] == "histogram"}
        self._metrics: dict[tuple, Any] = {}
        self._pending: dict[tuple, float] = {}  # (name, labels) -> increment not yet sent
        self._observed: list[tuple[tuple, float]] = []  # (name, labels), value: not yet sent
        self._gauges: dict[tuple, float] = {}
        self._flush_every_s = flush_every_s
        self._last_flush = time.monotonic()

    def _metric(self, name: str, labels: dict[str, str]):
        key = (name, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            extra = {"buckets": self._buckets[name]} if name in self._buckets else {}
            metric = self._metrics[key] = self._families[name].Metric(labels=labels, **extra)
        return metric

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if value:
            key = (name, tuple(sorted(labels.items())))
            self._pending[key] = self._pending.get(key, 0.0) + value
            self._maybe_flush()

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._observed.append(((name, tuple(sorted(labels.items()))), value))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush > self._flush_every_s:
            self.flush()

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        observed, self._observed = self._observed, []
        for (name, labels), value in pending.items():
            self._metric(name, dict(labels)).increment(value)
        for (name, labels), value in observed:
            self._metric(name, dict(labels)).observe(value)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Send what is pending and release every metric while the stub still runs (from the
        model's finalize). A MetricFamily left to the interpreter's exit is destroyed after the
        stub's shared memory is gone, and its destructor's message there segfaulted the stub on
        every shutdown (read in a verifier's stack: ~MetricFamily -> SaveToSharedMemory)."""
        self.flush()
        self._metrics.clear()
        self._families.clear()

    def set(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        if self._gauges.get(key) != value:
            self._gauges[key] = value
            self._metric(name, labels).set(value)


