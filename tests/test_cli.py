"""Every command line fails the same way: one line `PROG: error: ...` on stderr, exit 2, the program named as started.

In-process calls of each console entry (`cli()`), so every error path of every command costs milliseconds; the real
console scripts and `python -m` runs are in test_config.py."""
import importlib, json, sys

import pytest

BAD_YAML = "train: {steps: [1\n"   # an unclosed flow sequence: a YAML syntax error on line 2


@pytest.fixture
def files(tmp_path):
    "A malformed YAML file, a trainer checkpoint whose recorded drafter config is malformed YAML, a file that is not GGUF."
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 1}))
    (ckpt / "drafter_config.yaml").write_text(BAD_YAML)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(BAD_YAML)
    (tmp_path / "not.gguf").write_bytes(b"GGUX" + bytes(60))
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "Name a prime number."}) + "\n")
    for d, cfg in (("served", {}), ("export", {"block_size": 8, "dflash_config": {"block_size": 8}})):
        (tmp_path / d).mkdir()   # what --engine vllm looks at before vLLM starts: a config.json each
        (tmp_path / d / "config.json").write_text(json.dumps(cfg))
    return tmp_path


# console script -> its module; every case below runs through the module's `cli()`
SCRIPTS = {"dflash-data": "data", "dflash-train": "train", "dflash-eval": "evaluate", "dflash-export": "export",
           "dflash-report": "report", "dflash-gguf": "gguf", "dflash-prompt-set": "prompt_set"}

DATA = ["--input", "{d}/in.jsonl", "--tokenizer", "{d}/tok", "--out", "{d}/out"]
EVAL = ["--drafter", "{d}/drafter", "--target", "tiny", "--prompts", "{d}/p.jsonl"]
EXPORT = ["--checkpoint", "{d}/ckpt", "--out", "{d}/out"]
SWEEP = ["--drafter", "{d}/export", "--target", "{d}/served", "--prompts", "{d}/q.jsonl", "--engine", "vllm"]
# (module, what goes wrong, arguments ({d}: the fixture's directory), text the one error line holds)
CASES = [
    ("data", "bad flag", DATA + ["--bogus"], "unknown flag --bogus (see --help)"),
    ("data", "missing file", DATA, "tokenizer {d}/tok: no such directory"),
    ("data", "malformed YAML", DATA + ["--config", "{d}/bad.yaml"], "{d}/bad.yaml: not valid YAML: "),
    ("data", "bad override", DATA + ["workers=many"], "workers: expected int, got 'many'"),
    ("data", "bare --config", DATA + ["--config"], "--config needs a file"),
    ("train", "bad flag", ["--bogus"], "unknown flag --bogus (see --help)"),
    ("train", "missing file", ["--config", "{d}/none.yaml"], "config file {d}/none.yaml does not exist"),
    ("train", "malformed YAML", ["--config", "{d}/bad.yaml"], "{d}/bad.yaml: not valid YAML: "),
    ("train", "bad override", ["train.steps=many"], "train.steps: expected int, got 'many'"),
    ("train", "bare --config", ["--config"], "--config needs a file"),
    ("evaluate", "bad flag", EVAL + ["--bogus"], "unknown flag --bogus (see --help)"),
    ("evaluate", "missing file", EVAL, "{d}/p.jsonl"),
    ("evaluate", "malformed YAML", ["--drafter", "{d}/drafter", "--target", "{d}/bad.yaml", "--data", "{d}/data"],
     "{d}/bad.yaml: not valid YAML: "),
    ("evaluate", "bad override", EVAL + ["--num-samples", "-1"], "--num-samples: must be >= 0, got -1"),
    ("evaluate", "stray key=value", ["steps=2"] + EVAL, "unknown config key steps"),
    ("evaluate", "unknown engine", EVAL + ["--engine", "sglang"],
     "--engine: expected one of ['dflash_nb', 'vllm'], got 'sglang'"),
    ("evaluate", "empty --prompts word", EVAL[:4] + ["--prompts", "{d}/q.jsonl", ""],   # '' would read the cwd
     "--prompts: an empty word names no file (an unset variable?); name each prompt file"),
    ("evaluate", "vllm without prompts", ["--drafter", "{d}/drafter", "--target", "tiny", "--data", "{d}/data",
                                          "--engine", "vllm"], "--engine vllm: needs --prompts"),
    ("evaluate", "vllm, no target dir", ["--drafter", "{d}/drafter", "--target", "tiny", "--prompts", "{d}/q.jsonl",
                                         "--engine", "vllm"], "--engine vllm: --target tiny: not a model directory"),
    ("evaluate", "sweep k beyond the block", SWEEP + ["--num-speculative-tokens", "2", "8"],
     "--num-speculative-tokens 8: the drafter's block is 8 tokens (the anchor and 7 drafts), so k must be in 1..7"),
    ("evaluate", "sweep k of 0", SWEEP + ["--num-speculative-tokens", "0"], "k must be in 1..7"),
    ("evaluate", "sweep batch of 0", SWEEP + ["--batch-size", "1", "0"], "--batch-size[1]: must be >= 1, got 0"),
    ("evaluate", "sweep without vllm", SWEEP[:6] + ["--batch-size", "1"], "the sweep is served by vLLM: add --engine vllm"),
    ("evaluate", "tensor-parallel size 0", SWEEP + ["--tensor-parallel-size", "0"], "--tensor-parallel-size: must be >= 1, got 0"),
    ("evaluate", "tensor-parallel size -1", SWEEP + ["--tensor-parallel-size", "-1"], "must be >= 1, got -1"),
    ("evaluate", "tensor-parallel size x", SWEEP + ["--tensor-parallel-size", "x"],
     "--tensor-parallel-size: expected int, got 'x'"),
    ("evaluate", "tensor-parallel size nan", SWEEP + ["--tensor-parallel-size", "nan"],
     "--tensor-parallel-size: expected int, got nan"),
    ("evaluate", "tensor-parallel without vllm", SWEEP[:6] + ["--tensor-parallel-size", "2"],
     "--tensor-parallel-size 2: --engine dflash_nb runs the HF target in one process; add --engine vllm"),
    ("export", "bad flag", EXPORT + ["--bogus"], "unknown flag --bogus (see --help)"),
    ("export", "missing file", ["--checkpoint", "{d}/none", "--out", "{d}/out"], "no checkpoint at {d}/none"),
    ("export", "malformed YAML", EXPORT, "{d}/ckpt/drafter_config.yaml: not valid YAML: "),
    ("export", "bad override", EXPORT + ["--dtype", "int8"], "--dtype: expected {{float32, bfloat16, float16}} or null, got 'int8'"),
    ("export", "tensor-parallel size 0", EXPORT + ["--tensor-parallel-size", "0"], "--tensor-parallel-size: must be >= 1, got 0"),
    ("export", "tensor-parallel size nan", EXPORT + ["--tensor-parallel-size", "nan"],
     "--tensor-parallel-size: expected int, got nan"),
    ("report", "bad flag", ["{d}/run", "--bogus"], "unknown flag --bogus (see --help)"),
    ("report", "missing file", ["{d}/none"], "nothing to report: no metrics.jsonl, summary.json or report.json in {d}/none"),
    ("report", "malformed YAML", ["{d}/run"], "nothing to report"),
    ("report", "bad override", ["{d}/run", "--dpi", "50"], "--dpi: must be >= 110, got 50"),
    ("prompt_set", "bad flag", ["--out", "{d}/set", "--bogus"], "unknown flag --bogus (see --help)"),
    ("prompt_set", "no --out", ["--min-prompts", "10"], "--out: required, not given"),
    ("prompt_set", "bad override", ["--out", "{d}/set", "--heldout-fraction", "1"], "--heldout-fraction: must be < 1, got 1.0"),
    ("prompt_set", "malformed YAML", ["--config", "{d}/bad.yaml"], "{d}/bad.yaml: not valid YAML: "),
    ("gguf", "bad flag", ["--out", "{d}/out", "--bogus"], "unknown flag --bogus (see --help)"),
    ("gguf", "missing file", ["--gguf", "{d}/none.gguf", "--out", "{d}/out"], "{d}/none.gguf: no such GGUF file"),
    ("gguf", "not a GGUF file", ["--gguf", "{d}/not.gguf", "--out", "{d}/out"], "not a GGUF file"),
    ("gguf", "bad override", ["--gguf", "{d}/not.gguf", "--out", "{d}/out", "--dtype", "int8"],
     "--dtype: expected one of ['float32', 'bfloat16'], got 'int8'"),
]


def _run_cli(monkeypatch, capsys, argv0: str, module: str, argv: list) -> tuple[int, list, str]:
    "Exit code, stderr lines and stdout of `dflash_nb.<module>.cli()` started as `argv0 argv...`."
    monkeypatch.setattr(sys, "argv", [argv0, *argv])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"dflash_nb.{module}").cli()
    out, err = capsys.readouterr()
    return e.value.code, err.strip().splitlines(), out


@pytest.mark.parametrize("module,what,argv,text", CASES, ids=[f"{m}-{w}" for m, w, _, _ in CASES])
def test_error_is_one_line_exit_2(files, monkeypatch, capsys, module, what, argv, text):
    "Each error path of each command: exit 2, one line naming `python -m dflash_nb.X` and what to fix, nothing written."
    d = str(files)
    before = sorted(p.relative_to(files) for p in files.rglob("*"))
    code, err, _ = _run_cli(monkeypatch, capsys, "pytest", module, [a.format(d=d) for a in argv])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"python -m dflash_nb.{module}: error: "), err
    assert text.format(d=d) in err[0], err
    assert sorted(p.relative_to(files) for p in files.rglob("*")) == before   # refused before anything was written


def test_report_names_the_malformed_config(files, monkeypatch, capsys):
    "A run whose config.yaml is not YAML: the report says so on its own line before the error (it loses nothing)."
    code, err, out = _run_cli(monkeypatch, capsys, "pytest", "report", [str(files / "run")])
    assert code == 2 and out.startswith(f"{files / 'run'}: ") and "; config.yaml is not YAML (" in out, out
    assert len(out.splitlines()) == 1 and len(err) == 1, (out, err)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_names_itself_and_debug_shows_the_stack(files, monkeypatch, capsys, script):
    "Started as `dflash-X`, the error line says `dflash-X`; with `--debug` the traceback comes first, then that line."
    module = SCRIPTS[script]
    argv = {"train": ["--config", "{d}/none.yaml"], "report": ["{d}/none"]}.get(module, ["--bogus"])
    argv = [a.format(d=files) for a in argv]
    code, err, _ = _run_cli(monkeypatch, capsys, f"/venv/bin/{script}", module, argv)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{script}: error: "), err
    code, err, _ = _run_cli(monkeypatch, capsys, f"/venv/bin/{script}", module, argv + ["--debug"])
    assert code == 2 and err[0] == "Traceback (most recent call last):" and err[-1].startswith(f"{script}: error: ")
