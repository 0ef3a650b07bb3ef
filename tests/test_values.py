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
     "--worker-timeout: must be a finite number, got nan"),
    ("worker timeout 1e308", SWEEP + ["--worker-timeout", "1e308"], {}, None,
     "--worker-timeout: must be at most 2.592e+06 seconds (a month), got 1e+308"),
    ("load timeout inf", SWEEP + ["--load-timeout", "inf"], {}, None, "--load-timeout: must be a finite number, got inf"),
    ("load timeout nan", SWEEP + ["--load-timeout", "nan"], {}, None, "--load-timeout: must be a finite number, got nan"),
    ("seed 2**64", EVAL + ["--seed", str(2**64)], {}, None, f"--seed: must fit in 64 bits, got {2**64}"),
    ("seed 2**32", EVAL + ["--seed", str(2**32)], {}, None, f"--seed: must be <= {2**32 - 1}, got {2**32}"),
    ("dtype int8", EVAL + ["--dtype", "int8"], {}, None, "--dtype: expected {float32, bfloat16, float16} or null"),
    ("engine sglang", EVAL + ["--engine", "sglang"], {}, None, "--engine: expected one of ['dflash_nb', 'vllm']"),
    ("top-p 0", EVAL + ["--top-p", "0"], {}, None, "--top-p: must be > 0, got 0"),
    ("temperature nan", EVAL + ["--temperature", "0", "nan"], {}, None, "--temperature[1]: must be a finite number"),
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


@pytest.fixture
def target(tmp_path):
    "A target dir that dflash-regen reads before it loads anything (config.json, a generation config), and prompts."
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Name a prime number."}) + "\n")
    return tmp_path


def _gen_config(**kw) -> dict:
    return {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, **kw}


REGEN = ["--target", "{d}/t", "--prompts", "{d}/p.jsonl", "--out", "{d}/out"]
RECOMMENDED = REGEN + ["--sampling", "recommended", "--tokenizer", "{tok}"]
# (what goes wrong, arguments, the target's generation_config.json (None: none), what the line says)
REGEN_CASES = [
    ("engine tgi", REGEN + ["--engine", "tgi"], None, "--engine: expected one of ['hf', 'vllm'], got 'tgi'"),
    ("sampling hot", REGEN + ["--sampling", "hot"], None, "--sampling: expected one of ['greedy', 'recommended']"),
    ("dtype int8", REGEN + ["--dtype", "int8"], None, "--dtype: expected one of ['auto', 'float32', 'bfloat16'"),
    ("seed 2**64", REGEN + ["--seed", str(2**64)], None, f"--seed: must fit in 64 bits, got {2**64}"),
    ("seed -1", REGEN + ["--seed", "-1"], None, "--seed: must be >= 0, got -1"),
    ("threads 2**31", REGEN + ["--threads", str(2**31)], None, f"--threads: must be <= 4096, got {2**31}"),
    ("worker timeout nan", REGEN + ["--worker-timeout", "nan"], None, "--worker-timeout: must be a finite number"),
    ("worker timeout inf", REGEN + ["--worker-timeout", "inf"], None, "--worker-timeout: must be a finite number"),
    ("worker timeout 1e308", REGEN + ["--worker-timeout", "1e308"], None,
     "--worker-timeout: must be at most 2.592e+06 seconds (a month), got 1e+308"),
    ("load timeout nan", REGEN + ["--load-timeout", "nan"], None, "--load-timeout: must be a finite number, got nan"),
    ("key=value after flags", REGEN + ["max_seq_len=1"], None, "max_seq_len: must be >= 2, got 1"),
    ("device bogus", REGEN + ["--device", "bogus"], None, "--device 'bogus': not a device"),
    ("temperature -3", RECOMMENDED, _gen_config(temperature=-3),
     "{d}/t/generation_config.json: temperature -3 is not a finite number >= 0"),
    ("temperature NaN", RECOMMENDED, _gen_config(temperature=float("nan")),
     "{d}/t/generation_config.json: temperature nan is not a finite number >= 0"),
    ("top_p 0", RECOMMENDED, _gen_config(top_p=0), "generation_config.json: top_p 0 is not a number in (0, 1]"),
    ("top_p 1.5", RECOMMENDED, _gen_config(top_p=1.5), "generation_config.json: top_p 1.5 is not a number in (0, 1]"),
    ("top_k -2", RECOMMENDED, _gen_config(top_k=-2), "generation_config.json: top_k -2 is not a whole number >= -1"),
]


@pytest.mark.parametrize("what,argv,gen_cfg,text", REGEN_CASES, ids=[c[0] for c in REGEN_CASES])
def test_an_odd_regen_value_is_one_line_exit_2(target, monkeypatch, capsys, what, argv, gen_cfg, text):
    "dflash-regen: a bad value or a generation config no sampler takes is one line, exit 2, before anything is written."
    from dflash_nb.records import qwen3_tokenizer_dir
    if gen_cfg is not None: (target / "t" / "generation_config.json").write_text(json.dumps(gen_cfg))
    fill = lambda a: a.format(d=target, tok=qwen3_tokenizer_dir())
    monkeypatch.setattr(sys, "argv", ["pytest", *map(fill, argv)])
    with pytest.raises(SystemExit) as e:
        importlib.import_module("dflash_nb.regen").cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("python -m dflash_nb.regen: error: ") and fill(text) in err[0], err
    assert not (target / "out").exists()
