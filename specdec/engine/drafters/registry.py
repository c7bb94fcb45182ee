"""The drafter registry: each drafter module declares the method names it serves, how it is
built from its typed spec, and which target layers it taps. The assembly code looks a
method up here; it never branches on method names."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.config import REPO_ROOT, EngineConfig, ModelConfig, SpeculativeConfig
from specdec.errors import ConfigError
from specdec.engine.drafters.base import Drafter



@dataclass
class BuildContext:
    """What a drafter may need to be built: the target's shape, the engine's sizes, the
    target's embedding (loaded once, on first use, when the target itself is not at hand)
    and its directory (tokenizer files, for a draft model's compatibility check)."""

    target_cfg: ModelConfig
    engine: EngineConfig
    load_embedding: Callable[[], torch.nn.Embedding]
    _embedding: torch.nn.Embedding | None = None
    target_dir: Path | None = None
    _suffix_corpora: object | None = None

    def suffix_corpora(self, spec: SpeculativeConfig):
        """The one SuffixCorpora of this engine (made with the first spec's bounds): every
        drafter that drafts from earlier requests (suffix, the EAGLE-3 hybrid) learns into it."""
        if self._suffix_corpora is None:
            from specdec.engine.drafters.suffix import SuffixCorpora

            self._suffix_corpora = SuffixCorpora(spec.suffix_corpus_tokens, spec.suffix_scopes)
        return self._suffix_corpora

    def embedding(self) -> torch.nn.Embedding:
        if self._embedding is None:
            self._embedding = self.load_embedding()
        return self._embedding


@dataclass(frozen=True)
class DrafterKind:
    methods: tuple[str, ...]  # SpeculativeConfig.method values this module serves
    build: Callable[[SpeculativeConfig, BuildContext], Drafter]
    # The target layers whose hidden states the drafter needs (read from its files, not
    # loaded: the verifier needs the layer ids only); () for drafters that need none.
    tap_layers: Callable[[SpeculativeConfig, ModelConfig], tuple[int, ...]] = lambda spec, target: ()


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    for method in kind.methods:
        _KINDS[method] = kind
    return kind


def kind_of(spec: SpeculativeConfig) -> DrafterKind:
    _load_builtin_drafters()
    kind = _KINDS.get(spec.method)
    if kind is None:
        raise ConfigError("method", f"method {spec.method!r} is not available in this build; available: {', '.join(sorted(_KINDS))}")
    return kind


def resolve_path(path: str | None, default: Path) -> Path:
    """A configured file path (relative = to the repository root), or the shipped default."""
    out = Path(path) if path else default
    return out if out.is_absolute() else REPO_ROOT / out


def _load_builtin_drafters() -> None:
    # Importing a drafter module registers it.
    from specdec.engine.drafters import arctic_suffix, draft_model, eagle3, medusa, ngram, suffix  # noqa: F401
