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


def _archive(path, members: dict[str, bytes], link: tuple[str, str] | None = None):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tar.addfile(info)
    return path


import pytest  # noqa: E402


@pytest.mark.parametrize("with_data_filter", [True, False], ids=["python-3.11.4+", "python-3.11.2"])
def test_the_sdist_extracts_on_pythons_with_and_without_tarfiles_data_filter(tmp_path, monkeypatch, with_data_filter):
    """make bench-peers and bench-llamacpp build llama.cpp from its sdist: Debian 12's Python 3.11.2 has
    no tarfile filter, so the same refusals are made by hand there."""
    import tarfile

    from specdec.bench.llama_cpp import safe_extract

    if not with_data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    good = _archive(tmp_path / "good.tar.gz", {"pkg/llama.cpp/CMakeLists.txt": b"project(x)\n"}, link=("pkg/l", "llama.cpp"))
    with tarfile.open(good) as tar:
        safe_extract(tar, tmp_path / "src")
    assert (tmp_path / "src" / "pkg" / "llama.cpp" / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    for name, members, link in (("escape", {"../outside.txt": b"x"}, None),
                                ("link", {"pkg/a.txt": b"x"}, ("pkg/evil", "../../etc/passwd"))):
        bad = _archive(tmp_path / f"{name}.tar.gz", members, link)
        with tarfile.open(bad) as tar, pytest.raises((SystemExit, tarfile.TarError)):
            safe_extract(tar, tmp_path / f"out-{name}")
        assert not (tmp_path / "outside.txt").exists()
