"""Config ranges and nested keys checked at load (before any model is built), and the one-line CLI error convention."""
import subprocess, sys
from pathlib import Path

import pytest

from dflash_nb.config import ConfigError, load_config
from dflash_nb.train import RunConfig

ROOT = Path(__file__).resolve().parents[1]

BAD = [  # (override, text the one-line error must hold)
    ("train.global_batch=0", "train.global_batch: must be >= 1, got 0"),
    ("train.max_tokens=1", "train.max_tokens: must be >= block_size + 1 = 17"),
    ("train.max_tokens=16", "train.max_tokens: must be >= block_size + 1 = 17"),
    ("train.max_anchors=0", "train.max_anchors: must be >= 1, got 0"),
    ("train.steps=0", "train.steps: must be >= 1, got 0"),
    ("train.steps=-5", "train.steps: must be >= 1, got -5"),
    ("train.log_every=0", "train.log_every: must be >= 1, got 0"),
    ("train.target.tiny.bogus=1", "unknown config key train.target.tiny.bogus"),
    ("train.drafter.bogus=1", "unknown config key train.drafter.bogus"),
    ("train.drafter.block_size=1", "train.drafter.block_size: must be >= 2, got 1"),
    ("train.drafter.num_hidden_layers=x", "train.drafter.num_hidden_layers: expected int"),
    ("train.optim.lr=0", "train.optim.lr: must be > 0"),
    ("train.optim.betas=[0.9, 1.5]", "train.optim.betas[1]: must be <= 0.999999"),
    ("train.optim.warmup_frac=2", "train.optim.warmup_frac: must be <= 1"),
    ("train.target.max_batch_tokens=0", "train.target.max_batch_tokens: must be >= 1"),
    ("data.max_seq_len=0", "data.max_seq_len: must be >= 2"),
    ("data.batch_size=0", "data.batch_size: must be >= 1"),
    ("data.max_malformed_fraction=1.5", "data.max_malformed_fraction: must be <= 1"),
    ("regenerate.batch_size=0", "regenerate.batch_size: must be >= 1"),
]


@pytest.mark.parametrize("override,msg", BAD, ids=[o for o, _ in BAD])
def test_bad_values_fail_at_load_naming_the_key(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, [override])
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_good_values_and_shipped_configs_load():
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(RunConfig, p)
    c = load_config(RunConfig, None, ["train.drafter.block_size=32", "train.max_tokens=33", "train.target.tiny.initializer_range=0.04",
                                      "train.target.tiny.num_layers=2", "train.steps=1", "train.log_every=1"])
    assert (c.train.max_tokens, c.train.drafter, c.train.target.tiny["num_layers"]) == (33, {"block_size": 32}, 2)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_train_cli_one_line_exit_2_named_as_started():
    "A real `python -m` run (the in-process error paths of every command, `--debug` included, are in test_cli.py)."
    r = _cli("-m", "dflash_nb.train", "train.steps=-5")
    assert r.returncode == 2 and r.stderr.strip() == "python -m dflash_nb.train: error: train.steps: must be >= 1, got -5", r.stderr


SCRIPTS = {  # console script -> (module prog, arguments that are complete but for one unknown flag, text its --help shows)
    "dflash-data": ("dflash_nb.data", ["--input", "a.jsonl", "--tokenizer", "tok", "--out", "out", "--bogus"],
                    "  --overlong ({truncate, drop}, default 'truncate')"),
    "dflash-train": ("dflash_nb.train", ["--bogus"], "  train.gamma (float or null, default None, > 0)"),
    "dflash-eval": ("dflash_nb.evaluate", ["--drafter", "d", "--target", "tiny", "--data", "x", "--bogus"],
                    "  --temperature (list[float], default [0.0], >= 0)"),
    "dflash-regen": ("dflash_nb.regen", ["--out", "out", "--bogus"], "  --max-new-tokens (int, default 1024, >= 1)"),
    "dflash-export": ("dflash_nb.export", ["--checkpoint", "c", "--out", "o", "--bogus"],
                      "--dtype ({float32, bfloat16, float16} or null, default None)"),
    "dflash-prompt-set": ("dflash_nb.prompt_set", ["--out", "out", "--bogus"],
                          "  --heldout-fraction (float, default 0.05, >= 0)"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_scripts_installed_help_and_bad_flag(script, tmp_path):
    "`make install` (pip install -e .) puts the four command lines next to python: --help exits 0, an unknown flag is one line and exit 2."
    exe = Path(sys.executable).parent / script
    assert exe.is_file(), f"{exe} missing: settings.ini console_scripts -> setup.py entry_points (rerun make install)"
    _, bad, shown = SCRIPTS[script]
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {script} ") and r.stderr == "", r.stderr  # named as typed
    assert shown in r.stdout and "fault." not in r.stdout and "TEST ONLY" not in r.stdout, r.stdout
    r = subprocess.run([str(exe), *bad], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.startswith(f"{script}: error: ") and "--bogus" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []                          # refused before anything was written


def test_help_names_real_types_and_hides_test_knobs():
    "`--help` of the train and data configs: Literal choices, `or null`, list element types, a dict's keys; no fault knobs."
    from dflash_nb.config import config_help
    from dflash_nb.records import DataConfig
    h, full = config_help(RunConfig), config_help(RunConfig, hidden=True)
    for line in ("  data.overlong ({truncate, drop}, default 'truncate')",
                 "  data.start_method ({auto, fork, forkserver, spawn}, default 'auto')",
                 "  train.gamma (float or null, default None, > 0)",
                 "  regenerate.max_prompts (int or null, default None, >= 1)",
                 "  train.devices (list[list[str]], default [])",
                 "  train.optim.betas (list[float], default [0.9, 0.95], >= 0, <= 0.999999)",
                 "  data.role_map (dict[str, str], default {'human': 'user', 'gpt': 'assistant'})"):
        assert line in h, line
    keys = h.split("  train.drafter (dict, default {})", 1)[1].split("\n  train.optim.lr", 1)[0]   # the keys block under it
    assert "block_size (int)" in keys and "layer_types (list[{full, sliding}] or null)" in keys, keys
    assert all(len(l) <= 110 for l in keys.splitlines()[1:]), keys
    assert not any(t in h for t in ("(Optional", "(Literal", "(Union", "(list,", "typing.")), h
    assert "train.fault" not in h and "TEST ONLY" not in h
    assert "  train.fault.sigkill_at_step (int or null, default None)" in full and len(full) > len(h)
    assert load_config(RunConfig, None, ["train.fault.nan_loss_steps=[2]"]).train.fault.nan_loss_steps == [2]  # hidden, still a key
    assert "overlong ({truncate, drop}" in config_help(DataConfig)


def test_yaml_words_for_literal_choices():
    "YAML 1.1 reads `off` as False: `train.amp=off` on the command line must mean the choice 'off', not be refused."
    from dflash_nb.config import from_dict, apply_overrides
    from dflash_nb.train_config import TrainConfig
    assert from_dict(TrainConfig, apply_overrides({}, ["amp=off"])).amp == "off"
    assert from_dict(TrainConfig, apply_overrides({}, ["amp=bfloat16"])).amp == "bfloat16"
    with pytest.raises(ConfigError, match="amp: expected one of"):
        from_dict(TrainConfig, apply_overrides({}, ["amp=yes"]))   # True has no word among auto/bfloat16/off
