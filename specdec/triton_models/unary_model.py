"""`ensemble_unary`: the ensemble's contract for unary clients (gRPC ModelInfer, HTTP
infer: tritonclient's `.infer`, perf_analyzer without --streaming).

Triton (2.51, and the ensemble scheduler over a decoupled step alike) refuses unary
inference on a decoupled model ("ModelInfer RPC doesn't support models with decoupled
transaction policy"), and a model's transaction policy is per name, so `ensemble` (which
streams) cannot also answer unary calls. This twin is the same loop, non-decoupled: each
request gets exactly one response with the final flag through its response sender (the
Python backend allows that in default mode), and `execute` returns at once so requests
overlap as they do on `ensemble` (an `async def execute` would block a non-decoupled
model's stub until the whole batch finished).
"""
import asyncio
import threading

import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.errors import InvalidRequestError
from specdec.triton_models import loop_model
from specdec.triton_models.common import error_response, scalar


class TritonPythonModel(loop_model.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self._event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._event_loop.run_forever, name="unary-loop", daemon=True)
        self._thread.start()
        self._inflight = set()

    def execute(self, requests):
        unary = []
        for request in requests:
            try:
                if scalar(request, P.STREAM, False, bool):
                    raise InvalidRequestError(P.STREAM, f"{P.ENSEMBLE_UNARY} answers with one response; stream from `ensemble`")
            except InvalidRequestError as exc:
                request.get_response_sender().send(error_response(exc), flags=loop_model.FINAL)
                continue
            unary.append(request)
        if unary:  # the loop model's own execute, on this model's event-loop thread
            future = asyncio.run_coroutine_threadsafe(super().execute(unary), self._event_loop)
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)
        return None

    def finalize(self):
        for future in list(self._inflight):
            try:
                future.result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - draining; each request already got its final response
                pb_utils.Logger.log_warn(f"{P.ENSEMBLE_UNARY}: {exc}")
        self._event_loop.call_soon_threadsafe(self._event_loop.stop)
        self._thread.join(timeout=10)
        super().finalize()
