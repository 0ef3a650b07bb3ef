"""`dflash-cpu-check` (chapter 14_cpu_check) end to end on a tiny saved target, with quick settings: every stage but
vLLM runs through the console script and its JSON holds what the table prints (every fraction a positive number, no
path of this machine); `--stages` skips the others in one line each; a bad option is one line and exit 2; an out dir
holding a file the check did not write is refused with the file intact; SIGTERM mid-stage stops it with no process and
no temp file left behind. vLLM's stage runs (slow) where the serving environment exists."""
import json, os, re, signal, subprocess, sys, time
from pathlib import Path

import pytest

from dflash_nb.commands import run_cli
from dflash_nb.cpu_check import RESULT, STAGES, VLLM_STAGES, main

SCRIPT = Path(sys.executable).parent / "dflash-cpu-check"
QUICK = ["--row-tokens", "64", "--anchors", "4", "--drafter-layers", "1", "--block-size", "4", "--repeats", "1",
         "--steps", "2", "--regen-prompts", "2", "--max-new-tokens", "4", "--threads", "1"]
NO_VLLM = [s for s in STAGES if s not in VLLM_STAGES]
TINY = dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
            intermediate_size=128, pad_token_id=0, eos_token_id=1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dflash_nb.target import tiny_target
    path = tmp_path_factory.mktemp("cpu_check") / "tiny"
    tiny_target(**TINY).save_pretrained(path)
    return path


def check(*args, timeout=300, **kw):
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, **kw)


def fractions(obj, key=""):
    "Every value in `obj` under a key that names a fraction, however deep."
    if isinstance(obj, dict): return [v for k, x in obj.items() for v in fractions(x, k)]
    if isinstance(obj, list): return [v for x in obj for v in fractions(x, key)]
    return [obj] if "fraction" in key else []


def absolute_paths(text: str) -> list:
    "Strings of the JSON that are, or start with, an absolute path of this machine."
    return re.findall(r'"(/[^"]*)"', text) + [m for m in ("/tmp/", "/work/", "/home/", "/root/") if m in text]


def test_the_whole_check_end_to_end(target, tmp_path):
    out = tmp_path / "result"
    p = check("--target", str(target), "--out", str(out), "--stages", *NO_VLLM, *QUICK)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (out / RESULT).read_text()
    rec = json.loads(text)
    assert {"check", "started", "finished", "complete", "machine", "settings", "reference", "stages"} <= set(rec)
    assert rec["complete"] and list(rec["stages"]) == list(STAGES)
    assert [s["status"] for s in rec["stages"].values()] == ["skipped" if s in VLLM_STAGES else "ok" for s in STAGES]
    for name in NO_VLLM:
        r = rec["stages"][name]
        assert r["fraction"] > 0 and r["gflops"] > 0, (name, r)
        assert name == "matmul_rates" or r["tokens_per_s"] > 0, (name, r)
    found = fractions(rec)
    assert len(found) == 9 and all(isinstance(v, float) and v > 0 for v in found), found
    assert rec["reference"]["dtype"] in ("bfloat16", "float32") and rec["reference"]["gflops"] > 0
    t = rec["stages"]["trainer_step"]
    assert {"ratio_to_slower_stage", "ratio_to_sum", "hidden_share", "I_s", "T_s"} <= set(t)
    assert rec["settings"]["target"] == "tiny" and rec["machine"]["torch_threads"] == 1
    assert not absolute_paths(text), absolute_paths(text)
    assert str(tmp_path) not in text
    table = p.stdout[p.stdout.index("\nstage "):]
    assert all(f"\n{name} " in table for name in STAGES), table
    assert "skipped: regen_vllm: not in --stages" in p.stdout


def test_stages_skip_the_others_in_one_line_each(target, tmp_path, capsys):
    assert main(["--target", str(target), "--out", str(tmp_path / "o"), "--stages", "target_forward", *QUICK]) == 0
    said = capsys.readouterr().out
    skipped = ["engine_features", "drafter_step", "trainer_step", "regen_hf", "regen_vllm"]
    assert [l for l in said.splitlines() if l.startswith("skipped: ")] == \
        [f"skipped: {s}: not in --stages" for s in skipped]
    rec = json.loads((tmp_path / "o" / RESULT).read_text())
    assert [rec["stages"][s]["status"] for s in STAGES] == ["ok", "ok"] + ["skipped"] * 5   # the reference runs always


@pytest.mark.parametrize("argv, text", [
    (["--bogus"], "unknown flag --bogus"),
    (["--stages", "forward"], "--stages: unknown 'forward'"),
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
])
def test_a_bad_option_is_one_line_exit_2(target, tmp_path, capsys, argv, text):
    assert run_cli(main, ["--target", str(target), "--out", str(tmp_path / "o"), *argv],
                   prog="dflash-cpu-check") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-cpu-check: error: ") and text in err, err
    assert not (tmp_path / "o").exists()


def test_the_console_script_names_itself(target, tmp_path):
    p = check("--help", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("usage: dflash-cpu-check ") and p.stderr == "", p.stderr
    assert "--vllm-variants" in p.stdout and "--train-config" in p.stdout
    p = check("--target", str(target), "--bogus", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, (p.stdout, p.stderr)
    assert p.stderr.startswith("dflash-cpu-check: error: unknown flag --bogus"), p.stderr
    assert list(tmp_path.iterdir()) == []                          # refused before anything was written


def test_a_target_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    assert run_cli(main, ["--target", str(tmp_path), "--out", str(tmp_path / "o")], prog="dflash-cpu-check") == 2
    assert "no config.json there" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_out_dir_with_a_foreign_file_is_refused_and_left_alone(target, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_cli(main, ["--target", str(target), "--out", str(out), *QUICK], prog="dflash-cpu-check") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not write (notes.txt)" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / RESULT).write_text('{"not": "ours"}')   # a JSON of the same name that another program wrote
    assert run_cli(main, ["--target", str(target), "--out", str(out), *QUICK], prog="dflash-cpu-check") == 2
    assert "was not written by dflash-cpu-check" in capsys.readouterr().err
    assert (out / RESULT).read_text() == '{"not": "ours"}'


def test_sigterm_mid_stage_leaves_no_process_and_no_temp_file(target, tmp_path):
    temp, out = tmp_path / "temp", tmp_path / "out"
    temp.mkdir()
    steps = ["--steps", "2000", "--stages", "drafter_step"]   # long enough to be stopped inside the stage
    p = subprocess.Popen([str(SCRIPT), "--target", str(target), "--out", str(out), *QUICK, *steps],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "TMPDIR": str(temp)})
    try:
        for line in p.stdout:
            if line.startswith("drafter_step ..."): break
        time.sleep(2)
        assert p.poll() is None, "the check ended before it could be stopped"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None: p.kill()
    err = p.stderr.read()
    assert rc == 143 and "stopped by SIGTERM" in err, (rc, err[-2000:])
    with pytest.raises(ProcessLookupError): os.killpg(p.pid, 0)    # nothing of its process group is left
    # torch's compile cache aside (torchinductor_<user>, made by the first training step; `make nbtest` allows it too)
    assert [f.name for f in temp.iterdir() if not f.name.startswith("torchinductor_")] == []
    rec = json.loads((out / RESULT).read_text())                   # whole: the stages that finished, not complete
    assert not rec["complete"] and rec["stages"]["matmul_rates"]["status"] == "ok"
    assert [f.name for f in out.iterdir()] == [RESULT]


@pytest.mark.slow
def test_the_vllm_stages_where_the_serving_environment_exists(tmp_path):
    from dflash_nb.serving import ServingUnavailable, serving_python
    try: serving_python()
    except ServingUnavailable as e: pytest.skip(str(e))
    sys.path.insert(0, str(Path(__file__).parent))
    from _serving_common import write_served_target   # the tiny target vLLM's CPU backend serves
    target = write_served_target(tmp_path / "served")
    out = tmp_path / "out"
    p = check("--target", str(target), "--out", str(out), "--stages", "regen_vllm", "engine_features",
              "--vllm-variants", "old_defaults", "--vllm-batch", "2", *QUICK, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    stages = json.loads((out / RESULT).read_text())["stages"]
    e = stages["engine_features"]   # the same rows' features from vLLM and from the hooks, in one run
    assert e["status"] == "ok" and e["tokens_per_s"] > 0 and e["hooks"]["tokens_per_s"] > 0 and e["ratio"] > 0, e
    assert e["bytes_per_token"] % (64 * 4) == 8 and e["dtype"] == "float32"   # layers of 64 floats, one 8-byte id
    assert e["max_rel_diff"] < 1e-5, e   # the same states: vLLM and the hooks compute one forward
    row = e["row_tokens"] * e["bytes_per_token"]   # the transport holds one row's files on disk at a time
    assert 0 < e["peak_file_bytes"] <= row + 64 * 1024, e   # + the files' headers (a few hundred bytes each)
    r = stages["regen_vllm"]
    assert r["status"] == "ok" and r["best"] == "old_defaults@2", r
    run = r["variants"]["old_defaults"]
    assert run["dtype"] == "float32" and run["kv_cache_memory_bytes"] == 512 << 20 and run["threads"] == 1
    assert run["batches"]["2"]["tokens"] > 0 and r["tokens_per_s"] > 0 and r["fraction"] > 0
