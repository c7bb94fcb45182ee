"""Writes the served-shapes run's specdec.json: the shipped methods (`eagle3`, `eagle3-tree` and
`eagle3-hybrid` as served) plus, in the same run, the other EAGLE-3 shapes the served ones were
chosen from: longer chains and the wider, deeper trees (issue 62 item 4: the served shapes
follow this measurement, made again whenever the head or the verifier's cost changes)."""
import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[4]
settings = json.loads((root / "model_repository" / "specdec.json").read_text())
methods = settings["methods"]
fixed = {"max_concurrency": methods["eagle3"].get("max_concurrency", 4)}
for k in (2, 3, 4, 5):
    methods[f"eagle3-k{k}"] = {"method": "eagle3", "max_draft_len": k, **fixed}
for depth, top_k, nodes in ((3, 2, 6), (4, 2, 8), (4, 4, 12)):
    methods[f"eagle3-tree-d{depth}k{top_k}n{nodes}"] = {
        "method": "eagle3", "max_draft_len": depth, "use_dynamic_tree": True, "dynamic_tree_max_topK": top_k,
        "max_total_draft_tokens": nodes, "sampled_tree": True, **fixed}
Path(sys.argv[1]).write_text(json.dumps(settings, indent=2) + "\n")
print(f"wrote {sys.argv[1]}: {', '.join(methods)}")
