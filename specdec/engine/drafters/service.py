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


def layer_columns(hidden: Tensor, have: Sequence[int], want: Sequence[int]) -> Tensor:
    """From taps of layers `have` side by side ([..., len(have) * H]), those of `want`, in its order."""
    if tuple(want) == tuple(have):
        return hidden
    width = hidden.shape[-1] // len(have)
    return torch.cat([hidden[..., i * width : (i + 1) * width] for i in (list(have).index(l) for l in want)], dim=-1)


class DraftService(KeyedSequences[SequenceState]):
    where = "drafter"

    def __init__(self, drafters: Mapping[str, Drafter], hidden_layers: Sequence[int] | None = None):
        """hidden_layers: the target layers (in order) of the hidden states this service is
        handed (default: the ones its drafters need); each drafter gets its own columns."""
        super().__init__()
        self.drafters = dict(drafters)
        # each sequence drafts with the drafter it started with, to its end: a head promoted
        # mid-stream (replace) serves the sequences that start after it
        self._bound: dict[Hashable, Drafter] = {}
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
        if hidden is None or not drafter.tap_layers:
            return hidden
        return layer_columns(hidden, self.hidden_layers, drafter.tap_layers)

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
        drafter = self._bound[record.seq_id] = self.drafters[record.method]
        drafter.on_prefill(seq, self._hidden_for(drafter, hidden))

    def propose(self, items: Sequence[tuple[Hashable, int]], cut_for=None) -> list[DraftTree]:
        """items: (seq_id, budget). Each drafter is called once for all of its sequences.
        cut_for(method, seq_ids) -> a planner.DraftCut (or None): asked before each further
        draft pass, and told the call's seconds."""
        seqs = [self._get(seq_id) for seq_id, _ in items]
        trees = [DraftTree() for _ in items]
        by_drafter: dict[int, tuple[Drafter, str, list[int]]] = {}  # one call per drafter (a promoted head's next to its predecessor's)
        for i, (seq_id, budget) in enumerate(items):
            if budget > 0:  # a step without drafting (budget 0) costs the drafter nothing
                drafter = self._bound[seq_id]
                by_drafter.setdefault(id(drafter), (drafter, seqs[i].method, []))[2].append(i)
        for drafter, method, idx in by_drafter.values():
            budgets = [items[i][1] for i in idx]
            cut = None if cut_for is None else cut_for(method, [items[i][0] for i in idx])
            t0 = time.perf_counter()
            if cut is None:
                proposed = drafter.propose([seqs[i] for i in idx], budgets)
            else:
                proposed = drafter.propose([seqs[i] for i in idx], budgets, cut)
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
        drafter = self._bound[seq_id]
        drafter.on_verified(seq, list(emitted), accepted, self._hidden_for(drafter, hidden))

    def release(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self._bound.pop(seq_id).on_finish(seq)

    def replace(self, drafters: Mapping[str, Drafter]) -> None:
        """Serve these methods with new drafters (a promoted head) from the next sequence on;
        running sequences finish with the drafter they started with."""
        unknown = set(drafters) - set(self.drafters)
        if unknown:
            raise InvalidRequestError("method", f"no method {sorted(unknown)[0]!r} to replace; served: {', '.join(self.drafters)}")
        for name, drafter in drafters.items():
            if tuple(drafter.tap_layers) != tuple(self.drafters[name].tap_layers):
                raise ConfigError("tap_layers", f"{name}: the new drafter taps layers {list(drafter.tap_layers)}, "
                                                f"the served one {list(self.drafters[name].tap_layers)}")
        self.drafters.update(drafters)
