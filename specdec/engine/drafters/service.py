"""The draft side: per-sequence drafter state keyed by sequence id, drafts batched per method.

Like the target pass it can live in its own process (the Triton `drafter` model). Its
drafters read each sequence's tokens (prompt + emitted) from the sequence's record, because
n-gram lookup needs them and EAGLE needs to know which tokens its hidden states belong to.
"""
from __future__ import annotations

import time
from typing import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from specdec.engine.drafters.base import Drafter
from specdec.errors import ConfigError, InvalidRequestError
from specdec.engine.sampling import make_generator
from specdec.engine.sequences import KeyedSequences, SequenceRecord, SequenceState
from specdec.engine.tree import DraftTree

# Draft randomness uses its own stream so it never shifts the verifier's acceptance draws.
_DRAFT_SEED_OFFSET = 0x5EED


def union_of_layers(layer_sets) -> tuple[int, ...]:
    return tuple(sorted({layer for layers in layer_sets for layer in layers}))


class DraftService(KeyedSequences[SequenceState]):
    where = "drafter"

    def __init__(self, drafters: Mapping[str, Drafter], hidden_layers: Sequence[int] | None = None):
        """hidden_layers: the target layers (in order) of the hidden states this service is
        handed (default: the ones its drafters need); each drafter gets its own columns."""
        super().__init__()
        self.drafters = dict(drafters)
        self.hidden_layers = tuple(self.tap_layers if hidden_layers is None else hidden_layers)
        missing = set(self.tap_layers) - set(self.hidden_layers)
        if missing:
            raise ConfigError("tap_layers", f"drafters need target layers {sorted(missing)} the hidden states do not carry")

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Every target layer (ascending) whose output a drafter needs: one forward taps the
        union (EAGLE-3's three layers and a Medusa head's last layer side by side)."""
        return union_of_layers(d.tap_layers for d in self.drafters.values())

    def _hidden_for(self, drafter: Drafter, hidden: Tensor | None) -> Tensor | None:
        """The columns of `drafter`'s layers, in its order."""
        if hidden is None or not drafter.tap_layers or drafter.tap_layers == self.hidden_layers:
            return hidden
        width = hidden.shape[-1] // len(self.hidden_layers)
        blocks = [hidden[..., i * width : (i + 1) * width] for i in (self.hidden_layers.index(l) for l in drafter.tap_layers)]
        return torch.cat(blocks, dim=-1)

    def needs_hidden(self, method: str) -> bool:
        drafter = self.drafters.get(method)
        return bool(drafter and drafter.tap_layers)

    def start(self, record: SequenceRecord, hidden: Tensor | None = None, appends_tokens: bool = True) -> None:
        """A sequence whose first token is emitted (record.output_ids == [first]).
        appends_tokens: this service appends the tokens advance() is told of (served apart);
        False: the record is the target pass's beside it, which has appended them."""
        if record.method not in self.drafters:
            raise InvalidRequestError("method", f"no drafter {record.method!r}; available: {', '.join(self.drafters)}")
        seed = None if record.params.seed is None else record.params.seed + _DRAFT_SEED_OFFSET
        seq = SequenceState(record, make_generator(seed), last_used=time.monotonic(), appends_tokens=appends_tokens)
        self._seqs[record.seq_id] = seq
        self.drafters[record.method].on_prefill(seq, self._hidden_for(self.drafters[record.method], hidden))

    def propose(self, items: Sequence[tuple[Hashable, int]], cut_for=None) -> list[DraftTree]:
        """items: (seq_id, budget). Each drafter is called once for all of its sequences.
        cut_for(method, seq_ids) -> a planner.DraftCut (or None): asked before each further
        draft pass, and told the call's seconds."""
        seqs = [self._get(seq_id) for seq_id, _ in items]
        trees = [DraftTree() for _ in items]
        by_method: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            if items[i][1] > 0:  # a step without drafting (budget 0) costs the drafter nothing
                by_method.setdefault(seq.method, []).append(i)
        for method, idx in by_method.items():
            budgets = [items[i][1] for i in idx]
            cut = None if cut_for is None else cut_for(method, [items[i][0] for i in idx])
            t0 = time.perf_counter()
            if cut is None:
                proposed = self.drafters[method].propose([seqs[i] for i in idx], budgets)
            else:
                proposed = self.drafters[method].propose([seqs[i] for i in idx], budgets, cut)
                cut.finish(time.perf_counter() - t0)
            for i, tree, budget in zip(idx, proposed, budgets):
                trees[i] = tree.truncated(budget)
        return trees

    def advance(self, seq_id: Hashable, emitted: Sequence[int], accepted: int, hidden: Tensor | None = None) -> None:
        """Tell the drafter what the verifier kept: `accepted` draft tokens, then the
        bonus/recovered token, i.e. `emitted` (accepted + 1 tokens)."""
        seq = self._get(seq_id)
        if seq.appends_tokens:
            seq.output_ids.extend(emitted)
        seq.last_used = time.monotonic()
        drafter = self.drafters[seq.method]
        drafter.on_verified(seq, list(emitted), accepted, self._hidden_for(drafter, hidden))

    def release(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self.drafters[seq.method].on_finish(seq)
