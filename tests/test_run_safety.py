"""Runs that cannot go wrong quietly: every size is checked before it is allocated, overrides are typed by their field,
SIGTERM stops a command within a bounded time in any phase, and nothing non-finite leaves with exit 0. Real CLIs
(in-process where no signal is involved), real subprocesses for SIGTERM, real tiny models."""
import contextlib, io, json, signal, subprocess, sys, time
import pytest, torch, yaml
from _trainer_common import make_data, train_cfg, train_dict, write_run_config, env, REPO
from dflash_nb.config import load_config
from dflash_nb.train import RunConfig, main as train_main
from dflash_nb.trainer import train, NonFiniteError


def cli(main, argv) -> tuple[int, str]:
    "(exit code, stderr) of an in-process CLI call."
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()): rc = main(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("override, value", [
    ("train.drafter.initializer_range=2e-2", 0.02), ("train.drafter.rms_norm_eps=1e-5", 1e-5),
    ("train.drafter.rope_theta=1e6", 1e6), ("train.optim.eps=1e-9", 1e-9), ("train.gamma=7e0", 7.0),
    ("train.target.tiny.initializer_range=4e-2", 0.04), ("train.target.tiny.rms_norm_eps=1e-5", 1e-5),
    ("train.target.tiny.hidden_size=64.0", 64), ("train.steps=1e3", 1000), ("train.drafter.block_size=8.0", 8)])
def test_overrides_typed_by_their_field(override, value):
    "A float field gets a float and an int field a whole number, whatever YAML 1.1 would have read (text for 2e-2)."
    cfg = load_config(RunConfig, None, [override])
    key = override.split("=")[0].split(".")
    node = cfg
    for k in key: node = node[k] if isinstance(node, dict) else getattr(node, k)
    assert node == value and type(node) is type(value), (node, type(node))


@pytest.mark.parametrize("override, says", [
    ("train.drafter.initializer_range=1e300", "train.drafter.initializer_range: must be <= 1"),
    ("train.drafter.rope_scaling={rope_type: yarn, factor: .inf}", "train.drafter.rope_scaling.factor: must be a finite"),
    ("train.drafter.rope_scaling={rope_type: yarn, factor: 1e400}", "train.drafter.rope_scaling.factor: must be a finite"),
    ("train.target.tiny.rope_parameters={rope_theta: .nan}", "tiny.rope_parameters.rope_theta: must be a finite"),
    ("train.target.tiny.init_std=inf", "train.target.tiny.init_std: must be a finite"),
    ("train.drafter.rms_norm_eps=.inf", "train.drafter.rms_norm_eps: must be a finite"),
    ("train.target.tiny.hidden_size=1.5", "train.target.tiny.hidden_size: expected int"),
    ("train.target.tiny.num_layers=x", "train.target.tiny.num_layers: expected int"),
    ("train.run_dir=", "train.run_dir: empty"), ("train.data_dir=", "train.data_dir: empty"),
    ("train.resume=", "train.resume: empty"), ("train.init_from= ", "train.init_from: empty"),
    ("train.target.path=", "train.target.path: empty"), ("regenerate.prompts=", "regenerate.prompts: empty")])
def test_meaningless_values_refused(tmp_path, monkeypatch, override, says):
    "Through the CLI: one line, exit 2, nothing written (not even the run dir, nor a file in the current directory)."
    monkeypatch.chdir(tmp_path)
    rc, err = cli(train_main, [override, f"train.run_dir={tmp_path / 'run'}"] if "run_dir" not in override else [override])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, says", [
    ("train.target.tiny.hidden_size=1e7", "hidden_size=10000000"),
    ("train.target.tiny.vocab_size=1e9", "vocab_size=1000000000"),
    ("train.target.tiny.num_layers=1e8", "num_hidden_layers=100000000"),
    ("train.target.tiny.intermediate_size=1e10", "intermediate_size=10000000000"),
    ("train.global_batch=1e9", "rows of one step (global_batch=1000000000"),
    ("train.max_anchors=1e9", "max_anchors=1000000000"),
    ("train.drafter.num_hidden_layers=1e7", "drafter.num_hidden_layers=10000000"),
    ("train.drafter.mask_token_id=1000000000", "train.drafter.mask_token_id=1000000000 is not a token id"),
    ("train.target.tiny.pad_token_id=1000000000", "train.target.tiny.pad_token_id=1000000000 is not a token id"),
    ("train.target.tiny.eos_token_id=-1", "train.target.tiny.eos_token_id=-1 is not a token id"),
    ("train.target.tiny.vocab_size=1000", "pad_token_id=151643 is not a token id of the target's vocabulary (0..999)")])
def test_sizes_checked_before_allocation(tmp_path, override, says):
    "The demo CLI with one absurd size: one line naming the setting and the figure, exit 2, in seconds, nothing written."
    t0 = time.perf_counter()
    rc, err = cli(train_main, [override, f"train.run_dir={tmp_path / 'run'}"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    if "token id" not in says: assert "GiB is available" in err
    assert not (tmp_path / "run").exists() and time.perf_counter() - t0 < 30


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "train", n=12)


def test_every_step_nonfinite_is_not_success(tmp_path, data_dir):
    "Fewer non-finite steps than max_nonfinite, but every step of the run: it learned nothing, so it stops as a failure."
    with pytest.raises(NonFiniteError, match="all 3 steps of this run were non-finite"):
        train(train_cfg(tmp_path / "run", data_dir, steps=3, fault={"nan_loss_steps": [0, 1, 2]}))
    assert not (tmp_path / "run" / "summary.json").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


def _popen(args):
    return subprocess.Popen([sys.executable, "-m", "dflash_nb.train", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text: str, timeout: float) -> list:
    "Lines of the process's output up to the first that holds `text` (fails after `timeout` s)."
    lines, t0 = [], time.time()
    for line in proc.stdout:
        lines.append(line)
        if text in line: return lines
        assert time.time() - t0 < timeout, "".join(lines[-20:])
    raise AssertionError("exited before: " + "".join(lines[-20:]))


def test_sigterm_in_a_step_that_never_ends(tmp_path, data_dir):
    "A step of 100,000 rows never reaches its boundary: SIGTERM abandons it after train.sigterm_wait_s, exit 143."
    cfg = write_run_config(tmp_path / "c.yaml", train_dict(tmp_path / "run", data_dir, steps=1, global_batch=100_000,
                                                           sigterm_wait_s=2, checkpoint={"every": 0}))
    proc = _popen(["--config", str(cfg)])
    _wait_for(proc, "training", 120)
    time.sleep(1)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    took = time.time() - t0
    assert proc.returncode == 143 and took < 30, (took, out[-2000:])
    assert "did not finish within 2s" in out.strip().splitlines()[-1]
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))
    assert not (tmp_path / "run" / "summary.json").exists()


MINI = {"train": {**train_dict("RUN", None, steps=2), "data_dir": None},
        "data": {"workers": 1, "enable_thinking": False, "min_loss_tokens": 1, "max_degenerate_fraction": 1.0},
        "regenerate": {"prompts": "bundled", "max_prompts": 40, "heldout": 2, "max_new_tokens": 48, "batch_size": 4,
                       "threads": 1},
        "evaluate": {"num_samples": 2}, "export": True}


def test_sigterm_while_regenerating(tmp_path):
    "SIGTERM while the target generates: exit 143 in seconds, and no half-written completions are left to be reused."
    d = {**MINI, "train": {**MINI["train"], "run_dir": str(tmp_path / "run")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    proc = _popen(["--config", str(tmp_path / "c.yaml")])
    _wait_for(proc, "(generating)", 120)
    time.sleep(1)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - t0 < 30, out[-2000:]
    assert "stopped by SIGTERM" in out.strip().splitlines()[-1]
    gen = tmp_path / "run" / "generated"
    assert not list(gen.glob("*.jsonl")) if gen.exists() else True
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["target", "tau_before", "train", "export"])
def test_sigterm_in_each_phase(tmp_path, phase):
    "SIGTERM on entering each phase that is not a step: exit 143 with one line, and that phase leaves nothing behind."
    d = {**MINI, "train": {**MINI["train"], "run_dir": str(tmp_path / "run")},
         "regenerate": {**MINI["regenerate"], "max_prompts": 8, "max_new_tokens": 8}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    p = subprocess.run([sys.executable, "-m", "dflash_nb.train", "--config", str(tmp_path / "c.yaml"),
                        f"sigterm_in_phase={phase}"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 143 and "stopped by SIGTERM" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    run = tmp_path / "run"
    assert not (run / "report.json").exists() and not (run / "drafter").exists()
    assert not [q for q in run.rglob("*") if ".tmp" in q.name]


@pytest.fixture(scope="module")
def served(tmp_path_factory, data_dir):
    "An exported drafter of the tiny target (the `--target tiny` of dflash-eval), and held-out data for it."
    from dflash_nb.target import tiny_target
    from dflash_nb.model import DrafterConfig, DFlashDrafter
    from dflash_nb.export import export_drafter
    t = tiny_target()
    cfg = DrafterConfig.from_target(t.config, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=151669)
    out = export_drafter(DFlashDrafter(cfg, t.get_input_embeddings(), t.get_output_embeddings()), cfg,
                         tmp_path_factory.mktemp("served") / "drafter")
    return out


def _eval(argv):
    from dflash_nb.commands import run_cli
    from dflash_nb.evaluate import main
    return cli(lambda a: run_cli(main, a, prog="dflash_nb.evaluate"), argv)


@pytest.mark.parametrize("field, value, says", [
    ("num_attention_heads", 0, "num_attention_heads must be a whole number >= 1, got 0"),
    ("num_hidden_layers", 10**7, "num_hidden_layers=10000000"),
    ("num_hidden_layers", 1e7, "num_hidden_layers must be a whole number >= 1, got 10000000.0"),
    ("block_size", 10**6, "block_size=1000000 needs at least"),
    ("hidden_size", "64", "hidden_size must be a whole number >= 1, got '64'"),
    ("head_dim", 0, "head_dim must be a whole number >= 2"),
    ("intermediate_size", 10**12, "intermediate_size=1000000000000"),
    ("mask_token_id", 1e9, "mask_token_id must be a whole number >= 0, got 1000000000.0"),
    ("mask_token_id", 10**9, "mask_token_id 1000000000 is outside the vocabulary"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number > 0"),
    ("target_layer_ids", ["x"], "target_layer_ids must be a list of layer numbers"),
    ("dflash_config", [1], "dflash_config must be a mapping")])
def test_served_config_fields_checked(tmp_path, served, data_dir, field, value, says):
    "A hand-edited config.json, field by field: dflash-eval refuses it in one line, before building anything."
    import shutil
    bad = tmp_path / "drafter"
    shutil.copytree(served, bad)
    conf = json.loads((bad / "config.json").read_text())
    ours = conf.pop("dflash_nb_drafter_config")             # z-lab's layout: only the serving fields say the shapes
    if field == "mask_token_id": conf["dflash_config"]["mask_token_id"] = value
    else: conf[field] = value
    if field in ("block_size",): conf["dflash_config"][field] = value
    (bad / "config.json").write_text(json.dumps(conf))
    rc, err = _eval(["--drafter", str(bad), "--target", "tiny", "--data", str(data_dir), "--num-samples", "1"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert ours


def test_eval_block_size_and_unmeasured_tau(tmp_path, served, data_dir):
    "--block-size 1000000 is one line; a τ that was not measured (--max-new-tokens 1) is null in valid JSON."
    rc, err = _eval(["--drafter", str(served), "--target", "tiny", "--data", str(data_dir), "--block-size", "1000000"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--block-size: the drafter" in err, err
    rc, err = _eval(["--drafter", str(served), "--target", "tiny", "--data", str(data_dir), "--num-samples", "2",
                     "--max-new-tokens", "1", "--json", str(tmp_path / "r.json")])
    assert rc == 0, err
    res = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert res["tau"] is None and res["cycles"] == 0


GOOD_STEP = {"step": 1, "loss": 2.5, "acc": [0.5, 0.25], "tau_est": 1.5, "wall_s": 1.0, "tokens_per_s": 100.0,
             "target_busy": 0.5, "drafter_busy": 0.5}
DEEP_JSON = "[" * 100_000 + "]" * 100_000


HOSTILE = [
    ("metrics.jsonl", json.dumps({**GOOD_STEP, "acc": 5}), "metrics.jsonl line 2: acc is not a list of numbers"),
    ("metrics.jsonl", json.dumps({**GOOD_STEP, "loss": "abc"}), "metrics.jsonl line 2: loss is not a number ('abc')"),
    ("metrics.jsonl", '{"step": 1, "loss": 1' + "0" * 400 + "}", "metrics.jsonl line 2: loss is not a number"),
    ("metrics.jsonl", '{"step": 1' + "0" * 400 + ', "loss": 1}', None),
    ("metrics.jsonl", DEEP_JSON, "metrics.jsonl: 1 unreadable line(s) skipped, the first at line 2"),
    ("metrics.jsonl", json.dumps({**GOOD_STEP, "wall_s": [1]}), "metrics.jsonl line 2: wall_s is not a number"),
    ("summary.json", json.dumps({"wall_s": "x", "backend": 3}), "summary.json: wall_s is not a number ('x')"),
    ("summary.json", json.dumps({"final": 5}), "summary.json: final is not a mapping (5)"),
    ("summary.json", json.dumps({"final": {"loss": {"a": 1}}}), "summary.json final: loss is not a number"),
    ("summary.json", "[1]", "summary.json does not hold a JSON object"),
    ("summary.json", DEEP_JSON, "summary.json is not JSON"),
    ("report.json", json.dumps({"tau_before": 5, "tau_after": {"tau": "x"}}), "report.json: tau_before is not a mapping"),
    ("report.json", json.dumps({"tau_after": {"tau": 10 ** 400}}), "report.json tau_after: tau is not a number"),
    ("config.yaml", "[" * 20_000 + "]" * 20_000, "config.yaml is not YAML"),
    ("config.yaml", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefg", "bcdefgh")),
     "config.yaml is not YAML")]


def test_report_on_hostile_files(tmp_path):
    "Malformed fields of every file dflash-report reads: one line naming the file and field, the rest still reported."
    from dflash_nb.commands import run_cli
    from dflash_nb.report import main
    runs = []
    for i, (name, text, says) in enumerate(HOSTILE):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({**GOOD_STEP, "step": 0}) + "\n")
        (run / "summary.json").write_text(json.dumps({"wall_s": 3.0, "backend": "sdpa", "final": GOOD_STEP}))
        (run / "report.json").write_text(json.dumps({"tau_before": {"tau": 1.0}, "tau_after": {"tau": 1.5}}))
        (run / "config.yaml").write_text("train: {steps: 1}\n")
        p = run / name
        p.write_text(p.read_text() + text + "\n" if name == "metrics.jsonl" else text)
        runs.append(str(run))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_cli(main, runs + ["--out", str(tmp_path / "c.png"), "--json", str(tmp_path / "r.json")])
    assert rc == 0 and (tmp_path / "c.png").is_file()
    said = {l.split(": ", 1)[0]: l for l in out.getvalue().splitlines() if l.startswith(str(tmp_path))}
    for run, (name, text, says) in zip(runs, HOSTILE):
        if says: assert says in said.get(run, ""), (name, says, said.get(run))
    rows = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert len(rows) == len(HOSTILE)
    assert all(v is None or isinstance(v, (str, int, float, list)) for r in rows for v in r.values())


def test_report_nothing_readable_is_one_line(tmp_path):
    "Every file of the run unreadable: exit 2, one line."
    from dflash_nb.report import main
    from dflash_nb.commands import run_cli
    run = tmp_path / "run"
    run.mkdir()
    for n in ("metrics.jsonl", "summary.json", "report.json"): (run / n).write_text(DEEP_JSON)
    rc, err = cli(lambda a: run_cli(main, a, prog="dflash_nb.report"), [str(run), "--out", str(tmp_path / "c.png")])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "nothing to report" in err
    assert not (tmp_path / "c.png").exists()


def test_pickled_target_weights_refused_in_one_line(tmp_path):
    "A target dir whose only weights are a pickle carrying code: torch refuses it (nothing runs) and the CLI says so."
    import os
    from dflash_nb.target import tiny_target
    d = tmp_path / "target"
    tiny_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                intermediate_size=64).config.save_pretrained(d)

    class Evil:
        def __reduce__(self): return (os.system, (f"touch {tmp_path / 'ran'}",))
    torch.save({"w": Evil()}, d / "pytorch_model.bin")
    rc, err = _eval(["--drafter", str(tmp_path / "none"), "--target", str(d), "--data", str(tmp_path / "none")])
    lines = [l for l in err.splitlines() if "error:" in l]      # the progress lines of the target's loading go first
    assert rc == 2 and len(lines) == 1 and "refused to load a pickled weights file" in lines[0], err
    assert not (tmp_path / "ran").exists()


def _gguf(argv):
    from dflash_nb.commands import run_cli
    from dflash_nb.gguf import main
    return cli(lambda a: run_cli(main, a, prog="dflash_nb.gguf", expected=(ValueError,)), argv)


def test_gguf_hostile_files_and_foreign_out(tmp_path):
    "A truncated GGUF file, absurd counts, a file that is not GGUF: one line; an --out of another model's files: kept."
    import struct
    from dflash_nb.gguf import smollm2_gguf_path
    src = smollm2_gguf_path()
    cases = {"absurd.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 10**12) + bytes(64), "metadata entries, more than"),
             "strings.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + bytes(64),
                              "metadata key 0 needs 4,611,686,018,427,387,904 bytes"),
             "notgguf.gguf": (b"PK\x03\x04" + bytes(64), "not a GGUF file")}
    if src is not None:
        with open(src, "rb") as f: cases["cut.gguf"] = (f.read(1 << 20), "more than the file holds")
    for name, (data, says) in cases.items():
        (tmp_path / name).write_bytes(data)
        rc, err = _gguf(["--gguf", str(tmp_path / name), "--out", str(tmp_path / f"out-{name}")])
        assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, (name, err)
        assert not (tmp_path / f"out-{name}").exists()
    other = tmp_path / "other"
    other.mkdir()
    theirs = {"config.json": '{"model_type": "llama"}', "tokenizer.json": "{}", "README.md": "another model"}
    for n, t in theirs.items(): (other / n).write_text(t)
    for extra in ([], ["--replace"]):
        rc, err = _gguf(["--gguf", str(src or tmp_path / "absurd.gguf"), "--out", str(other), *extra])
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "is not a dflash-gguf conversion" in err, err
    assert {p.name: p.read_text() for p in other.iterdir()} == theirs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir):
    "A real one-step trainer checkpoint (copied, never modified, by the tests)."
    run = tmp_path_factory.mktemp("ck") / "run"
    train(train_cfg(run, data_dir, steps=1))
    return next((run / "checkpoints").glob("step-*"))


def _export(argv):
    from dflash_nb.commands import run_cli
    from dflash_nb.export import main
    return cli(lambda a: run_cli(main, a, prog="dflash_nb.export"), argv)


@pytest.mark.parametrize("fault, says", [
    ("nan", "holds non-finite values"), ("inf", "holds non-finite values"),
    ("fp16", "beyond float16's largest value"),
    ("state-list", "state.json: expected a JSON object, got list"),
    ("state-deep", "state.json: nested deeper than"), ("state-step", "state.json: step: expected a whole number"),
    ("config-list", "drafter_config.json: expected a mapping"),
    ("config-layers", "num_hidden_layers: must be >= 1, got 0")])
def test_export_refuses_broken_checkpoints(tmp_path, checkpoint, fault, says):
    "Non-finite weights, weights beyond the dtype asked for, a malformed state.json or config: one line, nothing written."
    import shutil
    from safetensors.torch import load_file, save_file
    ck = tmp_path / "step-00000001"
    shutil.copytree(checkpoint, ck)
    w = load_file(str(ck / "drafter.safetensors"))
    k = next(iter(w))
    if fault in ("nan", "inf"): w[k].view(-1)[0] = float(fault)
    if fault == "fp16": w[k].view(-1)[0] = 1e5
    save_file(w, str(ck / "drafter.safetensors"))
    if fault == "state-list": (ck / "state.json").write_text("[1]")
    if fault == "state-deep": (ck / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    if fault == "state-step": (ck / "state.json").write_text('{"step": "x"}')
    if fault == "config-list": (ck / "drafter_config.json").write_text("[1]")
    if fault == "config-layers":
        c = json.loads((ck / "drafter_config.json").read_text())
        (ck / "drafter_config.json").write_text(json.dumps({**c, "num_hidden_layers": 0}))
    rc, err = _export(["--checkpoint", str(ck), "--out", str(tmp_path / "out"),
                       *(["--dtype", "float16"] if fault == "fp16" else [])])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["inside", "same"])
def test_export_never_writes_into_its_checkpoint(tmp_path, checkpoint, where):
    "--out inside (or equal to) the checkpoint it reads: one line, exit 2, the checkpoint as it was."
    import shutil
    ck = tmp_path / "step-00000001"
    shutil.copytree(checkpoint, ck)
    before = sorted(p.name for p in ck.iterdir())
    out = ck / "drafter" if where == "inside" else ck
    rc, err = _export(["--checkpoint", str(ck), "--out", str(out), "--overwrite"])
    said = f"--out {out} lies in --checkpoint {ck}" if where == "inside" else "is not a drafter export"
    assert rc == 2 and len(err.strip().splitlines()) == 1 and said in err, err
    assert sorted(p.name for p in ck.iterdir()) == before


@pytest.mark.parametrize("key", ["evaluate.data_dir", "train.init_from", "train.data_dir"])
def test_train_run_dir_never_inside_what_it_reads(tmp_path, monkeypatch, key):
    "A run dir inside a directory the run reads (its data, held-out data, a warm start): one line, nothing written."
    monkeypatch.chdir(tmp_path)
    read = tmp_path / "read"
    read.mkdir()
    (read / "keep.txt").write_text("x")
    more = ["regenerate.prompts=null", f"train.data_dir={read}"] if key == "train.data_dir" else []
    rc, err = cli(train_main, [f"{key}={read}", f"train.run_dir={read / 'run'}", *more])
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"train.run_dir {read / 'run'} lies in {key} {read}: a run never writes where it reads" in err, err
    assert sorted(p.name for p in read.iterdir()) == ["keep.txt"]
