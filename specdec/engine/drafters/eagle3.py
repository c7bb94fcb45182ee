"""EAGLE-3 drafting: linear chains and EAGLE-2 dynamic trees from the head's own KV cache.

Per sequence the head keeps a KV-cache slot whose committed length equals the number of
(target hidden, next token) pairs it has seen. What the verifier keeps arrives as pending
pairs; `propose` runs every sequence's pending pairs in one ragged head pass, then drafts
(one batched head pass per draft depth, over all sequences).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import json

import numpy as np
import torch
from torch import Tensor

from specdec.config import METHOD_EAGLE3, METHOD_EAGLE3_TREE, ModelConfig, SpeculativeConfig
from specdec.engine.models.eagle3_head import Eagle3Config, Eagle3Head, draft_weights, draft_log_probs, load_eagle3, mapped_logits
from specdec.engine.models.llama import build_batch
from specdec.engine.models.loading import check_same_tokenizer
from specdec.engine.sampling import logits_to_probs, sample
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import ROOT, DraftTree
from specdec.engine.drafters.base import KeepDrafting, SlotCacheDrafter
from specdec.engine.drafters.ngram import find_continuations
from specdec.engine.drafters.suffix import SuffixCorpora, learn, suffix_tree
from specdec.config import REPO_ROOT
from specdec.engine.drafters.registry import BuildContext, DrafterKind, register, resolve_path
from specdec.engine.drafters.tree_search import Expansion, draft_pass_batch, dynamic_trees, sampled_trees


MAX_BACKLOG = 512  # pairs a sequence not drafting may hold back (3H floats each: 7 KB for SmolLM2)


@dataclass
class _HeadState:
    slot: int
    pending_hidden: list[Tensor] = field(default_factory=list)  # [n_i, 3H] target taps
    pending_tokens: list[int] = field(default_factory=list)  # the token after each tap's position
    last_hidden: Tensor | None = None  # [H] head output at the last committed pair
    last_logits: Tensor | None = None  # [Vd]


class Eagle3Drafter(SlotCacheDrafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, config: SpeculativeConfig, max_batch_size: int, max_seq_len: int,
                 suffix_corpora: SuffixCorpora | None = None):
        """suffix_corpora: with hybrid_suffix, the engine's corpus of earlier requests (None:
        one of its own)."""
        self.head = head
        if config.hybrid_suffix and suffix_corpora is None:
            suffix_corpora = SuffixCorpora(config.suffix_corpus_tokens, config.suffix_scopes)
        self.suffix_corpora = suffix_corpora
        self.config = config
        self.tap_layers = tuple(head.cfg.tap_layers)
        width = config.dynamic_tree_max_topK if config.use_dynamic_tree else 1
        # Slack past a full prefix for the uncommitted draft nodes of one step.
        self.cache = head.new_cache(max_batch_size, max_seq_len, 64 + width * config.max_draft_len)
        self.draft_to_target = head.draft_to_target

    # ---- sequence life cycle --------------------------------------------------------------
    def on_prefill(self, seq: SequenceState, hidden: Tensor | None) -> None:
        if hidden is None:
            raise ValueError("EAGLE-3 needs the target's hidden taps of the prompt")
        state = _HeadState(self.cache.allocate())
        seq.drafter_state[self.name] = state
        # Pair the tap of position i with token i+1 (the first generated token closes the prompt).
        state.pending_hidden.append(hidden.float())
        state.pending_tokens += seq.prompt_ids[1:] + [seq.output_ids[0]]

    def on_finish(self, seq: SequenceState) -> None:
        super().on_finish(seq)
        if self.suffix_corpora is not None:
            learn(self.suffix_corpora, seq)

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden: Tensor | None) -> None:
        state: _HeadState = seq.drafter_state[self.name]
        state.pending_hidden.append(hidden.float())  # [1 + accepted, 3H]: root + accepted tokens
        state.pending_tokens += emitted  # accepted tokens + bonus/recovered token

    # ---- drafting ---------------------------------------------------------------------------
    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        states = [s.drafter_state[self.name] for s in seqs]
        # Catch the head up only where it drafts now (or where the backlog grows long): under
        # load the budget stays 0 for long stretches, and a sequence that never drafts again
        # then never pays for the head's pass over its prompt and outputs.
        self._absorb_pending([st for st, b in zip(states, budgets) if b > 0 or len(st.pending_tokens) >= MAX_BACKLOG])
        trees = [DraftTree() for _ in seqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return trees
        hybrid = self.config.hybrid_ngram or self.config.hybrid_suffix
        lookups = {i: self._lookups(seqs[i], budgets[i]) for i in active} if hybrid else {}
        head_budget = {i: max(1, budgets[i] - sum(len(c) for c in lookups.get(i, ()))) for i in active}
        if not self.config.use_dynamic_tree:
            groups = [(self._chains, active)]
        elif self.config.sampled_tree:  # sampled requests draw their trees, greedy ones take the top-k tree
            sampled = [i for i in active if not seqs[i].params.greedy]
            groups = [(self._sampled_trees, sampled), (self._dynamic_trees, [i for i in active if seqs[i].params.greedy])]
        else:
            groups = [(self._dynamic_trees, active)]
        for draft, rows in groups:
            if not rows:
                continue
            made = draft([seqs[i] for i in rows], [states[i] for i in rows], [head_budget[i] for i in rows], keep_drafting)
            for i, tree in zip(rows, made):
                for chain in lookups.get(i, ()):
                    tree = tree.merged(chain)
                trees[i] = tree
        return trees

    def _lookups(self, seq: SequenceState, budget: int) -> list[list[int]]:
        """The chains merged into the head's tree (each at most max_draft_len tokens, leaving
        the head at least one node of the budget): hybrid_ngram, the most recent n-gram
        continuation; hybrid_suffix, the suffix draft's most frequent path."""
        cfg = self.config
        length = min(cfg.max_draft_len, budget - 1)
        chains = []
        if cfg.hybrid_ngram and length > 0:
            history = np.asarray(seq.all_ids, dtype=np.int64)
            for n in range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1):
                found = find_continuations(history, n, length, max_matches=1)
                if found:
                    chains.append([int(t) for t in found[0]])
                    break
        length = min(cfg.max_draft_len, budget - 1 - sum(len(c) for c in chains))
        if cfg.hybrid_suffix and length > 0:
            path = suffix_tree(self.suffix_corpora, cfg, seq, length).first_path()
            if path:
                chains.append(path)
        return [c for c in chains if c]

    def _absorb_pending(self, states: list[_HeadState]) -> None:
        """Run every sequence's pending pairs through the head in one ragged pass, commit them."""
        todo = [s for s in states if s.pending_tokens]
        if not todo:
            return
        batch = build_batch([s.slot for s in todo], [self.cache.lengths[s.slot] for s in todo], [s.pending_tokens for s in todo],
                            device=self.cache.k.device)
        last_hidden, last_logits = self.head.absorb([torch.cat(s.pending_hidden) for s in todo], batch, self.cache)
        for b, s in enumerate(todo):
            self.cache.commit(s.slot, range(len(s.pending_tokens)))
            s.last_hidden, s.last_logits = last_hidden[b], last_logits[b]
            s.pending_hidden, s.pending_tokens = [], []

    def _step(self, states: list[_HeadState], hidden: Tensor, tokens: list[list[int]], offsets: list[int],
              depths: list[list[int]], masks: list[Tensor]) -> tuple[Tensor, Tensor]:
        """One head pass over uncommitted draft nodes (tree_search.draft_pass_batch)."""
        batch = draft_pass_batch([self.cache.lengths[s.slot] for s in states], [s.slot for s in states], tokens, offsets, depths, masks,
                                 self.cache.k.device)
        return self.head(hidden, batch, self.cache)

    def _chains(self, seqs, states, budgets, keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """Linear drafts: argmax (greedy) or sampled with draft probabilities. With
        keep_drafting (a planned method) each node states the head's probability of it, and
        the chain stops early when the planner says a further pass does not pay."""
        B = len(seqs)
        planned = keep_drafting is not None
        tokens: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[Tensor]] = [[] for _ in range(B)]
        confidence: list[list[float]] = [[] for _ in range(B)]
        path = [1.0] * B
        logits = torch.stack([s.last_logits for s in states])
        hidden = torch.stack([s.last_hidden for s in states])[:, None]
        for depth in range(max(budgets)):
            top = torch.softmax(logits.float(), -1).amax(-1).tolist() if planned else None  # argmax's probability
            for b, seq in enumerate(seqs):
                if depth < budgets[b]:
                    token, q = self._pick(seq, logits[b])
                    tokens[b].append(token)
                    if q is not None:
                        probs[b].append(q)
                    if planned:
                        conf = top[b] if q is None else float(q[token])
                        confidence[b].append(conf)
                        path[b] *= conf
            if depth + 1 == max(budgets):
                break
            if planned and not keep_drafting(depth + 1, [p if depth < n else 0.0 for p, n in zip(path, budgets)]):
                break
            masks = [torch.ones(1, depth + 1, dtype=torch.bool) for _ in range(B)]
            last = [[t[-1]] for t in tokens]
            out_hidden, out_logits = self._step(states, hidden, last, [depth] * B, [[depth]] * B, masks)
            hidden, logits = out_hidden, out_logits[:, 0]
        return [
            DraftTree.chain(t, torch.stack(p) if p else None, c if planned else None) for t, p, c in zip(tokens, probs, confidence)
        ]

    def _pick(self, seq: SequenceState, draft_logits: Tensor) -> tuple[int, Tensor | None]:
        if seq.params.greedy:
            return int(self.draft_to_target[int(draft_logits.argmax())]), None
        q = logits_to_probs(mapped_logits(self.head, draft_logits), seq.params)  # same processing as the target
        return sample(q, seq.generator), q

    def _tree_expander(self, states: list[_HeadState]):
        """The tree searches' expand: one batched head pass over every row's frontier, each
        node's pass starting from its parent's head output; returns the draft logits."""
        parent_hidden = torch.stack([s.last_hidden for s in states])  # [B, H]
        hidden_of: list[dict[int, Tensor]] = [{} for _ in states]  # candidate -> head output at it

        def expand(rows: list[Expansion]) -> Tensor:
            N = max(len(r.nodes) for r in rows)
            hidden = parent_hidden.new_zeros(len(rows), N, parent_hidden.shape[-1])
            for b, r in enumerate(rows):
                for j, parent in enumerate(r.parents):
                    hidden[b, j] = parent_hidden[b] if parent == ROOT else hidden_of[b][parent]
            out_hidden, out_logits = self._step(states, hidden, [r.tokens for r in rows], [r.offset for r in rows],
                                                [[r.level] * len(r.nodes) for r in rows], [r.mask for r in rows])
            for b, r in enumerate(rows):
                for j, node in enumerate(r.nodes):
                    hidden_of[b][node] = out_hidden[b, j]
            return out_logits

        return expand

    def _dynamic_trees(self, seqs, states, budgets, keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """EAGLE-2 dynamic trees (tree_search), one batched head pass per depth."""
        expand = self._tree_expander(states)
        root_logp = draft_log_probs(torch.stack([s.last_logits for s in states]))  # [B, Vd]
        cfg = self.config
        return dynamic_trees(root_logp, lambda rows: draft_log_probs(expand(rows)), cfg.dynamic_tree_max_topK, cfg.max_draft_len,
                             budgets, lambda d: int(self.draft_to_target[d]), keep_drafting)

    def _sampled_trees(self, seqs, states, budgets, keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """sampled_tree: trees drawn from the head's q (tree_search.sampled_trees)."""
        def to_q(b: int, draft_logits: Tensor) -> Tensor:
            return logits_to_probs(mapped_logits(self.head, draft_logits), seqs[b].params)  # same processing as the target

        cfg = self.config
        return sampled_trees([to_q(b, s.last_logits) for b, s in enumerate(states)], self._tree_expander(states), to_q,
                             lambda b, q: sample(q, seqs[b].generator), cfg.dynamic_tree_max_topK, cfg.max_draft_len, budgets,
                             cfg.sampled_tree_mass, keep_drafting)


DEFAULT_HEAD = REPO_ROOT / "models" / "eagle3-smollm2-135m"


def head_dir(spec: SpeculativeConfig) -> Path:
    return resolve_path(spec.speculative_model, DEFAULT_HEAD)


def _build(spec: SpeculativeConfig, ctx: BuildContext) -> Eagle3Drafter:
    check_same_tokenizer(head_dir(spec), ctx.target_dir)
    head = load_eagle3(head_dir(spec), ctx.embedding(), ctx.target_cfg).to(ctx.engine.device)
    head = draft_weights(head, ctx.engine.draft_dtype)
    return Eagle3Drafter(head, spec, ctx.engine.max_batch_size, ctx.engine.max_seq_len,
                         ctx.suffix_corpora(spec) if spec.hybrid_suffix else None)


def _tap_layers(spec: SpeculativeConfig, target: ModelConfig) -> tuple[int, ...]:
    raw = json.loads((head_dir(spec) / "config.json").read_text())
    return tuple(Eagle3Config.from_config_file(raw, target).tap_layers)


# One drafter: `eagle3-tree` is the same head with use_dynamic_tree (the name stays accepted).
register(DrafterKind(methods=(METHOD_EAGLE3, METHOD_EAGLE3_TREE), build=_build, tap_layers=_tap_layers))
