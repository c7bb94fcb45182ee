"""`specdec serve --model DIR_OR_GGUF [--eagle3-head DIR] [--medusa-heads DIR] [--draft-model DIR]`:
serve a team's own model with the heads it brings, no hand-written JSON. The method table is
built from what is given (the served settings' engine, n-gram and suffix always; EAGLE-3
chain and dynamic tree with a head, its depth from the head's speculators config when it
has one; Medusa with heads; the draft model with one), checked against the target as the
server would check it, written to a settings file, and handed to the server through
SPECDEC_SETTINGS. `--capture DIR` (with or without --model) also records served traffic for
drafter training (opt-in; docs/capture.md). The rest of the flags are `specdec serve`'s own."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from specdec.config import (
    GEMMA_MODEL_NAME, METHOD_DRAFT_MODEL, METHOD_EAGLE3, METHOD_EAGLE3_TREE, METHOD_MEDUSA, METHOD_NGRAM, METHOD_SUFFIX, SERVED_SETTINGS,
    ModelConfig, ServingConfig, gemma_model_dir,
)
from specdec.engine.models.eagle3_head import Eagle3Config
from specdec.engine.models.loading import cache_is_valid, check_same_tokenizer, prepare_gguf, read_model_config
from specdec.engine.models.medusa_heads import heads_config
from specdec.errors import ConfigError, SpecDecError
from specdec.launcher import serve_main as launcher_serve_main
from specdec.launcher.install import default_cache_dir

# Drafting depth of a head whose config does not say (the served EAGLE-3 chain's).
DEFAULT_EAGLE3_DEPTH = 5


def _head_depth(raw: dict[str, Any]) -> int:
    """The draft depth a speculators-format head was trained for (its proposal method's
    speculative_tokens), else the served default."""
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = methods[0].get("speculative_tokens") if methods else None
    return int(tokens) if isinstance(tokens, int) and tokens >= 1 else DEFAULT_EAGLE3_DEPTH


def user_settings(model_dir: Path, eagle3_head: Path | None = None, medusa_heads: Path | None = None,
                  draft_model: Path | None = None, base: Path = SERVED_SETTINGS) -> dict[str, Any]:
    """The served settings (base: its engine, threads and the model-agnostic methods) for
    the given model and heads; a head that does not fit the target is refused naming the key."""
    if str(model_dir) == GEMMA_MODEL_NAME:  # the opt-in embedded target by name
        if not cache_is_valid(gemma_model_dir()):
            raise ConfigError("--model", f"{GEMMA_MODEL_NAME} is not prepared (make prepare-gemma)")
        model_dir = gemma_model_dir()
    model_dir = Path(model_dir).resolve()
    if model_dir.suffix == ".gguf" and model_dir.is_file():  # converted once into the cache, then served as a directory
        model_dir = prepare_gguf(model_dir)
    if not model_dir.is_dir():
        raise ConfigError("--model", f"{model_dir} is not a model directory (config.json + safetensors + tokenizer) or a .gguf file")
    target = read_model_config(model_dir)
    for drafter_dir in (eagle3_head, medusa_heads, draft_model):
        if drafter_dir is not None and Path(drafter_dir).is_dir():
            check_same_tokenizer(Path(drafter_dir), model_dir)
    raw_base = json.loads(Path(base).read_text())
    engine = dict(raw_base["engine"], max_seq_len=min(raw_base["engine"]["max_seq_len"], target.max_position_embeddings))
    engine["max_tokens_limit"] = min(engine.get("max_tokens_limit", engine["max_seq_len"]), engine["max_seq_len"])
    served = raw_base["methods"]
    methods = {name: dict(served[name]) for name in (METHOD_NGRAM, METHOD_SUFFIX) if name in served}
    default = METHOD_NGRAM
    if draft_model is not None:
        methods[METHOD_DRAFT_MODEL] = {"method": METHOD_DRAFT_MODEL, "max_draft_len": 3, "speculative_model": str(Path(draft_model).resolve())}
        default = METHOD_DRAFT_MODEL
    if medusa_heads is not None:
        heads = heads_config(Path(medusa_heads), target)
        methods[METHOD_MEDUSA] = {"method": METHOD_MEDUSA, "max_draft_len": min(heads.num_heads, 4),
                                  "speculative_model": str(Path(medusa_heads).resolve())}
        default = METHOD_MEDUSA
    if eagle3_head is not None:
        head_dir = Path(eagle3_head).resolve()
        raw = json.loads((head_dir / "config.json").read_text())
        Eagle3Config.from_config_file(raw, target).check_fits(target, "speculators_model_type" in raw)
        depth = _head_depth(raw)
        methods[METHOD_EAGLE3] = {"method": METHOD_EAGLE3, "max_draft_len": depth, "speculative_model": str(head_dir)}
        methods[METHOD_EAGLE3_TREE] = {"method": METHOD_EAGLE3, "max_draft_len": depth, "use_dynamic_tree": True,
                                  "dynamic_tree_max_topK": 4, "max_total_draft_tokens": min(4 * depth, 12),
                                  "speculative_model": str(head_dir)}
        default = METHOD_EAGLE3
    settings = {**{k: v for k, v in raw_base.items() if k not in ("methods", "engine", "default_method", "model_dir")},
                "model_dir": str(model_dir), "engine": engine, "methods": methods, "default_method": default}
    _check(settings, target)
    return settings


def _check(settings: dict[str, Any], target: ModelConfig) -> None:
    """The settings as the server will read them, every method against this target."""
    for spec in ServingConfig.from_dict(settings).methods.values():
        spec.check_target(target)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec serve", add_help=False,
                                description="Serve your own model with the heads you bring (the rest: specdec serve's flags).")
    p.add_argument("--model", type=Path, default=None, help="an HF model directory (config.json, safetensors, tokenizer), a .gguf file, or gemma3-270m (make prepare-gemma)")
    p.add_argument("--eagle3-head", type=Path, default=None, help="an EAGLE-3 head (research / SpecForge or speculators layout)")
    p.add_argument("--medusa-heads", type=Path, default=None, help="Medusa heads (ours, or the Medusa project's layout)")
    p.add_argument("--draft-model", type=Path, default=None, help="an independent draft model (HF directory, the target's tokenizer)")
    p.add_argument("--capture", type=Path, default=None, help="record served traffic (tokens and the target's hidden states) "
                   "for `specdec train-head --captures` in this directory (opt-in; docs/capture.md)")
    p.add_argument("--capture-rate", type=float, default=1.0, help="the share of requests recorded (default: %(default)s)")
    p.add_argument("--capture-max-mb", type=int, default=2048, help="the store's cap; the oldest shards go first (default: %(default)s)")
    p.add_argument("--capture-salt", action="append", default=[], help="also record requests with this cache_salt (repeatable; "
                   "salted requests are never recorded otherwise)")
    p.add_argument("--settings-out", type=Path, default=None, help="where the generated settings go (default: under the cache dir)")
    p.add_argument("--settings-only", action="store_true", help="write the settings and stop (for specdec-client bench --server-settings)")
    return p


def serve_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print()
    args, rest = parser.parse_known_args(argv)
    if args.model is None:
        if any(v is not None for v in (args.eagle3_head, args.medusa_heads, args.draft_model)):
            print("specdec serve: --eagle3-head, --medusa-heads and --draft-model need --model", file=sys.stderr)
            return 2
        if args.capture is None:
            return launcher_serve_main(rest)
    try:
        if args.model is None:
            settings = json.loads(Path(os.environ.get("SPECDEC_SETTINGS") or SERVED_SETTINGS).read_text())
        else:
            settings = user_settings(args.model, args.eagle3_head, args.medusa_heads, args.draft_model)
        if args.capture is not None:
            settings["capture"] = {"directory": str(args.capture.resolve()), "sample_rate": args.capture_rate,
                                   "max_bytes": args.capture_max_mb << 20, "salts": args.capture_salt}
            ServingConfig.from_dict(settings)  # checked here, not at the models' load
    except SpecDecError as exc:
        print(f"specdec serve: {exc}", file=sys.stderr)
        return 2
    out = args.settings_out or default_cache_dir() / "user-settings.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(settings, indent=2))
    os.environ["SPECDEC_SETTINGS"] = str(out.resolve())
    print(f"specdec serve: {settings.get('model_dir') or 'the default target'} with methods {', '.join(settings['methods'])} "
          f"(default {settings['default_method']}); settings: {out}", flush=True)
    return 0 if args.settings_only else launcher_serve_main(rest)
