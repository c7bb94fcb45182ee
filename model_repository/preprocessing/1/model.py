"""preprocessing: text_input -> input_ids (through the chat template unless turned off)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from specdec import protocol as P
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.runtime import encode_prompt, load_tokenizer, resolve_model_dir
from specdec_triton.common import batched, error_response, load_settings, scalar, strings


class TritonPythonModel:
    def initialize(self, args):
        self.settings = load_settings(args)
        self.tokenizer = load_tokenizer(resolve_model_dir(self.settings.model_dir))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            texts = strings(request, P.TEXT_INPUT)
            if len(texts) != 1:
                raise InvalidRequestError(P.TEXT_INPUT, f"expected one prompt, got {len(texts)}")
            if not texts[0].strip():
                raise InvalidRequestError(P.TEXT_INPUT, "the prompt is empty")
            chat = scalar(request, P.APPLY_CHAT_TEMPLATE, self.settings.apply_chat_template, bool)
            ids = np.asarray(encode_prompt(self.tokenizer, texts[0], chat=chat), dtype=np.int32)
            return pb_utils.InferenceResponse([batched(P.INPUT_IDS, ids)])
        except SpecDecError as exc:
            return error_response(exc)
