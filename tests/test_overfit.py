"""A plain single-process training loop (not the pipelined trainer) on CPU: a DFlash drafter on a tiny Qwen3 target
overfits 8 real-tokenizer samples — loss below 10% of its start and slot-1 accuracy above 0.95.

Everything is the real code path: real Qwen3 tokenizer, packing, per-step anchor sampling, block inputs/positions/labels,
target feature capture, the drafter with the sdpa backend, the chunked block loss. The target is frozen, so its features
for the fixed row are computed once; the anchors are resampled every step."""
import time
import pytest, torch
from dflash_nb.records import qwen3_tokenizer_dir, load_tokenizer
from dflash_nb.target import tiny_target, TargetFeatures
from dflash_nb.model import DrafterConfig, DFlashDrafter, resolve_mask_token_id
from dflash_nb.anchors import make_packed_row, valid_anchor_mask, sample_anchors, anchor_block_labels, block_input_ids, block_position_ids
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.loss import block_loss

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.",
    "Speculative decoding drafts several tokens cheaply and lets the large model verify them in one pass.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "In 1969, two astronauts walked on the Moon and returned safely to Earth after eight days.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on mountains.",
    "A block diffusion drafter predicts a whole block of masked tokens in a single forward pass.",
    "Paris is the capital of France; Berlin is the capital of Germany; Rome is the capital of Italy.",
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer.",
]


@pytest.fixture
def one_thread():
    "One intra-op thread: on a shared 2-core box, OpenMP threads waiting on descheduled peers make tiny steps ~5x slower."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_drafter_overfits_eight_samples(one_thread):
    tok = load_tokenizer(qwen3_tokenizer_dir())
    samples = []
    for t in TEXTS:
        ids = tok(t)["input_ids"]
        samples.append(dict(input_ids=ids, loss_mask=[1] * len(ids)))
    row = make_packed_row(samples, max_tokens=168)          # 161 tokens + padding (doc −1)
    assert (row["doc_ids"] == -1).sum() == 7

    target = tiny_target("qwen3")
    B = 4
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=2, layer_types=["sliding", "full"], sliding_window=64,
                                    target_layer_ids=[1, 2, 3], block_size=B,
                                    mask_token_id=resolve_mask_token_id(tok, target.config.vocab_size))
    tf = TargetFeatures(target, cfg.target_layer_ids)
    features = tf(row["input_ids"], row["doc_ids"])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, tf.embed_tokens, tf.lm_head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)

    def step(max_anchors):
        anchors, keep = sample_anchors(row["loss_mask"], row["doc_ids"], B, max_anchors, generator=gen)
        labels, valid = anchor_block_labels(row["input_ids"], row["loss_mask"], row["doc_ids"], anchors, keep, B)
        hidden = drafter(features, row["position_ids"],
                         block_input_ids(row["input_ids"], anchors, keep, B, cfg.mask_token_id),
                         block_position_ids(row["position_ids"], anchors, B),
                         AnchorBlockLayout(anchors, keep, row["doc_ids"], B), backend="sdpa")
        return block_loss(hidden, tf.lm_head.weight, labels, valid, recompute=not torch.is_grad_enabled())

    def evaluate():
        "Loss and per-slot accuracy over every valid anchor of the row."
        with torch.no_grad():
            out = step(n_valid)
        return out.loss.item(), (out.slot_correct.float() / out.slot_count.clamp(min=1)).tolist()

    n_valid = int(valid_anchor_mask(row["loss_mask"], row["doc_ids"]).sum())   # all of them, no padded anchors
    start_loss, start_acc = evaluate()
    assert start_loss > 10 and start_acc[1] < 0.05
    t0, history = time.time(), []
    for i in range(1, 401):
        out = step(16)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        history.append(round(out.loss.item(), 3))
        batch_acc1 = (out.slot_correct[1] / out.slot_count[1].clamp(min=1)).item()
        if out.loss.item() < 0.08 * start_loss and batch_acc1 > 0.95 and i % 10 == 0:  # looks done: check all anchors
            loss, acc = evaluate()
            if loss < 0.1 * start_loss and acc[1] > 0.95: break
    loss, acc = evaluate()
    msg = f"start {start_loss:.3f}, end {loss:.3f} after {i} steps ({time.time() - t0:.0f} s), slot acc {acc}, losses {history[::20]}"
    print(msg)
    assert loss < 0.1 * start_loss, msg
    assert acc[1] > 0.95, msg
    # the frozen target was not touched by training
    assert tf.lm_head.weight.grad is None and tf.embed_tokens.weight.grad is None
