"""Warm starts (`train.init_from`): a drafter created and saved by the DFlash authors' own package (`dflash.model`,
the format of the published drafters) initialises training; its config is taken when the run gives no drafter
overrides; overrides that disagree are refused with the field named, by the API and by the CLI."""
import json
import pytest
import torch
from transformers import Qwen3Config

import dflash.model as dflash_model

from _trainer_common import TINY, make_data, run_module, train_dict, write_run_config
from dflash_nb.config import ConfigError, apply_overrides, from_dict
from dflash_nb.train_config import TrainConfig
from dflash_nb.trainer import train

T = TINY["target"]["tiny"]
MASK = 151669


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    "A drafter for the tiny test target, made and saved by the dflash package itself (random init)."
    torch.manual_seed(5)
    cfg = Qwen3Config(hidden_size=T["hidden_size"], num_attention_heads=T["num_heads"],
                      num_key_value_heads=T["num_kv_heads"], head_dim=T["head_dim"], intermediate_size=96,
                      num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=7,
                      use_sliding_window=True,
                      vocab_size=151936, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      max_position_embeddings=32768, num_target_layers=T["num_layers"], block_size=4,
                      dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 2], "block_size": 4},
                      initializer_range=0.2)
    d = dflash_model.DFlashDraftModel(cfg).eval()
    out = tmp_path_factory.mktemp("published") / "drafter"
    d.save_pretrained(str(out))
    return out, {k: v.detach().clone() for k, v in d.state_dict().items() if "rotary" not in k}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("ws") / "data", n=8)


def _cfg(tmp_path, data, **kw):
    d = train_dict(tmp_path / "run", data, steps=1, **kw)
    # the drafter section replaced, not merged: {} means "take the directory's"
    return from_dict(TrainConfig, apply_overrides(d, {"drafter": kw["drafter"]} if "drafter" in kw else {}))


def test_init_from_dflash_package_drafter(tmp_path, data, published):
    src, theirs = published
    # a near-zero learning rate: after one step the weights are still the published ones (AdamW moves each by ~lr)
    out = train(_cfg(tmp_path, data, init_from=str(src), drafter={}, optim={"lr": 1e-9}))
    d = out["drafter"]
    c = d.config
    assert (c.num_hidden_layers, c.layer_types, c.sliding_window, c.block_size, c.intermediate_size) == \
        (2, ["sliding", "full"], 7, 4, 96)
    assert (c.target_layer_ids, c.mask_token_id) == ([1, 2], MASK)
    mine = d.trainable_state_dict()
    assert set(mine) == set(theirs)
    for k, v in theirs.items():
        torch.testing.assert_close(mine[k].float().cpu(), v.float(), rtol=0, atol=1e-6, msg=k)
    events = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "warm_start" and e["tensors"] == len(theirs) for e in events)
    # and a run without init_from starts elsewhere (the comparison above is not vacuous)
    drafter = apply_overrides(TINY["drafter"], {"num_hidden_layers": 2, "layer_types": ["sliding", "full"],
                                                "sliding_window": 7, "intermediate_size": 96, "target_layer_ids": [1, 2]})
    fresh = train(_cfg(tmp_path / "fresh", data, drafter=drafter,
                       optim={"lr": 1e-9}))["drafter"].trainable_state_dict()
    assert not torch.allclose(fresh["fc.weight"].cpu(), theirs["fc.weight"], atol=1e-3)


@pytest.mark.parametrize("field,value,words", [
    ("block_size", 8, "drafter.block_size is 8 in this run but 4"),
    ("target_layer_ids", [0, 2], "drafter.target_layer_ids is [0, 2] in this run but [1, 2]"),
    ("mask_token_id", MASK + 1, "drafter.mask_token_id"),
    ("layer_types", ["full", "full"], "drafter.layer_types"),
])
def test_init_from_refuses_a_mismatch(tmp_path, data, published, field, value, words):
    src, _ = published
    drafter = {"num_hidden_layers": 2, "layer_types": ["sliding", "full"], "sliding_window": 7, "block_size": 4,
               "intermediate_size": 96, "target_layer_ids": [1, 2], "mask_token_id": MASK, field: value}
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        train(_cfg(tmp_path, data, init_from=str(src), drafter=drafter))


def test_init_from_not_a_drafter(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="expected a drafter directory with config.json and model.safetensors"):
        train(_cfg(tmp_path, data, init_from=str(tmp_path / "empty")))


def test_init_from_cli_names_the_field(tmp_path, data, published):
    src, _ = published
    d = train_dict(tmp_path / "run", data, steps=1, init_from=str(src))   # TINY's drafter: 1 layer
    r = run_module(write_run_config(tmp_path / "c.yaml", d), timeout=300)
    assert r.returncode != 0
    assert "init_from" in r.stderr and "drafter.intermediate_size is 64 in this run but 96" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("edit,words", [
    (lambda c: json.dumps({**c, "intermediate_size": 10 ** 10}),
     "config.json num_hidden_layers=2, intermediate_size=10000000000"),
    (lambda c: json.dumps({**c, "num_hidden_layers": 10 ** 9}), "config.json num_hidden_layers=1000000000"),
    (lambda c: "[" * 50_000 + "]" * 50_000, "config.json: nested deeper than 64 levels"),
    (lambda c: "{bad", "config.json: not valid JSON"),
])
def test_init_from_config_json_bounded(tmp_path, data, published, edit, words):
    "A published config.json with absurd sizes, hostile nesting or broken syntax: one ConfigError naming the file, "
    "before any drafter tensor is allocated."
    import shutil
    src = tmp_path / "drafter"
    shutil.copytree(published[0], src)
    (src / "config.json").write_text(edit(json.loads((src / "config.json").read_text())))
    with pytest.raises(ConfigError) as e: train(_cfg(tmp_path, data, init_from=str(src), drafter={}))
    assert words in str(e.value) and str(src / "config.json") in str(e.value), str(e.value)
