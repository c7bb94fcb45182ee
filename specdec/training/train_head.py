"""`specdec train-head`: train a drafter head for the target from served traffic
(`--captures DIR`, recorded by `specdec serve --capture DIR`), from the target's
regenerated answers (`--answers`, `--self-distill`), or both, beside the ShareGPT
conversations whose held-out part measures it.

`--head eagle3` (default: with training-time test, `--ttt-steps`) or `--head medusa`; every
other flag is that trainer's (`specdec train-eagle3 --help`, `specdec train-medusa --help`).
Runs are resumable: state is saved every `--checkpoint-every-min` minutes, and the same
command re-run after a kill continues from it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

HEADS = {"eagle3": "specdec.training.train_eagle3", "medusa": "specdec.training.train_medusa"}


def main(argv: Sequence[str] | None = None) -> int:
    import importlib

    p = argparse.ArgumentParser(prog="specdec train-head", description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", choices=sorted(HEADS), default="eagle3")
    args, rest = p.parse_known_args(list(sys.argv[2:] if argv is None else argv))
    if "-h" in rest or "--help" in rest:
        p.print_help()
        print()
    return importlib.import_module(HEADS[args.head]).main(rest)
