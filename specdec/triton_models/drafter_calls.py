"""The verifier's calls to the `drafter` model (methods served apart, `colocated: false`) for
one sequence: BLS requests under the sequence's correlation id, START with the prompt and
first token, then what the verifier committed since the last call, END when it is done.
The scheduler asks every such sequence at once each round; the drafter's sequence batcher
puts them into one execute, which proposes all their trees in one batched call."""
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.engine.speculator import StepResult
from specdec.engine.tree import DraftTree
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.triton_models import contract as C
from specdec.triton_models.common import batched
from specdec.triton_models.contract import encode_sampling

START, END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
DRAFT_OUT = [C.DRAFT_TOKENS, C.DRAFT_PARENTS, C.DRAFT_PROBS]


class DrafterCalls:
    """start_drafter / draft / release, as serving.drafter_apart's DrafterApart calls them."""

    def __init__(self, cid: int, key: bytes | None, vocab_size: int, max_draft_tokens: int):
        self.cid = cid
        self.key = None if key is None else np.array([key], dtype=np.object_)
        self.vocab_size, self.max_draft_tokens = vocab_size, max_draft_tokens

    async def _call(self, inputs, outputs, flags=0):
        if self.key is not None:
            inputs = {**inputs, C.INTERNAL_KEY: self.key}
        request = pb_utils.InferenceRequest(
            model_name="drafter", inputs=[batched(k, v) for k, v in inputs.items()], requested_output_names=outputs,
            correlation_id=self.cid, flags=flags,
        )
        response = await request.async_exec()
        if response.has_error():
            raise SpecDecError(response.error().message())
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0] for name in outputs}

    def _tree(self, out) -> DraftTree:
        """The drafter's answer as a tree, checked before it can join a batch: a bad one
        fails its own sequence only, naming the field."""
        probs = out[C.DRAFT_PROBS]
        try:
            tree = DraftTree.from_arrays(out[C.DRAFT_TOKENS], out[C.DRAFT_PARENTS],
                                         torch.from_numpy(probs.copy()) if probs.size else None)
        except ValueError as exc:
            raise InvalidRequestError(C.DRAFT_PARENTS, str(exc)) from None
        if len(tree) > self.max_draft_tokens:
            raise InvalidRequestError(C.DRAFT_TOKENS, f"at most {self.max_draft_tokens} draft tokens, got {len(tree)}")
        if tree.tokens and not (0 <= min(tree.tokens) and max(tree.tokens) < self.vocab_size):
            raise InvalidRequestError(C.DRAFT_TOKENS, f"token ids must be in [0, {self.vocab_size})")
        if tree.draft_probs is not None and tuple(tree.draft_probs.shape) != (len(tree), self.vocab_size):
            raise InvalidRequestError(C.DRAFT_PROBS, f"must have shape [{len(tree)}, {self.vocab_size}]")
        return tree

    async def start_drafter(self, prompt_ids, first_token, params, method, hidden, num_draft_tokens) -> DraftTree:
        inputs = {P.INPUT_IDS: np.int32([*prompt_ids, first_token]), C.NUM_DRAFT_TOKENS: np.int32([num_draft_tokens]),
                  P.SPECULATIVE_METHOD: np.array([method.encode()], dtype=np.object_), **encode_sampling(params)}
        if hidden is not None:
            inputs[C.HIDDEN_STATES] = hidden.float().numpy()
        return self._tree(await self._call(inputs, DRAFT_OUT, START))

    async def draft(self, last: StepResult, num_draft_tokens: int) -> DraftTree:
        inputs = {P.INPUT_IDS: np.int32(last.emitted), C.NUM_ACCEPTED: np.int32([last.accepted]),
                  C.NUM_DRAFT_TOKENS: np.int32([num_draft_tokens])}
        if last.hidden is not None:
            inputs[C.HIDDEN_STATES] = last.hidden.float().numpy()
        return self._tree(await self._call(inputs, DRAFT_OUT))

    async def release(self, target_started: bool, drafter_started: bool) -> None:
        if drafter_started:
            await self._call({}, [], END)
