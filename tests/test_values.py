"""Odd values get one line, whatever the parser that read them: timeouts that no clock can count (NaN, inf, 1e308, a
word in DFLASH_WORKER_TIMEOUT), devices this machine lacks, drafter configs that are not a drafter's. Each is refused
with `PROG: error: ...` naming the value, exit 2, before a worker starts or a model loads.

In-process calls of the console entries (`cli()`), as in test_cli.py."""
import importlib, json, sys

import pytest
import torch


@pytest.fixture
def files(tmp_path):
    "A prompt file, a served target dir and a drafter export (the config.json each that dflash-eval reads before vLLM)."
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "Name a prime number."}) + "\n")
    for d, cfg in (("served", {}), ("export", {"block_size": 8, "dflash_config": {"block_size": 8}})):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text(json.dumps(cfg))
    return tmp_path


SWEEP = ["--drafter", "{d}/export", "--target", "{d}/served", "--prompts", "{d}/q.jsonl", "--engine", "vllm",
         "--batch-size", "1"]   # a sweep alone: nothing loads in this process
EVAL = ["--drafter", "{d}/export", "--target", "tiny", "--prompts", "{d}/q.jsonl"]
PAST = f"cuda:{torch.cuda.device_count()}"   # one GPU past what this machine has
# (what goes wrong, arguments ({d}: the fixture's directory), environment, the drafter's config.json, what the line says)
CASES = [
    ("worker timeout nan", SWEEP + ["--worker-timeout", "nan"], {}, None,
     "--worker-timeout nan: must be a number of seconds above 0"),
    ("worker timeout 1e308", SWEEP + ["--worker-timeout", "1e308"], {}, None, "--worker-timeout 1e+308: must be"),
    ("load timeout inf", SWEEP + ["--load-timeout", "inf"], {}, None, "--load-timeout inf: must be"),
    ("timeout variable", SWEEP, {"DFLASH_WORKER_TIMEOUT": "abc"}, None, "DFLASH_WORKER_TIMEOUT 'abc': must be"),
    ("device bogus", EVAL + ["--device", "bogus"], {}, None, "--device 'bogus': not a device"),
    ("device past the GPUs", EVAL + ["--device", PAST], {}, None, f"--device {PAST}: this machine"),
    ("drafter config a list", SWEEP, {}, [8], "holds a JSON list, not a drafter's config"),
    ("block size a list", SWEEP, {}, {"block_size": [4]}, "block_size [4] is not an integer >= 2"),
    ("block size negative", SWEEP, {}, {"block_size": -3}, "block_size -3 is not an integer >= 2"),
]


@pytest.mark.parametrize("what,argv,env,drafter,text", CASES, ids=[c[0] for c in CASES])
def test_an_odd_value_is_one_line_exit_2(files, monkeypatch, capsys, what, argv, env, drafter, text):
    for k, v in env.items(): monkeypatch.setenv(k, v)
    if drafter is not None: (files / "export" / "config.json").write_text(json.dumps(drafter))
    monkeypatch.setattr(sys, "argv", ["pytest", *[a.format(d=files) for a in argv]])
    with pytest.raises(SystemExit) as e:
        importlib.import_module("dflash_nb.evaluate").cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("python -m dflash_nb.evaluate: error: ") and text in err[0], err
