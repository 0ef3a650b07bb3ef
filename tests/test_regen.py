"""Regeneration at scale (`dflash-regen`) and in a training run (`regenerate.engine`), through both engines.

The vLLM runs are the real console scripts with vLLM's CPU build in the serving environment, on a fixed-seed tiny
Qwen3 target with head_dim 64 (vLLM's CPU attention refuses the other tests' 16). A vLLM engine takes about a minute to
start on the 2-core machine, so the two vLLM commands (`dflash-regen --engine vllm`, `dflash-train ...
regenerate.engine=vllm`) are started together when the module's first test asks for them, and the HF work and the
cheap tests run while they do."""
import json, os, shutil, signal, subprocess, sys, time
from pathlib import Path

import pytest

from _regen_common import run_main, shards
from _serving_common import write_served_target
from dflash_nb.records import DataConfig, load_tokenizer
from dflash_nb.regen import MANIFEST, read_prompts, regenerate
from dflash_nb.train import demo_data_dir

BIN = Path(sys.executable).parent
PROMPTS = demo_data_dir() / "prompts.jsonl"      # the bundled demo prompts (137)
NEW_TOKENS = "32"
# the tiny training run: the demo with its tiny target given head_dim 64 (written to a scratch checkpoint for vLLM),
# 12 bundled prompts (3 held out), 16 new tokens each, 2 steps, no τ, no export
TINY = "{hidden_size: 64, num_layers: 4, num_heads: 2, num_kv_heads: 1, head_dim: 64, intermediate_size: 128, seed: 1}"
TRAIN = [f"train.target.tiny={TINY}", "regenerate.max_prompts=12", "regenerate.heldout=3",
         "regenerate.max_new_tokens=16", "train.steps=2", "train.log_every=1", "evaluate.num_samples=0", "export=false",
         "train.drafter.target_layer_ids=[0,1,2]", "data.min_loss_tokens=1", "data.max_degenerate_fraction=1.0"]


def regen_args(target, out, *more, prompts=PROMPTS, tokens=NEW_TOKENS):
    return ["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", tokens,
            "--shard-size", "50", *more, "enable_thinking=false"]


def counts(out) -> dict:
    "The manifest's per-shard counts, without the timings."
    man = json.loads((Path(out) / MANIFEST).read_text())
    return {k: {n: v for n, v in st.items() if n != "seconds"} for k, st in man["shards"].items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return write_served_target(tmp_path_factory.mktemp("served") / "target")


@pytest.fixture(scope="module")
def vllm_runs(served, tmp_path_factory):
    "Both vLLM commands, started at once in the background: {name: (Popen, its directory)}."
    d = tmp_path_factory.mktemp("vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_PROGRESS": "lines"}
    procs = {}
    for name, argv in {
        "regen": [BIN / "dflash-regen", *regen_args(served, d / "regen", "--engine", "vllm", "--dtype", "float32")],
        "train": [BIN / "dflash-train", f"train.run_dir={d / 'run'}", "regenerate.engine=vllm", *TRAIN],
    }.items():
        log = open(d / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(list(map(str, argv)), stdout=log, stderr=subprocess.STDOUT, env=env), d)
    yield procs
    for p, _ in procs.values():
        if p.poll() is None: p.kill()
        p.wait()


def finished(vllm_runs, name) -> Path:
    "Wait for one of the vLLM commands; its directory (its log is in the assertion message when it failed)."
    p, d = vllm_runs[name]
    rc = p.wait(timeout=600)
    assert rc == 0, (d / f"{name}.log").read_text()[-3000:]
    return d


@pytest.mark.slow   # a vLLM engine start (~1 min, overlapped with the training run's) + the HF run here (~30 s)
def test_vllm_completions_equal_hf_on_the_bundled_prompts(served, vllm_runs, tmp_path):
    """At T = 0 in float32 the two engines write the same bytes for all 137 bundled prompts, shard by shard: the same
    tokens generated (counts per shard equal), the same round-trip cuts; the HF run also verified every completion by
    its batch-1 argmax and cut none. (Measured here: identical on all 137 with 32 and with 48 new tokens.)"""
    rc, out, _ = run_main(*regen_args(served, tmp_path / "hf", "--engine", "hf"))
    assert rc == 0 and "3 of 3 shards done" in out, out
    d = finished(vllm_runs, "regen")
    hf, vl = shards(tmp_path / "hf"), shards(d / "regen")
    assert list(hf) == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert hf == vl
    assert counts(tmp_path / "hf") == counts(d / "regen")
    total = sum(st["generated"] for st in counts(d / "regen").values())
    assert total == 137 * int(NEW_TOKENS)             # this target never ends a turn early: every token was compared
    assert all(st["cut_by_verify"] == 0 for st in counts(tmp_path / "hf").values())
    log = (d / "regen.log").read_text()
    assert "starting vLLM on" in log and "3 of 3 shards done" in log and "completions/s" in log


@pytest.fixture(scope="module")
def small(served, tmp_path_factory):
    "8 bundled prompts in shards of 2, 12 new tokens, the HF engine, one whole run: (its arguments, its directory)."
    d = tmp_path_factory.mktemp("small")
    (d / "p.jsonl").write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:8]))
    args = lambda out, *more: regen_args(served, out, "--shard-size", "2", *more, tokens="12", prompts=d / "p.jsonl")
    rc, out, _ = run_main(*args(d / "whole"))
    assert rc == 0 and "4 of 4 shards done" in out, out
    return args, d


def test_a_killed_run_resumes_to_the_same_bytes(small, tmp_path):
    "The console script killed (SIGKILL) as soon as its first shard is listed resumes to what one whole run wrote."
    args, d = small
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_PROGRESS": "off"}
    p = subprocess.Popen([str(BIN / "dflash-regen"), *map(str, args(tmp_path / "killed"))], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    man, t0 = tmp_path / "killed" / MANIFEST, time.time()
    while not (man.exists() and json.loads(man.read_text())["shards"]) and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = json.loads(man.read_text())["shards"]
    assert 1 <= len(done) < 4, (len(done), p.stderr.read()[-2000:])   # killed mid-run, not after it ended
    assert all(json.loads(l) for f in done for l in (tmp_path / "killed" / f"shard-{int(f):05d}.jsonl").open())
    rc, out, _ = run_main(*args(tmp_path / "killed"))
    note, first = out.splitlines()[:2]                       # the killed run's lock is taken over, then it resumes
    assert rc == 0 and note == f"note: took over the lock of pid {p.pid} (no longer running)", out
    assert first.endswith(f"{len(done)} of 4 shards done in {tmp_path / 'killed'}")
    assert shards(tmp_path / "killed") == shards(d / "whole")
    assert not [f for f in (tmp_path / "killed").iterdir() if f.name.startswith(".")]   # no temp file left
    rc, out, _ = run_main(*args(tmp_path / "killed"))
    assert rc == 0 and "4 of 4 shards done" in out and "loading the target" not in out   # all done: nothing loaded


def test_the_data_step_reads_the_shards(small, served, tmp_path):
    "`dflash-data --input OUT` tokenizes the shards (and not the manifest next to them), one sample per prompt."
    from dflash_nb.shards import tokenize_dataset, read_shards
    cfg = DataConfig(enable_thinking=False, min_loss_tokens=1, max_degenerate_fraction=1.0, workers=1)
    m = tokenize_dataset([str(small[1] / "whole")], served, tmp_path / "data", cfg, verbose=False)
    assert [i["name"] for i in m["inputs"]] == [f"shard-{i:05d}.jsonl" for i in range(4)]
    assert m["audit"]["malformed"]["count"] == 0
    assert len(list(read_shards(tmp_path / "data"))) == 8      # an empty completion still trains its end of turn


def test_recommended_sampling_is_seeded_per_shard(small, served, tmp_path):
    "--sampling recommended follows generation_config.json; with the HF engine a resumed sampled run is the same."
    args, d = small
    target = tmp_path / "t"
    shutil.copytree(served, target)
    gen = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": 0.8,
                                                               "top_k": 20}))
    sampled = lambda out, *more: [target if a == str(served) else a for a in args(out, "--sampling", "recommended",
                                                                                  *more)]
    assert run_main(*sampled(tmp_path / "a"))[0] == 0
    assert run_main(*sampled(tmp_path / "b", "--max-shards", "1"))[0] == 0
    assert run_main(*sampled(tmp_path / "b"))[0] == 0
    assert shards(tmp_path / "a") == shards(tmp_path / "b") != shards(d / "whole")
    man = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert man["settings"]["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 20}
    assert sum(st["cut_by_verify"] for st in man["shards"].values()) == 0    # sampled tokens are not argmax-checked


def test_bad_input_is_one_line_and_exit_2(small, served, tmp_path, monkeypatch):
    "A malformed prompt file, a rerun with other settings, no vLLM to serve with: one line, exit 2, nothing lost."
    args, d = small
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken\n')
    rc, out, err = run_main(*regen_args(served, tmp_path / "o1", prompts=bad))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("python -m dflash_nb.regen: error: ")
    assert f"{bad}:2: not JSON" in err and not (tmp_path / "o1").exists()
    shutil.copytree(d / "whole", tmp_path / "o2")
    before = shards(tmp_path / "o2"), (tmp_path / "o2" / MANIFEST).read_bytes()
    rc, _, err = run_main(*args(tmp_path / "o2", "--max-new-tokens", "13"))
    assert rc == 2 and err.count("\n") == 1 and "other settings (max_new_tokens)" in err
    assert (shards(tmp_path / "o2"), (tmp_path / "o2" / MANIFEST).read_bytes()) == before
    monkeypatch.setenv("DFLASH_SERVING_PYTHON", str(tmp_path / "no-python"))
    rc, _, err = run_main(*args(tmp_path / "o3", "--engine", "vllm"))
    assert (rc, err) == (2, f"python -m dflash_nb.regen: error: DFLASH_SERVING_PYTHON={tmp_path / 'no-python'}: "
                            "not an executable\n")
    assert not (tmp_path / "o3").exists()


def test_tensor_parallel_size_is_checked_before_anything(tmp_path):
    "--tensor-parallel-size 0, -1, x, nan, or above 1 with the HF engine: one line, exit 2, nothing read or written."
    for bad, said in (("0", "--tensor-parallel-size: must be >= 1, got 0"), ("-1", "--tensor-parallel-size: must be >= 1, got -1"),
                      ("x", "--tensor-parallel-size: expected int, got 'x'"),
                      ("nan", "--tensor-parallel-size: expected int, got nan"),
                      ("2", "--tensor-parallel-size 2: the HF engine runs the target in one process; use --engine vllm")):
        rc, _, err = run_main("--target", tmp_path / "none", "--prompts", tmp_path / "none.jsonl", "--out",
                              tmp_path / "o", "--tensor-parallel-size", bad)
        assert (rc, err) == (2, f"python -m dflash_nb.regen: error: {said}\n"), err
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_size_reaches_vllm(served, tmp_path):
    """`--engine vllm --tensor-parallel-size 4` hands vLLM tensor_parallel_size=4: the served target's 2 attention heads
    cannot be split 4 ways, and vLLM's own refusal is the one line (exit 2, ~20 s here), with where a rerun resumes.
    A size vLLM accepts (2) loads and serves in ~90 s on this CPU and writes the bytes size 1 writes (chapter
    01h_regen): measured once, not repeated here."""
    rc, _, err = run_main(*regen_args(served, tmp_path / "o", "--engine", "vllm", "--tensor-parallel-size", "4"))
    lines = [l for l in err.splitlines() if not l.startswith("starting vLLM on")]   # the stage line, then one
    assert rc == 2 and lines == ["python -m dflash_nb.regen: error: ValidationError: Total number of attention heads (2) "
                                 "must be divisible by tensor parallel size (4).; no shard written yet (0 of 3 done in "
                                 f"{tmp_path / 'o'}); rerun to resume"], err


def test_prompts_from_s3_are_the_local_prompts(small, s3_server, tmp_path):
    """An s3:// prefix (listed as dflash-data lists its inputs) gives the shards of the same file read locally; a
    prompt is named by its object's URI (a second object repeats the first prompt: dropped, named)."""
    from dflash_nb import storage
    args, d = small
    bucket = s3_server.make_bucket("prompts")
    lines = (d / "p.jsonl").read_bytes()
    s3_server.client().put_object(Bucket=bucket, Key="set/p.jsonl", Body=lines)
    s3_server.client().put_object(Bucket=bucket, Key="set/q.jsonl", Body=lines.splitlines(keepends=True)[0])
    spec = f"s3://{bucket}/set/"
    argv = [spec if a == str(d / "p.jsonl") else a for a in args(tmp_path / "s3")]
    with s3_server.env():
        storage._S3_CLIENTS.clear()
        try: rc, out, _ = run_main(*argv)
        finally: storage._S3_CLIENTS.clear()
    assert rc == 0 and out.startswith(f"8 prompts ({spec}: 9)"), out
    assert f"e.g. {spec}q.jsonl:1 repeats {spec}p.jsonl:1" in out, out
    assert shards(tmp_path / "s3") == shards(d / "whole")


@pytest.mark.slow   # the training run's vLLM start overlaps the other vLLM command's and the tests above
def test_train_with_regenerate_engine_vllm(vllm_runs, tmp_path):
    """`dflash-train ... regenerate.engine=vllm` trains on vLLM's completions: the files equal what the HF engine
    writes for the same prompts, the loaded target verified them (no cut), and the run went on to train. The target
    is the demo's in-memory tiny one, which vLLM is given as a checkpoint written for it."""
    d = finished(vllm_runs, "train")
    run, log = d / "run", (d / "train.log").read_text()
    assert "regenerated 9 + 3 held-out completions with the target (vLLM)" in log, log[-3000:]
    assert json.loads((run / "generated" / "generation.json").read_text())["stats"]["cut_by_verify"] == 0
    assert json.loads((run / "report.json").read_text())["train"]["steps"] == 2
    import torch
    from dflash_nb.build import build_target, tokenizer_dir
    from dflash_nb.config import load_config
    from dflash_nb.train import RunConfig, demo_config_path
    cfg = load_config(RunConfig, demo_config_path(), TRAIN)
    assert cfg.train.target.path is None and cfg.train.target.tiny["head_dim"] == 64
    tok, target = load_tokenizer(tokenizer_dir(cfg.train.target)), build_target(cfg.train.target, torch.device("cpu"))
    prompts = read_prompts(PROMPTS)[:12]
    for name, part in (("train.jsonl", prompts[:9]), ("heldout.jsonl", prompts[9:])):
        r = regenerate(target, tok, part, tmp_path / name, 16, 32, cfg.data)
        assert r["cut_by_verify"] == 0
        assert (tmp_path / name).read_bytes() == (run / "generated" / name).read_bytes(), name


def test_train_without_a_serving_python_is_one_line(tmp_path, monkeypatch, capsys):
    "`regenerate.engine=vllm` with no vLLM to serve with fails in the checks, before the target is loaded: one line."
    from dflash_nb.train import main as train
    monkeypatch.setenv("DFLASH_SERVING_PYTHON", str(tmp_path / "no-python"))
    assert train([f"train.run_dir={tmp_path / 'run'}", "regenerate.engine=vllm"]) == 2
    err = capsys.readouterr().err
    assert err == (f"python -m dflash_nb.train: error: DFLASH_SERVING_PYTHON={tmp_path / 'no-python'}: not an "
                   "executable\n") and not (tmp_path / "run").exists()
