"""Bounded inputs and one way to fail: non-finite settings, hostile YAML/JSON, sizes that cannot fit, token ids past the
vocabulary, broken drafter directories, a full disk; every CLI answers with one line and exit 2. In-process where the
module's `main` allows it; one real subprocess for the console-script names."""
import json, shutil, subprocess, sys
from pathlib import Path
import pytest, torch
from _trainer_common import TINY, make_data, train_cfg, train_dict, write_run_config, env
from dflash_nb import data as data_mod, evaluate as ev, export as ex, train as train_mod
from dflash_nb.config import ConfigError, apply_overrides
from dflash_nb.commands import run_cli
from dflash_nb.trainer import train, last_finite_checkpoint, NonFiniteError

FLOW_BOMB = "[&a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(
    f"&a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 8)) + "]"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("bounds") / "data", n=8)


def _one_line(capsys, prog: str) -> str:
    "The single stderr line of an expected failure, without its `prog: error: ` prefix."
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0].removeprefix(f"{prog}: error: ")


@pytest.mark.parametrize("text,overrides,words", [
    ("", ["train.optim.lr=1e400"], "train.optim.lr: must be a finite number, got inf"),
    ("", ["train.optim.weight_decay=.inf"], "train.optim.weight_decay: must be a finite number"),
    ("", ["train.optim.eps=.nan"], "train.optim.eps: must be a finite number"),
    ("", [f"train.optim.betas={FLOW_BOMB}"], "override train.optim.betas: more than 1,000,000 values"),
    (BOMB, [], "more than 1,000,000 values"),
    ("a: " + "[" * 100 + "]" * 100, [], "nested deeper than 64 levels"),
    ("train: {steps: 3\n", [], "not valid YAML"),
    ("train: !!python/object/apply:os.system [echo]\n", [], "not valid YAML"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff", [], "a binary file"),
    # waits no clock can count, or that nothing can meet (each was a traceback: a watchdog thread's OverflowError, a
    # DistStoreError inside init_process_group)
    ("", ["train.sigterm_wait_s=1e308"], "train.sigterm_wait_s: must be <= 86400, got 1e+308"),
    ("", ["train.collective_timeout_s=0.001"], "train.collective_timeout_s: must be >= 5, got 0.001"),
    ("", ["train.checkpoint.s3_backoff=1e308"], "train.checkpoint.s3_backoff: must be <= 3600, got 1e+308"),
])
def test_train_config_failures_are_one_line(tmp_path, capsys, text, overrides, words):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert train_mod.main(["--config", str(cfg), *overrides]) == 2
    line = _one_line(capsys, "python -m dflash_nb.train")
    assert words in line and (overrides or str(cfg) in line), line


def test_train_help_says_the_bounds_of_every_wait(capsys):
    with pytest.raises(SystemExit): train_mod.main(["--help"])
    out = capsys.readouterr().out
    for said in ("train.sigterm_wait_s (float, default 60.0, >= 1, <= 86400)",
                 "train.collective_timeout_s (float, default 1800.0, >= 5, <= 86400)",
                 "train.checkpoint.s3_backoff (float, default 1.0, >= 0, <= 3600)"):
        assert said in out, said


@pytest.mark.parametrize("module,argv,words", [
    ("cpu_check", ["--target", "t", "--load-timeout", "1e308"], "--load-timeout: must be <= 86400, got 1e+308"),
    ("cpu_check", ["--target", "t", "--load-timeout", "0.001"], "--load-timeout: must be >= 10, got 0.001"),
    ("gpu_check", ["--dry-run", "--budget", "99999999"], "--budget: must be <= 86400, got 99999999"),
    ("gpu_check", ["--step", "env", "--deadline-s", "1e308"], "--deadline-s: must be <= 86400, got 1e+308"),
    ("data", ["--input", "x", "--tokenizer", "t", "--out", "o", "--s3-backoff-s", "1e308"],
     "--s3-backoff-s: must be <= 3600, got 1e+308"),
])
def test_other_commands_waits_are_bounded(capsys, module, argv, words):
    "Every wait of every command has a ceiling a clock can count (a day for a run, an hour for a retry's backoff)."
    import importlib
    mod = importlib.import_module(f"dflash_nb.{module}")
    assert run_cli(mod.main, argv, prog=f"dflash_nb.{module}") == 2   # the console scripts' one way to fail
    assert words in capsys.readouterr().err, words


def test_data_chat_template_kwargs_too_deep(tmp_path, capsys):
    argv = ["--input", str(tmp_path / "x.jsonl"), "--tokenizer", "t", "--out", str(tmp_path / "o"),
            "--chat-template-kwargs", "[" * 50_000 + "]" * 50_000]
    assert data_mod.main(argv) == 2
    assert _one_line(capsys, "python -m dflash_nb.data") == "--chat-template-kwargs: nested deeper than 64 levels"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    "A real export of a one-layer drafter for the built-in tiny target, and a prompt file."
    from dflash_nb.model import DrafterConfig, DFlashDrafter
    from dflash_nb.target import tiny_target
    root = tmp_path_factory.mktemp("export")
    target = tiny_target()
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0, 2],
                                    mask_token_id=151669)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    ex.export_drafter(drafter, cfg, root / "good")
    (root / "p.jsonl").write_text('{"prompt": "hi"}\n')
    return root


def _broken(root: Path, name: str, edit) -> Path:
    d = root / name
    if not d.exists():
        shutil.copytree(root / "good", d)
        conf = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(edit(conf))
    return d


def _shapes(conf):
    conf["dflash_nb_drafter_config"]["num_hidden_layers"] = 2
    conf["dflash_nb_drafter_config"]["layer_types"] = None
    return json.dumps(conf)


@pytest.mark.parametrize("name,edit,extra,words", [
    ("malformed", lambda c: "{bad", [], "config.json: not valid JSON"),
    ("deep", lambda c: "[" * 50_000 + "]" * 50_000, [], "config.json: nested deeper than 64 levels"),
    ("foreign", lambda c: json.dumps({**c, "architectures": ["LlamaForCausalLM"]}), [], "config.json is not a"),
    ("fields", lambda c: json.dumps({k: v for k, v in c.items() if k != "dflash_nb_drafter_config"}
                                    | {"hidden_size": "x"}), [], "config.json: hidden_size must be a whole number >= 1, got 'x'"),
    ("shapes", _shapes, [], "model.safetensors does not fit config.json"),
    ("good", None, ["--max-new-tokens", "-5"], "--max-new-tokens: must be >= 1, got -5"),
])
def test_evaluate_failures_are_one_line(exported, monkeypatch, capsys, name, edit, extra, words):
    d = _broken(exported, name, edit) if edit else exported / "good"
    monkeypatch.setattr(sys, "argv", ["evaluate", "--drafter", str(d), "--target", "tiny", "--prompts",
                                      str(exported / "p.jsonl"), "--max-new-tokens", "2", *extra])
    with pytest.raises(SystemExit) as e: ev.cli()
    assert e.value.code == 2
    assert words in _one_line(capsys, "python -m dflash_nb.evaluate")


def test_export_failure_is_one_line(exported, tmp_path, capsys):
    "A checkpoint whose recorded drafter config is broken JSON: `main` raises an expected error, `run_cli` prints it."
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "state.json").write_text('{"step": 1}')
    (ck / "drafter_config.json").write_text("[" * 50_000)
    shutil.copy(exported / "good" / "model.safetensors", ck / "drafter.safetensors")
    assert run_cli(ex.main, ["--checkpoint", str(ck), "--out", str(tmp_path / "out")], "dflash_nb.export") == 2
    assert "drafter_config.json: nested deeper than 64 levels" in _one_line(capsys, "python -m dflash_nb.export")


def _torch_save_full():
    "What torch.save raises when the disk fills mid-write (measured on a 64 KiB tmpfs): the errno is lost."
    try: raise RuntimeError("basic_ios::clear: iostream error")
    except RuntimeError: raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def _safetensors_full():
    from safetensors import SafetensorError
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _open_full():
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("fail", [_torch_save_full, _safetensors_full, _open_full])
def test_disk_full_is_one_line(capsys, fail):
    "A full disk as each checkpoint writer reports it (fault injection: the errors a real full tmpfs gave): one line."
    assert run_cli(lambda argv: fail(), [], "demo") == 2
    line = _one_line(capsys, "demo")
    assert line.startswith("no space left on device") and "intact" in line


def test_console_scripts_name_themselves(tmp_path):
    "Run as `dflash-train`, the usage line and the error line say `dflash-train`, not `python -m dflash_nb.train`."
    exe = Path(sys.executable).parent / "dflash-train"
    if not exe.exists(): pytest.skip("console scripts not installed")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: dflash-train "), r.stdout[:200]
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [\n")
    r = subprocess.run([str(exe), "--config", str(bad)], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"dflash-train: error: {bad}: not valid YAML"), r.stderr


@pytest.mark.parametrize("kw,words", [
    ({"drafter": {"num_hidden_layers": 10 ** 9}}, "drafter.num_hidden_layers=1000000000"),
    ({"drafter": {"intermediate_size": 10 ** 10}}, "intermediate_size=10000000000"),
    ({"max_anchors": 10 ** 12}, "max_anchors=1000000000000"),
])
def test_sizes_that_cannot_fit_are_refused(tmp_path, data_dir, kw, words):
    with pytest.raises(ConfigError, match="the drafter needs at least") as e:
        train(train_cfg(tmp_path / "run", data_dir, **kw))
    assert words in str(e.value)


def test_token_ids_past_the_vocabulary_name_the_shard(tmp_path, data_dir):
    "Data tokenized for a bigger vocabulary than the target's embedding: refused at load, naming the shard."
    tiny = apply_overrides(TINY["target"]["tiny"], {"vocab_size": 1000, "pad_token_id": 0, "eos_token_id": 1})
    with pytest.raises(ConfigError, match=r"shard .*shard-00000\.arrow: token id \d+ is outside the target's vocab"):
        train(train_cfg(tmp_path / "run", data_dir, target={"tiny": tiny}, drafter={"mask_token_id": 999}))


def test_nonfinite_stop_names_a_finite_checkpoint(tmp_path, data_dir):
    "A huge (finite) lr blows the run up: it stops, says what went non-finite, names a checkpoint with finite weights; "
    "a latest whose weights are NaN is never the one named."
    from safetensors.torch import load_file, save_file
    with pytest.raises(NonFiniteError) as e:
        train(train_cfg(tmp_path / "run", data_dir, steps=8, max_nonfinite=2, checkpoint={"every": 1},
                        optim={"lr": 1e30}))
    msg = str(e.value)
    assert "non-finite loss in" in msg and "the last checkpoint with finite weights is " in msg, msg
    good = Path(msg.split("the last checkpoint with finite weights is ")[1].split()[0])
    assert all(torch.isfinite(t).all() for t in load_file(str(good / "drafter.safetensors")).values())
    root = tmp_path / "run" / "checkpoints"       # fault injection: the newest checkpoint's weights turned to NaN
    newest = root / (root / "latest").read_text().strip()
    w = load_file(str(newest / "drafter.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, str(newest / "drafter.safetensors"))
    assert last_finite_checkpoint(root) is not None and last_finite_checkpoint(root) != newest


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, data_dir):
    "A real `python -m dflash_nb.train` interrupted mid-run (SIGINT, as Ctrl-C sends): one line saying how to go on."
    import signal, time
    cfg = write_run_config(tmp_path / "run.yaml", train_dict(tmp_path / "run", data_dir, steps=100_000))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_nb.train", "--config", str(cfg)],
                            env={**env(), "PYTHONFAULTHANDLER": "1"},   # a SIGABRT prints every thread's stack
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C's default action, as a terminal gives it: a shell starts background jobs (a CI
                            # runner's) with SIGINT ignored, and Python then never raises KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline: time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try: _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:   # still running: where each thread waits is the failure's message
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"still running 120 s after SIGINT; its threads:\n{err[-6000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert err.splitlines()[-1] == ("python -m dflash_nb.train: interrupted (Ctrl-C); files written before are intact: "
                                    "run again with train.resume=auto to continue from the last checkpoint"), err[-2000:]
    assert "Traceback" not in err
