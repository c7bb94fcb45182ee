"""Medusa drafting: K heads on the target's last hidden state, all guesses from one pass.

Each sequence keeps the last-layer output at its last committed position (the verifier
hands it over with every step, like EAGLE-3's taps). Chains: the heads' argmax (greedy) or
a draw from each head's distribution, stated as the chain's draft probabilities (lossless
by the SpecInfer rule; a head's q does not depend on the draws before it, which the rule
allows). Trees: the best nodes of the heads' top-k product tree by path probability
(tree_search.dynamic_trees with every level's distribution already known), verified by
the one-hot rule under sampling. The node budget, the planner's cut, is the tree's size.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from specdec.config import METHOD_MEDUSA, REPO_ROOT, ModelConfig, SpeculativeConfig
from specdec.engine.drafters.base import Drafter, KeepDrafting
from specdec.engine.drafters.registry import BuildContext, DrafterKind, register, resolve_path
from specdec.engine.drafters.tree_search import Expansion, dynamic_trees
from specdec.engine.models.eagle3_head import draft_weights, draft_log_probs, mapped_logits
from specdec.engine.models.medusa_heads import MedusaHeads, heads_config, load_medusa
from specdec.engine.models.loading import check_same_tokenizer
from specdec.engine.sampling import logits_to_probs, sample
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import DraftTree


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeads, config: SpeculativeConfig):
        self.heads = heads
        self.config = config
        self.tap_layers = (heads.cfg.source_layer,)
        self.depth = min(heads.cfg.num_heads, config.max_draft_len)

    def on_prefill(self, seq: SequenceState, hidden: Tensor | None) -> None:
        if hidden is None:
            raise ValueError("Medusa needs the target's last hidden state of the prompt")
        seq.drafter_state[self.name] = hidden[-1].float()  # the last prompt position; its next token is the root

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden: Tensor | None) -> None:
        seq.drafter_state[self.name] = hidden[-1].float()  # the last accepted position (the bonus token is the root)

    def on_finish(self, seq: SequenceState) -> None:
        seq.drafter_state.pop(self.name, None)

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        trees = [DraftTree() for _ in seqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return trees
        logits = self.heads(torch.stack([seqs[i].drafter_state[self.name] for i in active]))  # [K, B, Vd]
        act_seqs, act_budgets = [seqs[i] for i in active], [budgets[i] for i in active]
        drafted = self._trees(logits, act_budgets) if self.config.use_dynamic_tree else self._chains(act_seqs, logits, act_budgets)
        for i, tree in zip(active, drafted):
            trees[i] = tree
        return trees

    def _chains(self, seqs: list[SequenceState], logits: Tensor, budgets: list[int]) -> list[DraftTree]:
        to_target = self.heads.draft_to_target
        top = torch.softmax(logits, -1).amax(-1)  # [K, B] the argmax's probability
        out = []
        for b, seq in enumerate(seqs):
            n = min(self.depth, budgets[b])
            if seq.params.greedy:
                tokens = [int(to_target[int(logits[k, b].argmax())]) for k in range(n)]
                out.append(DraftTree.chain(tokens, None, top[:n, b].tolist()))
                continue
            q = logits_to_probs(mapped_logits(self.heads, logits[:n, b]), seq.params)  # [n, V], the target's processing
            tokens = [sample(q[k], seq.generator) for k in range(n)]
            out.append(DraftTree.chain(tokens, q, [float(q[k, t]) for k, t in enumerate(tokens)]))
        return out

    def _trees(self, logits: Tensor, budgets: list[int]) -> list[DraftTree]:
        logp = draft_log_probs(logits)  # [K, B, Vd]

        def expand(rows: list[Expansion]) -> Tensor:  # every node at one level gets the next head's guess
            out = logp.new_empty(len(rows), max(len(r.nodes) for r in rows), logp.shape[-1])
            for b, r in enumerate(rows):
                out[b] = logp[r.level + 1, b]
            return out

        to_target = self.heads.draft_to_target
        return dynamic_trees(logp[0], expand, self.config.dynamic_tree_max_topK, self.depth, budgets, lambda d: int(to_target[d]))


DEFAULT_HEADS = REPO_ROOT / "models" / "medusa-smollm2-135m"


def heads_dir(spec: SpeculativeConfig) -> Path:
    return resolve_path(spec.speculative_model, DEFAULT_HEADS)


def _build(spec: SpeculativeConfig, ctx: BuildContext) -> MedusaDrafter:
    # The heads' linears in engine.draft_dtype, as for the EAGLE-3 head: drafts only.
    check_same_tokenizer(heads_dir(spec), ctx.target_dir)
    heads = load_medusa(heads_dir(spec), ctx.target_cfg, ctx.target_dir).to(ctx.engine.device)
    return MedusaDrafter(draft_weights(heads, ctx.engine.draft_dtype), spec)


def _tap_layers(spec: SpeculativeConfig, target: ModelConfig) -> tuple[int, ...]:
    return (heads_config(heads_dir(spec), target).source_layer,)


register(DrafterKind(methods=(METHOD_MEDUSA,), build=_build, tap_layers=_tap_layers))
