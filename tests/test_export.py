"""Export to the serving format: round trip (identical logits), config fields vs the training config, tensor names read
with safetensors directly (no embedding / lm_head), atomic replacement under a crash, the trainer-checkpoint CLI."""
import contextlib, copy, io, json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from safetensors import safe_open

from dflash_nb.target import tiny_target
from dflash_nb.model import DrafterConfig, DFlashDrafter, read_exported_config, drafter_config_from_serving
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.anchors import block_input_ids, block_position_ids
from dflash_nb import export as ex

REPO = Path(__file__).resolve().parents[1]
SERVING_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"}
LAYER_PARTS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    target = tiny_target()
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=3, layer_types=["sliding", "full", "sliding"],
                                    sliding_window=6, block_size=4, target_layer_ids=[0, 2, 4], mask_token_id=151669)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()
    with torch.no_grad():  # not the init values: every weight distinct, norms too
        for p in drafter.parameters(): p.add_(torch.randn_like(p) * 0.05)
    return target, cfg, drafter


def _logits(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, B = 30, drafter.config.block_size
    anchors, keep = torch.tensor([2, 11, 19, 27]), torch.ones(4, dtype=torch.bool)
    doc = torch.tensor([0] * 14 + [1] * 16)
    pos = torch.cat([torch.arange(14), torch.arange(16)])
    ids = torch.randint(0, 151000, (S,), generator=g)
    feats = torch.randn(S, drafter.config.feature_size, generator=g)
    with torch.no_grad():
        h = drafter(feats, pos, block_input_ids(ids, anchors, keep, B, drafter.config.mask_token_id),
                    block_position_ids(pos, anchors, B), AnchorBlockLayout(anchors, keep, doc, B))
        return drafter.logits(h)


def test_round_trip_identical_logits_and_names(setup, tmp_path):
    target, cfg, drafter = setup
    out = ex.export_drafter(drafter, cfg, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == [".dflash_nb_export.json", "config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names, meta = set(f.keys()), f.metadata()
        tensors = {k: f.get_tensor(k) for k in names}
    want = SERVING_NAMES | {f"layers.{i}.{p}" for i in range(3) for p in LAYER_PARTS}
    assert names == want
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert meta["format"] == "pt"
    for k, v in drafter.trainable_state_dict().items(): assert torch.equal(tensors[k], v), k
    loaded = ex.load_exported_drafter(out, target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.equal(_logits(loaded), _logits(drafter))


def test_config_fields_match_training_config(setup, tmp_path):
    target, cfg, drafter = setup
    out = ex.export_drafter(drafter, cfg, tmp_path / "d")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "block_size", "num_target_layers", "vocab_size", "rms_norm_eps", "sliding_window",
              "max_position_embeddings"):
        assert c[k] == getattr(cfg, k), k
    assert c["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert c["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [0, 2, 4], "block_size": 4}
    assert c["rope_theta"] == cfg.rope_theta == target.config.rope_parameters["rope_theta"]
    assert c["rope_parameters"]["rope_theta"] == cfg.rope_theta
    assert c["hidden_size"] == target.config.hidden_size and c["num_target_layers"] == target.config.num_hidden_layers
    assert c["dtype"] == "float32" and c["tie_word_embeddings"] is False
    assert read_exported_config(out) == cfg
    # a serving stack reads it as a plain Qwen3 config
    from transformers import AutoConfig
    hc = AutoConfig.from_pretrained(str(out))
    assert type(hc).__name__ == "Qwen3Config"
    assert (hc.num_hidden_layers, hc.layer_types, hc.sliding_window, hc.head_dim) == (3, c["layer_types"], 6, cfg.head_dim)
    # without our recorded config (z-lab style), the serving fields alone rebuild the same DrafterConfig
    c.pop("dflash_nb_drafter_config")
    assert drafter_config_from_serving(c) == cfg


def test_bf16_export_and_atomic_replace(setup, tmp_path):
    target, cfg, drafter = setup
    out = ex.export_drafter(drafter, cfg, tmp_path / "drafter")
    ex.export_drafter(drafter, cfg, out, dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    # the file holds exactly the fp32 weights rounded to bf16, nothing else changed
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for k, v in drafter.trainable_state_dict().items(): assert torch.equal(f.get_tensor(k), v.to(torch.bfloat16)), k
    # so the loaded drafter IS the fp32 drafter with its weights rounded to bf16: identical logits, in fp32 and in bf16
    rounded = copy.deepcopy(drafter)
    with torch.no_grad():
        for k, prm in rounded.named_parameters():
            if k in drafter.trainable_state_dict(): prm.copy_(prm.to(torch.bfloat16).float())
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    loaded = ex.load_exported_drafter(out, emb, head, dtype=torch.float32)
    ref = _logits(rounded)
    assert torch.equal(_logits(loaded), ref)
    loaded16 = ex.load_exported_drafter(out, emb, head)
    assert {p.dtype for p in loaded16.parameters()} == {torch.bfloat16}
    for prm in rounded.parameters(): prm.data = prm.data.to(torch.bfloat16)  # parameters only: RoPE buffers stay fp32
    assert torch.equal(_logits(loaded16), _logits(rounded))
    # and the rounding costs only bf16 precision: a few bf16 eps of the logit scale, not more
    full, eps = _logits(drafter), torch.finfo(torch.bfloat16).eps
    err, scale = (ref - full).abs().max().item(), full.abs().max().item()
    assert 0 < err <= 8 * eps * scale, (err, scale)


def test_crash_mid_export_keeps_previous(setup, tmp_path, monkeypatch):
    "Fault injection: the weight write dies half-way; the previous export stays complete and loadable."
    target, cfg, drafter = setup
    out = ex.export_drafter(drafter, cfg, tmp_path / "drafter")
    before = (out / "model.safetensors").read_bytes()
    import safetensors.torch as st
    real = st.save_file
    def dying(tensors, path, metadata=None):
        real(dict(list(tensors.items())[:2]), path, metadata=metadata)  # a partial file, then the crash
        raise OSError("disk full (injected)")
    monkeypatch.setattr(st, "save_file", dying)
    with pytest.raises(OSError, match="injected"):
        ex.export_drafter(drafter, cfg, out, dtype="bfloat16")
    assert (out / "model.safetensors").read_bytes() == before
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    ex.load_exported_drafter(out, target.get_input_embeddings(), target.get_output_embeddings())


def test_refuses_frozen_weights_and_wrong_target(setup, tmp_path):
    target, cfg, drafter = setup
    sd = dict(drafter.trainable_state_dict()); sd["embed_tokens.weight"] = target.get_input_embeddings().weight
    with pytest.raises(ValueError, match="never exported"):
        ex.export_drafter(sd, cfg, tmp_path / "x")
    out = ex.export_drafter(drafter, cfg, tmp_path / "d")
    other = tiny_target(hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="hidden size"):
        ex.load_exported_drafter(out, other.get_input_embeddings(), other.get_output_embeddings())


def test_checkpoint_cli(tmp_path):
    "A real (2-step) training run's checkpoint → `python -m dflash_nb.export` → loads with the same weights and config."
    from dflash_nb.config import from_dict
    from dflash_nb.train_config import TrainConfig
    from dflash_nb.trainer import train
    from dflash_nb.checkpoint import resolve_checkpoint
    from dflash_nb.records import qwen3_tokenizer_dir, DataConfig
    from dflash_nb.inputs import synthetic_records, write_jsonl
    from dflash_nb.shards import tokenize_dataset
    src = write_jsonl(synthetic_records(6, seed=0, approx_tokens=40), tmp_path / "in.jsonl")
    tokenize_dataset([str(src)], qwen3_tokenizer_dir(), tmp_path / "data",
                     DataConfig(workers=1, max_seq_len=160, min_loss_tokens=8), verbose=False)
    tiny = {"hidden_size": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64, "seed": 1}
    cfg = from_dict(TrainConfig, {"run_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"), "steps": 2,
                                  "global_batch": 1, "max_tokens": 160, "max_anchors": 8, "log_every": 1, "pipeline": False,
                                  "target": {"tiny": tiny}, "backend": "sdpa",
                                  "drafter": {"num_hidden_layers": 2, "block_size": 4, "target_layer_ids": [0, 2],
                                              "layer_types": ["sliding", "full"], "sliding_window": 64}})
    summary = train(cfg)
    drafter, dcfg = summary["drafter"], summary["drafter_config"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "dflash_nb.export", "--checkpoint", str(tmp_path / "run"), "--out",
                        str(tmp_path / "export"), "--tensor-parallel-size", "4"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "exported" in r.stdout
    serve = r.stdout.splitlines()[-1]                            # the target split over 4 GPUs when served
    assert serve.startswith("serve with: vllm serve <target> --speculative-config '{") and serve.endswith(
        "}' --tensor-parallel-size 4"), serve
    out = tmp_path / "export"
    assert read_exported_config(out) == dcfg
    c = json.loads((out / "config.json").read_text())
    assert c["dflash_config"]["target_layer_ids"] == [0, 2] and c["block_size"] == 4
    assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["sliding_window"] == 64
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["checkpoint"] == resolve_checkpoint(tmp_path / "run").name and f.metadata()["step"] == "2"
        names = set(f.keys())
        for k, v in drafter.trainable_state_dict().items(): assert torch.equal(f.get_tensor(k), v.cpu()), k
    assert names == set(drafter.trainable_state_dict())
    target = summary["target"]
    loaded = ex.load_exported_drafter(out, target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.equal(_logits(loaded), _logits(drafter.eval()))


def _cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "dflash_nb.export", *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_export_out_never_destroys_foreign_dirs(setup, tmp_path):
    "`--out` over a foreign dir, over an export holding user files, or over an export without --overwrite: exit 2, one line, nothing touched."
    from dflash_nb.checkpoint import save_checkpoint, rng_state
    target, cfg, drafter = setup
    from dflash_nb.config import to_dict
    m = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    ck = save_checkpoint(tmp_path / "run" / "checkpoints", 3, drafter.trainable_state_dict(), m,
                         torch.optim.lr_scheduler.LambdaLR(m, lambda s: 1.0), {"step": 3}, [rng_state(torch.device("cpu"))],
                         extra={"drafter_config.json": json.dumps(to_dict(cfg))})
    models = tmp_path / "models"; (models / "llama").mkdir(parents=True); (models / "llama" / "w.bin").write_text("x")
    snap = lambda d: {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    before = snap(models)
    r = _cli("--checkpoint", ck, "--out", models)
    assert r.returncode == 2 and "is not a drafter export" in r.stderr and str(models) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and snap(models) == before
    out = tmp_path / "export"
    assert _cli("--checkpoint", ck, "--out", out).returncode == 0
    r = _cli("--checkpoint", ck, "--out", out)
    assert r.returncode == 2 and "--overwrite" in r.stderr, r.stderr
    (out / "README.md").write_text("mine")
    r = _cli("--checkpoint", ck, "--out", out, "--overwrite")
    assert r.returncode == 2 and "README.md" in r.stderr and (out / "README.md").read_text() == "mine", r.stderr
    (out / "README.md").unlink()
    r = _cli("--checkpoint", ck, "--out", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert read_exported_config(out) == cfg


def test_corrupt_export_names_the_file(setup, tmp_path):
    "A model.safetensors that is not one (here: a pickle) is refused with the file named, never unpickled."
    import pickle
    target, cfg, drafter = setup
    out = ex.export_drafter(drafter, cfg, tmp_path / "export")
    (out / "model.safetensors").write_bytes(pickle.dumps({"fc.weight": [1.0]}))
    with pytest.raises(ex.CorruptWeightsError, match=r"model\.safetensors is not a readable safetensors file"):
        ex.load_exported_drafter(out, target.get_input_embeddings(), target.get_output_embeddings())


def test_what_a_killed_export_left_goes_with_the_next(setup, tmp_path):
    """A killed export's temp dir beside --out and a killed --num-speculative-tokens write's temp inside it (their pids
    gone) are removed by the next export, which then replaces the export as asked; a live export's temp dir stays (no
    lock guards --out). Before: the temps stayed, and the one inside made --overwrite refuse ("files it did not write")."""
    from dflash_nb.checkpoint import save_checkpoint, rng_state
    from dflash_nb.config import to_dict
    target, cfg, drafter = setup
    m = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    ck = save_checkpoint(tmp_path / "run" / "checkpoints", 3, drafter.trainable_state_dict(), m,
                         torch.optim.lr_scheduler.LambdaLR(m, lambda s: 1.0), {"step": 3}, [rng_state(torch.device("cpu"))],
                         extra={"drafter_config.json": json.dumps(to_dict(cfg))})
    out, dead = tmp_path / "export", 2**22 + 7                 # above Linux's largest pid: no process has it
    def export(*args):                                         # dflash-export in this process, its output dropped
        with contextlib.redirect_stdout(io.StringIO()): return ex.main(["--checkpoint", str(ck), *map(str, args)])
    export("--out", out, "--num-speculative-tokens", "2")
    assert sorted(p.name for p in out.iterdir()) == [".dflash_nb_export.json", "config.json", "model.safetensors"]
    (out / f".config.json.tmp-{dead}").write_text('{"dflash_co')
    (tmp_path / f".export.tmp-{dead}").mkdir()
    (tmp_path / f".export.tmp-{dead}" / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".export.tmp-{os.getppid()}").mkdir()
    export("--out", out, "--overwrite")                       # before: "holds files it did not write", exit 2
    assert sorted(p.name for p in out.iterdir()) == [".dflash_nb_export.json", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.glob(".export.*")) == [f".export.tmp-{os.getppid()}"]
