"""drafter: the drafting methods served apart from the target (specdec.json `colocated:
false`; co-located ones run inside the verifier). Stateful per sequence (keyed by CORRID).

START carries the prompt + first token (and the target's hidden states for EAGLE); later
requests carry what the verifier emitted since the last call. Every request except END
returns the next draft tree; the trees of all sequences in one execute() are proposed
together (one batched call per method).
"""
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.engine.drafters.service import DraftService
from specdec.engine.sequences import SequenceRecord
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.triton_models.contract import decode_sampling
from specdec.engine.models.loading import read_model_config
from specdec.config import resolve_model_dir
from specdec.serving.heap import HeapTrimmer
from specdec.serving.runtime import build_drafters, colocated_methods, handed_tap_layers
from specdec.triton_models.common import (
    Metrics, array, batched, check_max_batch_size, control, error_response, from_the_loop, internal_key, load_settings,
    refused, scalar, strings,
)

EMPTY_PROBS = np.zeros((0, 0), dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings(args)
        check_max_batch_size(args, settings)
        self.settings = settings
        model_dir = resolve_model_dir(settings.model_dir)
        target_cfg = read_model_config(model_dir)
        # The verifier hands over the union of every served drafter's layers (one forward taps them).
        self.drafts = DraftService(build_drafters(target_cfg, colocated_methods(settings, False), settings.engine, model_dir),
                                   hidden_layers=handed_tap_layers(settings, target_cfg))
        self.key = internal_key()
        self.heap = HeapTrimmer()
        self.metrics = Metrics({P.ACTIVE_SEQUENCES: ("gauge", "Sequences holding drafter state")})
        self.metrics.set(P.ACTIVE_SEQUENCES, 0, model="drafter")

    def execute(self, requests):
        self.drafts.release_idle(self.settings.idle_timeout_s)
        self.heap.maybe_trim()
        responses = [None] * len(requests)
        proposing = []
        allowed = [from_the_loop(request, self.key) for request in requests]
        for i, request in enumerate(requests):
            seq_id = request.correlation_id()
            if not allowed[i]:  # refused without touching any sequence's state
                responses[i] = refused()
                continue
            try:
                if control(request, C.CONTROL_START):
                    self._start(seq_id, request)
                elif array(request, P.INPUT_IDS) is not None:
                    emitted = array(request, P.INPUT_IDS).reshape(-1).tolist()
                    self.drafts.advance(seq_id, emitted, scalar(request, C.NUM_ACCEPTED, 0, int), self._hidden(request))
                if not control(request, C.CONTROL_END):
                    proposing.append((i, seq_id, scalar(request, C.NUM_DRAFT_TOKENS, 0, int)))
            except SpecDecError as exc:
                responses[i] = error_response(exc)
        if proposing:
            trees = self.drafts.propose([(seq_id, budget) for _, seq_id, budget in proposing])
            for (i, *_), tree in zip(proposing, trees):
                probs = EMPTY_PROBS if tree.draft_probs is None else tree.draft_probs.float().numpy()
                responses[i] = pb_utils.InferenceResponse([
                    batched(C.DRAFT_TOKENS, np.asarray(tree.tokens, dtype=np.int32)),
                    batched(C.DRAFT_PARENTS, np.asarray(tree.parents, dtype=np.int32)),
                    batched(C.DRAFT_PROBS, probs),
                ])
        for request, ok in zip(requests, allowed):
            if ok and control(request, C.CONTROL_END) and request.correlation_id() in self.drafts:
                self.drafts.release(request.correlation_id())
        self.metrics.set(P.ACTIVE_SEQUENCES, self.drafts.active, model="drafter")
        return [r if r is not None else pb_utils.InferenceResponse([]) for r in responses]

    def finalize(self):
        self.metrics.close()

    def _start(self, seq_id, request):
        ids = array(request, P.INPUT_IDS)
        if ids is None or ids.size < 2:
            raise InvalidRequestError(P.INPUT_IDS, "START needs the prompt followed by the first generated token")
        ids = ids.reshape(-1).tolist()
        method = (strings(request, P.SPECULATIVE_METHOD) or [""])[0]
        params = decode_sampling(lambda name: array(request, name))
        self.drafts.start(SequenceRecord(seq_id, ids[:-1], params, method, output_ids=ids[-1:]), self._hidden(request))

    @staticmethod
    def _hidden(request):
        hidden = array(request, C.HIDDEN_STATES)
        if hidden is None or hidden.size == 0:
            return None
        return torch.from_numpy(hidden.reshape(-1, hidden.shape[-1]).copy())
