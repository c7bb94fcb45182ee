"""preprocessing: text_input -> input_ids (through the chat template unless turned off)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from specdec import protocol as P
from specdec.request import parse_prompt
from specdec.runtime import encode_prompt, load_tokenizer, resolve_model_dir
from specdec_triton.common import batched, error_response, inputs_of, load_settings


class TritonPythonModel:
    def initialize(self, args):
        self.settings = load_settings(args)
        self.tokenizer = load_tokenizer(resolve_model_dir(self.settings.model_dir))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            inputs = inputs_of(request, (P.TEXT_INPUT, P.APPLY_CHAT_TEMPLATE))
            text, _, chat = parse_prompt(inputs, self.settings.apply_chat_template)
            ids = np.asarray(encode_prompt(self.tokenizer, text, chat=chat), dtype=np.int32)
            return pb_utils.InferenceResponse([batched(P.INPUT_IDS, ids)])
        except Exception as exc:  # noqa: BLE001 - answered with the error, never a traceback
            return error_response(exc)
