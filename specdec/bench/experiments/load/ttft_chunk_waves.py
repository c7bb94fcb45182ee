"""A/B through Triton at c=16: engine.chunk_prefill_waves off vs on (TTFT p50, tok/s). Ran with that option
in the engine (2026-12-02); it moved nothing and was not kept, so this script no longer runs as is."""
import json, sys, tempfile
from pathlib import Path
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.bench.bench_load import through_triton
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.serving.runtime import load_tokenizer
from specdec.config import resolve_model_dir, ServingConfig
from specdec_client.envinfo import provenance, write_result

settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
tok = load_tokenizer(resolve_model_dir(None))
texts = sharegpt_prompts(64, seed=0, tokenizer=tok, min_tokens=4, max_tokens=192)
started = provenance()
out = []
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for waves in (False, True):
        s = json.loads(json.dumps(settings)); s["engine"]["chunk_prefill_waves"] = waves
        path = Path(tempfile.mkdtemp()) / "specdec.json"; path.write_text(json.dumps(s))
        http, grpc, metrics = free_ports(3)
        server = TritonServer()
        server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, env={"SPECDEC_SETTINGS": str(path)})
        try:
            server.wait_ready(timeout=600)
            through_triton(server.endpoints, texts[:4], "none", 0, 8, 4)
            for method in ("none", "eagle3-hybrid"):
                k = 0 if method == "none" else 6
                r = through_triton(server.endpoints, texts, method, k, 64, 16)
                r.update(round=rnd, chunk_prefill_waves=waves, method=method); out.append(r)
                print(f"round {rnd} waves={waves} {method}: {r['output_tok_s']:.1f} tok/s TTFT p50 {r['ttft_p50_ms']:.0f} ms", flush=True)
        finally:
            server.stop()
write_result("results/bench/load/ttft_chunk_waves.json", {"points": out}, started)
