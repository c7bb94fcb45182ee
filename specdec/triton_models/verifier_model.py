"""verifier: the target model and the drafters that live beside it (EAGLE-3 heads, n-gram
lookup), stateful per sequence (KV-cache slot keyed by CORRID). One call = one speculation
step (specdec.engine.step.Speculator): verify, commit, draft the next tree.

One execute() receives the requests of many sequences (sequence batcher, `oldest`): START
requests' prompts (in chunks while others decode: a START answers no tokens until its
prompt is done, and the loop sends steps to continue it) and the others' trees go through
ONE batched target forward, and every co-located drafter drafts for all of its sequences
at once; END requests free their slot.
"""
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.config import METHOD_NONE
from specdec.errors import CapacityError, InvalidRequestError, SpecDecError
from specdec.engine.sequences import check_token_ids
from specdec.triton_models.contract import decode_sampling
from specdec.serving.runtime import build_colocated_speculator
from specdec.engine.step import StartItem, StepItem
from specdec.engine.tree import DraftTree
from specdec.triton_models.common import (
    HeapTrimmer, Metrics, array, batched, check_max_batch_size, control, error_response, from_the_loop, internal_key, load_settings, refused,
    scalar, strings,
)

class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings(args)
        check_max_batch_size(args, settings)
        self.settings = settings
        self.speculator = build_colocated_speculator(settings)
        self.key = internal_key()
        self.heap = HeapTrimmer()
        self.metrics = Metrics(P.VERIFIER_METRICS)
        self._planner_published = 0.0
        self._update_gauge()

    def _update_gauge(self):
        self.metrics.set(P.ACTIVE_SEQUENCES, self.speculator.active, model="verifier")
        if self.speculator.adaptive and time.monotonic() - self._planner_published > 1.0:  # beliefs move slowly
            self._planner_published = time.monotonic()
            planner = self.speculator.planner
            for method in self.speculator.adaptive:
                depth = self.settings.methods[method].max_draft_len
                for position, rate in enumerate(planner.position_estimates(method, depth), start=1):
                    self.metrics.set(P.ACCEPTANCE_ESTIMATE, round(rate, 4), method=method, position=str(position))
            self.metrics.set(P.PLANNED_TOKENS_PER_SECOND, round(planner.tokens_per_second, 2))

    def execute(self, requests):
        self.speculator.release_idle(self.settings.idle_timeout_s)
        self.heap.maybe_trim()
        responses = [None] * len(requests)
        starts, steps = [], []
        allowed = [from_the_loop(request, self.key) for request in requests]
        for i, request in enumerate(requests):
            if not allowed[i]:  # refused without touching any sequence's state
                responses[i] = refused()
                continue
            try:
                seq_id = request.correlation_id()
                want_hidden = scalar(request, C.RETURN_HIDDEN, False, bool)
                if control(request, C.CONTROL_START):
                    starts.append((i, self._start_item(request, seq_id, want_hidden)))
                elif array(request, C.DRAFT_TOKENS) is not None or not control(request, C.CONTROL_END):
                    if seq_id not in self.speculator:
                        raise SpecDecError(f"sequence {seq_id} has no KV-cache slot (expired or never started)")
                    steps.append((i, StepItem(seq_id, self._tree(request), want_hidden)))
            except SpecDecError as exc:
                responses[i] = error_response(exc)
        free = self.speculator.target_pass.cache.num_free
        for i, _ in starts[free:]:
            responses[i] = error_response(CapacityError("no free KV-cache slot (max_batch_size sequences are running)"))
        if starts[:free] or steps:
            self._run(starts[:free], steps, responses)
        for request, ok in zip(requests, allowed):  # END: free the slot (after this request's own work)
            if ok and control(request, C.CONTROL_END) and request.correlation_id() in self.speculator:
                self.speculator.release(request.correlation_id())
        self._update_gauge()
        return [r if r is not None else pb_utils.InferenceResponse([]) for r in responses]

    def _start_item(self, request, seq_id, want_hidden):
        prompt = array(request, P.INPUT_IDS)
        prompt = [] if prompt is None else prompt.reshape(-1).tolist()
        self.speculator.target_pass.check_prompt(prompt)
        method = (strings(request, P.SPECULATIVE_METHOD) or [METHOD_NONE])[0] or METHOD_NONE
        self.speculator.check_method(method)
        params = decode_sampling(lambda name: array(request, name)).validate(self.settings.engine.max_tokens_limit)
        vocab = self.speculator.target_pass.target.cfg.vocab_size
        check_token_ids(C.END_IDS, params.end_ids, vocab)  # before they index a batch's logits
        check_token_ids(C.BAD_WORDS_IDS, [t for word in params.bad_word_ids for t in word], vocab)
        num_draft_tokens = self._check_budget(scalar(request, C.NUM_DRAFT_TOKENS, 0, int))
        return StartItem(seq_id, prompt, params, method, num_draft_tokens, want_hidden)

    def _run(self, starts, steps, responses):
        """One Speculator call (one target forward) for every item; a failure answers each of
        its requests. A start whose prompt is not finished answers no tokens yet."""
        try:
            first, results = self.speculator.run([item for _, item in starts], [item for _, item in steps])
        except SpecDecError as exc:
            for i, _ in (*starts, *steps):
                responses[i] = error_response(exc)
            return
        for (i, _), res in zip((*starts, *steps), (*first, *results)):
            stats = np.float32([getattr(res, field) for field in C.STEP_STATS_FIELDS])
            outputs = [batched(P.OUTPUT_IDS, np.asarray(res.emitted, dtype=np.int32)), batched(C.STEP_STATS, stats)]
            if res.hidden is not None:  # only for a drafter served apart: most steps send two small tensors
                outputs.append(batched(C.HIDDEN_STATES, res.hidden.float().numpy()))
            if res.log_probs is not None:
                outputs.append(batched(P.OUTPUT_LOG_PROBS, np.float32(res.log_probs)))
            responses[i] = pb_utils.InferenceResponse(outputs)

    def _tree(self, request):
        """A tree drafted apart (the drafter model), or None: the co-located drafter's.
        Checked here, per request, so a malformed one never reaches the batch."""
        tokens = array(request, C.DRAFT_TOKENS)
        if tokens is None:
            return None
        if tokens.size == 0:
            return DraftTree()
        parents = array(request, C.DRAFT_PARENTS)
        if parents is None or parents.size != tokens.size:
            raise InvalidRequestError(C.DRAFT_PARENTS, "one parent per draft token")
        probs = array(request, C.DRAFT_PROBS)
        if probs is not None and probs.size and probs.size % tokens.size:
            raise InvalidRequestError(C.DRAFT_PROBS, f"must have one row per draft token, got {probs.size} values")
        probs = torch.from_numpy(probs.reshape(tokens.size, -1).copy()) if probs is not None and probs.size else None
        try:
            tree = DraftTree.from_arrays(tokens.reshape(-1), parents.reshape(-1), probs)
        except ValueError as exc:
            raise InvalidRequestError(C.DRAFT_PARENTS, str(exc)) from None
        return self._check_tree(tree)

    def _check_tree(self, tree: DraftTree) -> DraftTree:
        """A tree from outside (a drafter served apart) must fit the budget and the
        vocabulary before it joins a batch: a bad one is refused alone, naming the field."""
        limit, vocab = self.speculator.config.max_num_draft_tokens, self.speculator.target_pass.target.cfg.vocab_size
        if len(tree) > limit:
            raise InvalidRequestError(C.DRAFT_TOKENS, f"at most {limit} draft tokens (max_num_draft_tokens), got {len(tree)}")
        if tree.tokens and not (0 <= min(tree.tokens) and max(tree.tokens) < vocab):
            raise InvalidRequestError(C.DRAFT_TOKENS, f"token ids must be in [0, {vocab})")
        if tree.draft_probs is not None and tuple(tree.draft_probs.shape) != (len(tree), vocab):
            raise InvalidRequestError(C.DRAFT_PROBS, f"must have shape [{len(tree)}, {vocab}], got {list(tree.draft_probs.shape)}")
        return tree

    def _check_budget(self, num_draft_tokens: int) -> int:
        limit = self.speculator.config.max_num_draft_tokens
        if not 0 <= num_draft_tokens <= limit:
            raise InvalidRequestError(C.NUM_DRAFT_TOKENS, f"must be in [0, {limit}] (max_num_draft_tokens), got {num_draft_tokens}")
        return num_draft_tokens
