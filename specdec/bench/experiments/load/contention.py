import subprocess, sys, torch
from specdec.config import SamplingParams, ServingConfig, resolve_model_dir
from specdec.serving.runtime import encode_prompt, load_tokenizer
from specdec.bench.engine_runs import run_requests
from specdec.bench.bench_serving import in_process_engine
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.launcher import DEFAULT_MODEL_REPOSITORY
settings = ServingConfig.from_file(DEFAULT_MODEL_REPOSITORY / "specdec.json")
tok = load_tokenizer(resolve_model_dir(settings.model_dir))
ids = [encode_prompt(tok, t) for t in sharegpt_prompts(16, seed=0, tokenizer=tok, min_tokens=4, max_tokens=192)]
engine = in_process_engine(settings); torch.set_num_threads(2)
p = SamplingParams(max_tokens=48, ignore_eos=True)
run_requests(engine, ids[:4], SamplingParams(max_tokens=8), "none", 0, 4)
for rnd in range(2):
    for hog in (None, ("0.004", "0.036"), ("0.008", "0.032")):
        proc = subprocess.Popen([sys.executable, "specdec/bench/experiments/load/hog.py", *hog, "600"]) if hog else None
        r = run_requests(engine, ids, p, "none", 0, 16)
        if proc: proc.kill()
        print(f"hog {hog}: {r['output_tok_s']:.1f} tok/s", flush=True)
