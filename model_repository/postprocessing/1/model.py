"""postprocessing: the loop's final text delta -> text_output, plus TensorRT-LLM's perf
metrics (acceptance_rate, total_accepted_draft_tokens, total_draft_tokens) on request.

Detokenisation itself is incremental and happens in speculative_loop: stop strings must be
matched on text where generation is stopped, so the loop sends only final, whole-character
text; this model shapes it into the ensemble's outputs."""
import numpy as np
import triton_python_backend_utils as pb_utils

from specdec import protocol as P
from specdec_triton.common import batched, scalar, text_tensor


class TritonPythonModel:
    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        text = pb_utils.get_input_tensor_by_name(request, P.TEXT_DELTA).as_numpy().reshape(-1)[0]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        outputs = [text_tensor(P.TEXT_OUTPUT, text)]
        if scalar(request, P.RETURN_PERF_METRICS, False, bool):
            counts = {name: scalar(request, name, 0, int) for name, *_ in P.PERF_COUNTS}
            drafted = counts[P.TOTAL_DRAFT_TOKENS]
            rate = counts[P.TOTAL_ACCEPTED_DRAFT_TOKENS] / drafted if drafted else 0.0
            outputs.append(batched(P.ACCEPTANCE_RATE, np.array([rate], dtype=np.float32)))
            outputs += [batched(name, np.array([value], dtype=np.int32)) for name, value in counts.items()]
        return pb_utils.InferenceResponse(outputs)
