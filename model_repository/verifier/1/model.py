"""verifier: the target model. Stateful per sequence (KV-cache slot keyed by CORRID).

One execute() receives the requests of many sequences (sequence batcher, `oldest`):
START requests are prefilled together in one forward, the others' draft trees are verified
together in ONE batched target forward, END requests free their slot.
"""
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from specdec import protocol as P
from specdec.errors import CapacityError, SpecDecError
from specdec.runtime import load_target, resolve_model_dir, tap_layers_for
from specdec.tree import DraftTree
from specdec.verifier import TargetVerifier
from specdec_triton.common import Metrics, array, batched, check_max_batch_size, control, error_response, load_settings, sampling_params, scalar

EMPTY_HIDDEN = np.zeros((0, 0), dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings(args)
        check_max_batch_size(args, settings)
        self.settings = settings
        target = load_target(resolve_model_dir(settings.model_dir), settings.engine)
        taps = tap_layers_for(target.cfg, settings.methods)
        self.verifier = TargetVerifier(target, settings.engine, tap_layers=taps)
        self.metrics = Metrics({"specdec_active_sequences": ("gauge", "Sequences holding a KV-cache slot")})
        self._update_gauge()

    def _update_gauge(self):
        self.metrics.set("specdec_active_sequences", self.verifier.active, model="verifier")

    def execute(self, requests):
        self.verifier.release_idle(self.settings.idle_timeout_s)
        responses = [None] * len(requests)
        starts, steps = [], []
        for i, request in enumerate(requests):
            try:
                seq_id = request.correlation_id()
                if control(request, P.CONTROL_START):
                    prompt = array(request, P.INPUT_IDS)
                    prompt = [] if prompt is None else prompt.reshape(-1).tolist()
                    self.verifier.check_prompt(prompt)
                    starts.append((i, seq_id, prompt, sampling_params(request).validate(10**9)))
                elif array(request, P.DRAFT_TOKENS) is not None or not control(request, P.CONTROL_END):
                    steps.append((i, seq_id, self._tree(request)))
            except SpecDecError as exc:
                responses[i] = error_response(exc)
        want_hidden = any(scalar(requests[i], P.RETURN_HIDDEN, False, bool) for i, *_ in starts + steps)
        if starts:
            self._prefill(requests, starts, responses, want_hidden)
        if steps:
            self._verify(requests, steps, responses, want_hidden)
        for request in requests:  # END: free the slot (after this request's own work)
            if control(request, P.CONTROL_END) and request.correlation_id() in self.verifier:
                self.verifier.release(request.correlation_id())
        self._update_gauge()
        return [r if r is not None else pb_utils.InferenceResponse([]) for r in responses]

    @staticmethod
    def _tree(request):
        tokens = array(request, P.DRAFT_TOKENS)
        if tokens is None or tokens.size == 0:
            return DraftTree()
        probs = array(request, P.DRAFT_PROBS)
        probs = torch.from_numpy(probs.reshape(tokens.size, -1).copy()) if probs is not None and probs.size else None
        return DraftTree.from_arrays(tokens.reshape(-1), array(request, P.DRAFT_PARENTS).reshape(-1), probs)

    def _prefill(self, requests, starts, responses, want_hidden):
        free = self.verifier.cache.num_free
        for i, *_ in starts[free:]:
            responses[i] = error_response(CapacityError("no free KV-cache slot (max_batch_size sequences are running)"))
        starts = starts[:free]
        outs = self.verifier.prefill([(seq_id, prompt, params) for _, seq_id, prompt, params in starts], want_hidden)
        for (i, *_), out in zip(starts, outs):
            responses[i] = self._response(requests[i], [out.first_token], 0, out.hidden)

    def _verify(self, requests, steps, responses, want_hidden):
        valid = [(i, seq_id, tree) for i, seq_id, tree in steps if seq_id in self.verifier]
        for i, seq_id, _ in steps:
            if seq_id not in self.verifier:
                responses[i] = error_response(SpecDecError(f"sequence {seq_id} has no KV-cache slot (expired or never started)"))
        outs = self.verifier.verify([(seq_id, tree) for _, seq_id, tree in valid], want_hidden)
        for (i, *_), out in zip(valid, outs):
            responses[i] = self._response(requests[i], out.result.emitted, len(out.result.accepted_nodes), out.hidden)

    @staticmethod
    def _response(request, tokens, accepted, hidden):
        wants = scalar(request, P.RETURN_HIDDEN, False, bool) and hidden is not None
        return pb_utils.InferenceResponse([
            batched(P.OUTPUT_IDS, np.asarray(tokens, dtype=np.int32)),
            batched(P.NUM_ACCEPTED, np.asarray([accepted], dtype=np.int32)),
            batched(P.HIDDEN_STATES, hidden.float().numpy() if wants else EMPTY_HIDDEN),
        ])
