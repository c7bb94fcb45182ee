"""Writes the benchmark server's specdec.json for the conversation and repeated-task runs:
the shipped methods, plus, for comparison in the same run, `eagle3-hybrid-ngram` (the
hybrid as it shipped before suffix decoding: EAGLE-3 + prompt lookup) and, when Arctic
Inference's suffix decoding is installed (build_arctic.sh), `arctic-suffix` with the
budget of our `suffix`."""
import importlib.util
import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[4]
settings = json.loads((root / "model_repository" / "specdec.json").read_text())
methods = settings["methods"]
methods["eagle3-hybrid-ngram"] = {k: v for k, v in methods["eagle3-hybrid"].items() if k != "hybrid_suffix"}
if importlib.util.find_spec("arctic_inference") is not None:
    methods["arctic-suffix"] = dict(methods["suffix"], method="arctic_suffix")
Path(sys.argv[1]).write_text(json.dumps(settings, indent=2) + "\n")
print(f"wrote {sys.argv[1]}: {', '.join(methods)}")
