"""The llama.cpp side-by-side reads llama-bench's JSON (a stand-in binary here: the real one is
built by `make bench-llamacpp`, outside make test)."""
import json
import stat

from specdec.bench.llama_cpp import llama_bench


def test_llama_bench_results_are_read_from_its_json(tmp_path):
    runs = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 900.5, "model_type": "llama 256M Q4_1", "model_size": 96576768},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 120.25, "model_type": "llama 256M Q4_1", "model_size": 96576768}]
    fake = tmp_path / "build" / "bin" / "llama-bench"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\ncat <<'JSON'\n" + json.dumps(runs) + "\nJSON\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "build_info.json").write_text(json.dumps({"build_seconds": 600.0}))
    out = llama_bench(fake, tmp_path / "model.gguf", 512, 128, threads=2)
    assert (out["prompt_tok_s"], out["decode_tok_s"], out["model_bytes"]) == (900.5, 120.25, 96576768)
    assert out["build"] == {"build_seconds": 600.0}
    assert (fake.parent / "args").read_text().split() == ["-m", str(tmp_path / "model.gguf"), "-p", "512", "-n", "128",
                                                          "-t", "2", "-r", "3", "-o", "json"]
