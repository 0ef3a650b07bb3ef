"""vLLM is the judge: a drafter trained here, exported, and served by vLLM (the serving environment `make serving`
builds) must leave greedy output unchanged and reach, by vLLM's own counters, the acceptance length dflash_nb measures
on the same prompts (`prompt_set_tau`, what `dflash-eval --prompts` reports): token ids in on both sides, the same
budget and stop ids. All-full and all-sliding drafters are served on this CPU; a drafter mixing the two needs vLLM's V2
model runner, which needs a GPU Triton, and vLLM says so.

Cost: one short training run (~1 min) and three vLLM engines (~30 s each to start), shared by the module's tests."""
import dataclasses, time
import pytest, torch

from _serving_common import served_target, write_served_target
from dflash_nb.anchors import anchor_block_labels, block_input_ids, block_position_ids, make_packed_row, sample_anchors
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.evaluate import prompt_set_tau
from dflash_nb.export import export_drafter, load_exported_drafter
from dflash_nb.loss import block_loss
from dflash_nb.model import DFlashDrafter, DrafterConfig, resolve_mask_token_id
from dflash_nb.records import load_tokenizer, qwen3_tokenizer_dir
from dflash_nb.serving import ServingError, VLLMEngine, acceptance_length
from dflash_nb.target import TargetFeatures

pytestmark = pytest.mark.slow

B, N_NEW, STEPS, WINDOW = 4, 32, 80, 8   # block size, new tokens per prompt, training steps, the sliding variant's window
WORDS = ("the a of to and in is that it for on with as was at by an be this from or have not are but cat dog house "
         "river code model token block draft target speed light water stone music paper").split()


def prompts(tok, n=12, seed=0):
    "`n` short real-tokenizer prompts of 8-16 words (fixed seed)."
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(8, 17, (1,), generator=g))
        out.append(tok(" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=g)))["input_ids"])
    return out


def train(target, cfg, samples, steps=STEPS, lr=1e-2):
    "A plain training loop: the drafter learns the target's own greedy continuations of the prompts."
    tf = TargetFeatures(target, cfg.target_layer_ids)
    rows = [make_packed_row(samples[i:i + 6]) for i in range(0, len(samples), 6)]
    feats = [tf(r["input_ids"], r["doc_ids"]) for r in rows]
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, tf.embed_tokens, tf.lm_head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        row, f = rows[i % len(rows)], feats[i % len(rows)]
        anchors, keep = sample_anchors(row["loss_mask"], row["doc_ids"], B, 16, generator=gen)
        labels, valid = anchor_block_labels(row["input_ids"], row["loss_mask"], row["doc_ids"], anchors, keep, B)
        hidden = drafter(f, row["position_ids"], block_input_ids(row["input_ids"], anchors, keep, B, cfg.mask_token_id),
                         block_position_ids(row["position_ids"], anchors, B),
                         AnchorBlockLayout(anchors, keep, row["doc_ids"], B), backend="sdpa")
        loss = block_loss(hidden, tf.lm_head.weight, labels, valid).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    "The target dir, the prompts, their greedy continuations, and one trained drafter exported in three layouts."
    torch.set_num_threads(1)
    t0, root = time.perf_counter(), tmp_path_factory.mktemp("vllm")
    tok, target = load_tokenizer(qwen3_tokenizer_dir()), served_target()
    target_dir = write_served_target(root / "target", target)
    ps, stop = prompts(tok), [int(target.config.eos_token_id)]
    with torch.no_grad():
        greedy = [target.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=stop,
                                  pad_token_id=stop[0])[0, len(p):].tolist() for p in ps]
    samples = [dict(input_ids=p + c, loss_mask=[0] * len(p) + [1] * len(c)) for p, c in zip(ps, greedy)]
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=2, target_layer_ids=[1, 2], block_size=B,
                                    mask_token_id=resolve_mask_token_id(tok, target.config.vocab_size))
    state = train(target, cfg, samples).trainable_state_dict()
    layouts = {"full": ["full", "full"], "sliding": ["sliding", "sliding"], "mixed": ["sliding", "full"]}
    exports = {name: export_drafter(state, dataclasses.replace(cfg, layer_types=kinds, sliding_window=WINDOW),
                                    root / name) for name, kinds in layouts.items()}
    print(f"target, greedy references, training and exports: {time.perf_counter() - t0:.0f} s")
    return dict(target=target, target_dir=target_dir, prompts=ps, greedy=greedy, stop=stop, exports=exports)


def ours(served, name) -> dict:
    "dflash_nb's τ on the prompts, as `dflash-eval --prompts` computes it, for the export `name` loaded back."
    t = served["target"]
    drafter = load_exported_drafter(served["exports"][name], t.get_input_embeddings(), t.get_output_embeddings())
    return prompt_set_tau(drafter, t, [torch.tensor(p) for p in served["prompts"]], (0.0,), N_NEW, B,
                          stop_token_ids=served["stop"])[0.0]


@pytest.fixture(scope="module")
def runs(served):
    "vLLM's greedy outputs and counters without a drafter and with each servable layout (one engine at a time)."
    out = {}
    for name in ("plain", "full", "sliding"):
        t0 = time.perf_counter()
        with VLLMEngine(served["target_dir"], None if name == "plain" else served["exports"][name],
                        max_model_len=256) as engine:
            r = engine.generate(served["prompts"], N_NEW, stop_token_ids=served["stop"])
            out[name] = dict(outputs=r["outputs"], spec=engine.spec_metrics(), start=engine.load_seconds)
        print(f"vLLM {name}: started in {out[name]['start']:.0f} s, {time.perf_counter() - t0:.0f} s in all")
    return out


def test_vllm_greedy_is_the_targets_greedy_with_and_without_the_drafter(served, runs):
    assert runs["plain"]["outputs"] == served["greedy"]          # vLLM's target is transformers' target
    assert runs["plain"]["spec"] is None
    for name in ("full", "sliding"):
        assert runs[name]["outputs"] == runs["plain"]["outputs"], name   # lossless: the drafter changes no token


def accepted_at_least(hist) -> list[int]:
    "From a histogram of accepted + 1 (index 0: nothing accepted): cycles whose accepted prefix reached slot k = 1.."
    return [sum(hist[k:]) for k in range(1, len(hist))]


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_vllm_acceptance_equals_dflash_nb_tau(served, runs, name):
    spec, mine = runs[name]["spec"], ours(served, name)
    tau = acceptance_length(spec)
    msg = f"{name}: vLLM τ {tau:.4f} ({spec}), dflash_nb τ {mine['tau']:.4f} ({mine['cycles']} cycles, {mine['histogram']})"
    print(msg)
    assert spec["accepted"] > 0 and mine["tau"] > 1.0, msg                  # the drafter drafts something accepted
    assert abs(tau - mine["tau"]) <= 0.02 * mine["tau"], msg
    assert abs(spec["drafts"] - mine["cycles"]) <= 0.02 * mine["cycles"], msg
    for k, (theirs, mine_k) in enumerate(zip(spec["accepted_per_pos"], accepted_at_least(mine["histogram"])), 1):
        assert abs(theirs - mine_k) <= max(2, 0.05 * mine_k), f"slot {k}: vLLM {theirs}, dflash_nb {mine_k}; {msg}"


def test_the_sliding_window_matters_here(served, runs):
    "The sliding variant is not the full one in disguise: the window is shorter than the sequences, τ differs."
    assert max(len(p) for p in served["prompts"]) + N_NEW > 2 * WINDOW
    assert runs["sliding"]["spec"] != runs["full"]["spec"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU with Triton vLLM's V2 model runner serves this layout")
def test_a_mixed_layout_needs_vllms_v2_runner_which_this_cpu_lacks(served):
    with pytest.raises(ServingError) as e:
        VLLMEngine(served["target_dir"], served["exports"]["mixed"], max_model_len=256)
    assert "mixed sliding/full dflash drafts" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert any("Model Runner V2 requires Triton" in line for line in e.value.log), e.value.log[-5:]
