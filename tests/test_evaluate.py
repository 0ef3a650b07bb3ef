"""τ and the speculative loop: lossless against plain greedy decoding on 20 chat prompts (real Qwen3 tokenizer, tiny
target) with an untrained and a briefly trained drafter; the walk's τ (cycle by cycle) equals the real loop's; forced
perfect / wrong drafters (fault injection) give τ = B / τ = 1; hybrid targets snapshot their linear-attention state
(same output and drafter context as recomputing); the CLI."""
import copy, json, os, subprocess, sys
from pathlib import Path
import pytest, torch

from dflash_nb.target import tiny_target, TargetFeatures
from dflash_nb.model import DrafterConfig, DFlashDrafter
from dflash_nb.records import qwen3_tokenizer_dir, load_tokenizer
from dflash_nb.anchors import sample_anchors, anchor_block_labels, block_input_ids, block_position_ids
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.loss import block_loss
from dflash_nb.decoding import (acceptance_length, speculative_generate, greedy_generate, walk_sample,
                                DrafterProposer, ForcedProposer)
from dflash_nb.tau import compare_decoding

REPO = Path(__file__).resolve().parents[1]
B, N_NEW, N_PROMPTS = 8, 17, 20          # 17 = 1 (prefill) + 2·B: a forced-perfect drafter fills every cycle
QUESTIONS = ["What is {i} plus {j}?", "Name {i} animals that live in the sea.", "Write a haiku about the number {j}.",
             "Explain recursion to a {i}-year-old.", "Translate 'good morning' into {j} languages."]


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    tok = load_tokenizer(qwen3_tokenizer_dir())
    # a tiny Qwen3 with tied embeddings: its greedy text mixes runs of repeated tokens with noise, so a briefly
    # trained drafter accepts some blocks and misses others (a random untied tiny target is unlearnable in seconds)
    target = tiny_target(tie_word_embeddings=True, initializer_range=0.035)
    prompts = []
    for n in range(N_PROMPTS):
        q = QUESTIONS[n % len(QUESTIONS)].format(i=n + 2, j=3 * n + 1)
        prompts.append(torch.tensor(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)))
    greedy = [greedy_generate(target, p, N_NEW)["tokens"] for p in prompts]
    refs = [torch.cat([p, g]) for p, g in zip(prompts, greedy)]
    samples = [dict(input_ids=r.tolist(), loss_mask=[0] * len(p) + [1] * N_NEW) for p, r in zip(prompts, refs)]
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=1, block_size=B, target_layer_ids=[1, 3, 4],
                                    mask_token_id=151669)
    feats = TargetFeatures(target, cfg.target_layer_ids)
    torch.manual_seed(0)
    untrained = DFlashDrafter(cfg, feats.embed_tokens, feats.lm_head).eval()
    trained = _train(copy.deepcopy(untrained), feats, refs, samples, steps=40)
    return dict(target=target, prompts=prompts, greedy=greedy, refs=refs, samples=samples, cfg=cfg, feats=feats,
                untrained=untrained, trained=trained)


def _train(drafter, feats, refs, samples, steps, lr=1e-2):
    "A few optimizer steps on the target's own greedy continuations (the trainer's loss, one sample per step)."
    drafter.train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(0)
    rows = [feats(r, torch.zeros(len(r), dtype=torch.long)) for r in refs]
    for step in range(steps):
        i = step % len(refs)
        r, S = refs[i], len(refs[i])
        lm, doc, pos = torch.tensor(samples[i]["loss_mask"]).bool(), torch.zeros(S, dtype=torch.long), torch.arange(S)
        a, keep = sample_anchors(lm, doc, B, 32, generator=g)
        labels, valid = anchor_block_labels(r, lm, doc, a, keep, B)
        h = drafter(rows[i], pos, block_input_ids(r, a, keep, B, drafter.config.mask_token_id), block_position_ids(pos, a, B),
                    AnchorBlockLayout(a, keep, doc, B))
        loss = block_loss(h, feats.lm_head.weight, labels, valid).loss
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0); opt.step()
    return drafter.eval()


def _loop(world, who, **kw):
    outs = [speculative_generate(who, world["target"], p, N_NEW, block_size=B, layer_ids=world["cfg"].target_layer_ids, **kw)
            for p in world["prompts"]]
    return outs, [o["accept_lengths"] for o in outs]


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_lossless_and_walk_equals_loop(world, which):
    drafter = world[which]
    outs, loop_lengths = _loop(world, drafter)
    for o, g in zip(outs, world["greedy"]):
        assert torch.equal(o["tokens"], g)                     # token for token, all 20 prompts
    walk = acceptance_length(drafter, world["feats"], world["samples"], block_size=B)
    flat = sum(loop_lengths, [])
    assert walk["samples"] == N_PROMPTS and walk["cycles"] == len(flat)
    assert walk["tau"] == pytest.approx(sum(flat) / len(flat), abs=0)
    assert walk["per_sample_tau"] == [sum(l) / len(l) for l in loop_lengths]
    # cycle by cycle, sample by sample, including the one-anchor-per-forward walk
    prop = DrafterProposer(drafter, B)
    for r, p, l in zip(world["refs"], world["prompts"], loop_lengths):
        f = world["feats"](r, torch.zeros(len(r), dtype=torch.long))
        assert walk_sample(prop, r, f, len(p), len(r), B).lengths == l
        assert walk_sample(prop, r, f, len(p), len(r), B, chunk=1).lengths == l
    assert sum(walk["histogram"]) == walk["cycles"] and walk["tokens"] == N_PROMPTS * (N_NEW - 1)
    if which == "trained":  # some blocks were accepted: the loop's crop-after-rejection path really ran
        assert walk["tau"] > 1.05 and sum(walk["histogram"][1:]) > 0


def test_trained_beats_untrained(world):
    taus = {w: acceptance_length(world[w], world["feats"], world["samples"], block_size=B)["tau"] for w in ("untrained", "trained")}
    assert taus["untrained"] < 1.05 < taus["trained"], taus


@pytest.mark.parametrize("mode,tau", [("perfect", float(B)), ("wrong", 1.0)])
def test_forced_drafters(world, mode, tau):
    "Fault injection: predictions overridden to the reference (perfect) or away from it (wrong)."
    forced = ForcedProposer(world["refs"], B, mode)
    walk = acceptance_length(forced, world["feats"], world["samples"], block_size=B)
    assert walk["tau"] == tau
    assert walk["per_position"] == [1.0 if mode == "perfect" else 0.0] * (B - 1)
    hist = walk["histogram"]
    assert (hist[-1] if mode == "perfect" else hist[0]) == walk["cycles"]
    outs, lengths = _loop(world, forced)
    assert all(torch.equal(o["tokens"], g) for o, g in zip(outs, world["greedy"]))
    assert all(o["tau"] == tau for o in outs)
    assert outs[0]["forwards"] == 1 + (N_NEW - 1) // (B if mode == "perfect" else 1)


def test_partial_acceptance_and_stop_tokens(world):
    "Forced acceptance of varied length, a stop token inside an accepted block, and the cache-free path all agree."
    forced = ForcedProposer(world["refs"], B, "prefix", seed=3)
    walk = acceptance_length(forced, world["feats"], world["samples"], block_size=B)
    assert 1.5 < walk["tau"] < B
    for cache in ("dynamic", "recompute"):
        outs, lengths = _loop(world, forced, cache=cache)
        assert all(torch.equal(o["tokens"], g) for o, g in zip(outs, world["greedy"]))
        assert walk["tau"] == sum(map(sum, lengths)) / sum(map(len, lengths))
    # stop at the 10th generated token of prompt 0: both the greedy and the speculative output end there, inclusive
    p, g = world["prompts"][0], world["greedy"][0]
    stop = int(g[9])
    first = int((g == stop).nonzero()[0])
    s = speculative_generate(ForcedProposer(world["refs"], B, "perfect"), world["target"], p, N_NEW, B,
                             world["cfg"].target_layer_ids, stop_token_ids=[stop])
    assert torch.equal(s["tokens"], g[: first + 1])
    assert torch.equal(greedy_generate(world["target"], p, N_NEW, stop_token_ids=[stop])["tokens"], g[: first + 1])


def test_hybrid_target_recompute_is_lossless(world):
    "Qwen3.5-style linear attention cannot be cropped: `auto` snapshots it, and the output is still the target's greedy one."
    hyb = tiny_target("qwen3_5", num_layers=3)
    cfg = DrafterConfig.from_target(hyb.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0, 1], mask_token_id=151669)
    torch.manual_seed(0)
    dr = DFlashDrafter(cfg, hyb.get_input_embeddings(), hyb.get_output_embeddings()).eval()
    for p in world["prompts"][:3]:
        g = greedy_generate(hyb, p, 9)["tokens"]
        ref = torch.cat([p, g])
        for who in (dr, ForcedProposer([ref], 4, "prefix")):
            out = speculative_generate(who, hyb, p, 9, 4, [0, 1])
            assert out["cache"] == "snapshot" and torch.equal(out["tokens"], g)
        walk = acceptance_length(ForcedProposer([ref], 4, "prefix"), TargetFeatures(hyb, [0, 1]),
                                 [dict(input_ids=ref.tolist(), loss_mask=[0] * len(p) + [1] * 9)], block_size=4)
        assert walk["tau"] == speculative_generate(ForcedProposer([ref], 4, "prefix"), hyb, p, 9, 4, [0, 1])["tau"]


def test_recompute_reference(world):
    "Data whose completions the target did not write: recompute_reference walks the target's own greedy continuation."
    wrong = [dict(input_ids=s["input_ids"][:len(p)] + [11] * N_NEW, loss_mask=s["loss_mask"])
             for s, p in zip(world["samples"][:4], world["prompts"][:4])]
    forced = ForcedProposer(world["refs"], B, "perfect")
    res = acceptance_length(forced, world["feats"], wrong, block_size=B, recompute_reference=True)
    assert res["tau"] == B and res["samples"] == 4


def test_other_block_size(world):
    "Evaluating with a smaller block than trained (--block-size): walk and loop still agree, output still lossless."
    prompts, samples = world["prompts"][:6], world["samples"][:6]
    walk = acceptance_length(world["trained"], world["feats"], samples, block_size=4)
    outs = [speculative_generate(world["trained"], world["target"], p, N_NEW, block_size=4) for p in prompts]
    assert all(torch.equal(o["tokens"], g) for o, g in zip(outs, world["greedy"]))
    lengths = sum((o["accept_lengths"] for o in outs), [])
    assert walk["block_size"] == 4 and len(walk["histogram"]) == 4 and max(lengths) <= 4
    assert walk["tau"] == sum(lengths) / len(lengths)


def test_compare_decoding_reports(world):
    cmp = compare_decoding(world["trained"], world["target"], world["prompts"][:4], N_NEW, block_size=B)
    assert cmp["identical"] == 4 and cmp["mismatches"] == []
    assert cmp["tokens"] == 4 * N_NEW and cmp["greedy_ms_per_token"] > 0 and cmp["spec_ms_per_token"] > 0
    assert cmp["target_forwards"] == 4 + cmp["cycles"]


def test_cli(world, tmp_path):
    "`python -m dflash_nb.evaluate` on tokenized data and an exported drafter, as a real subprocess."
    from dflash_nb.records import DataConfig
    from dflash_nb.inputs import write_jsonl
    from dflash_nb.shards import tokenize_dataset
    from dflash_nb.export import export_drafter
    recs = [{"prompt": f"Question {i}: why is the sky blue?", "completion": "Because of Rayleigh scattering of sunlight by air."}
            for i in range(3)]
    tokenize_dataset([str(write_jsonl(recs, tmp_path / "in.jsonl"))], qwen3_tokenizer_dir(), tmp_path / "data",
                     DataConfig(min_loss_tokens=4, workers=1), verbose=False)
    cfg = DrafterConfig.from_target(tiny_target().config, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=151669)
    t = tiny_target()
    export_drafter(DFlashDrafter(cfg, t.get_input_embeddings(), t.get_output_embeddings()), cfg, tmp_path / "drafter")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "dflash_nb.evaluate", "--drafter", str(tmp_path / "drafter"), "--target", "tiny",
                        "--data", str(tmp_path / "data"), "--num-samples", "2", "--recompute-reference", "--max-new-tokens", "8",
                        "--speculative", "2", "--temperature", "0", "1", "--speedup", "--json", str(tmp_path / "res.json")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "τ = " in r.stdout and "identical to greedy on 2/2" in r.stdout
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["samples"] == 2 and res["block_size"] == 4 and res["tau"] == res["speculative"]["tau"]
    assert len(res["per_position"]) == 3 and sum(res["histogram"]) == res["cycles"]
    # temperature 1: speculative sampling on the samples' prompts; --speedup: forward costs and the expected speed-ups
    assert "τ at temperature 1 (speculative sampling on the 2 prompts)" in r.stdout and "expected speed-up" in r.stdout
    s1, c = res["sampled"]["1"], res["forward_costs"]
    assert 1.0 <= s1["tau"] <= 4 and sum(s1["histogram"]) == s1["cycles"]
    for tau, sp in ((res["tau"], res["expected_speedup"]), (s1["tau"], s1["expected_speedup"])):
        assert sp == pytest.approx(tau * c["target_1"] / (c["drafter"] + c["target_block"]))


# ---------------------------------------------------------------- speculative sampling is lossless (statistical test)
import itertools, math
from dflash_nb.decoding import sample_generate, sampling_probs, rejection_verify

SV, SN, SB, SM = 4, 4, 4, 1500   # vocab, generated tokens (2 drafts verified in the first cycle), block size, runs


@pytest.fixture(scope="module")
def small_world():
    "A 4-token-vocabulary target (peaked, so the drafter's q differs from p) and an untrained drafter on it."
    torch.set_num_threads(1)
    target = tiny_target(vocab_size=SV, num_layers=2, hidden_size=32, pad_token_id=0, eos_token_id=1, lm_head_std=1.0)
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=1, block_size=SB, target_layer_ids=[0],
                                    mask_token_id=SV - 1)
    torch.manual_seed(1)   # layer ids end at L - 2 = 0 (L - 1 is refused); this init gives q far enough from p
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()
    return dict(target=target, drafter=drafter, prompt=torch.tensor([2, 0, 3, 1, 2]))


def _exact_joint(model, prompt, n, **sampling):
    "The target's exact distribution of its next `n` tokens (V^n cells), from one batched forward over every prefix."
    conts = torch.tensor(list(itertools.product(range(SV), repeat=n - 1)))
    ids = torch.cat([prompt.expand(len(conts), -1), conts], 1)
    with torch.no_grad():
        pr = sampling_probs(model(input_ids=ids).logits[:, len(prompt) - 1:], **sampling)  # (V^(n-1), n, V)
    joint = torch.zeros([SV] * n)
    for r, c in enumerate(conts.tolist()):
        for last in range(SV):
            toks = c + [last]
            joint[tuple(toks)] = math.prod(float(pr[r, i, t]) for i, t in enumerate(toks))
    return joint.flatten()


def _chi2_pvalue(counts, probs):
    "Pearson χ² goodness of fit; cells expected below 5 are pooled into one. Returns (χ², df, p-value)."
    exp_all = probs * counts.sum()
    big = exp_all >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([exp_all[big], exp_all[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    x2, df = float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1
    return x2, df, float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(x2 / 2.0)))


def _spec_counts(w, runs=SM, seed=1, verify=None, **sampling):
    g, counts, lengths = torch.Generator().manual_seed(seed), torch.zeros(SV ** SN), []
    for _ in range(runs):
        o = speculative_generate(w["drafter"], w["target"], w["prompt"], SN, SB, generator=g, verify=verify, **sampling)
        counts[sum(int(t) * SV ** (SN - 1 - i) for i, t in enumerate(o["tokens"]))] += 1
        lengths += o["accept_lengths"]
    return counts, lengths


# Deliberately wrong acceptance rules (fault injection): each must fail the same test the real rule passes.
def _always_accept(drafts, p, q, g):
    n = drafts.numel()
    return n, int(torch.multinomial(p[n], 1, generator=g))

def _accept_with_p(drafts, p, q, g):        # accepts with p(d) instead of min(1, p(d)/q(d))
    n, d = drafts.numel(), drafts.view(-1, 1)
    acc = int((torch.rand(n, generator=g) < p[:n].gather(-1, d)[:, 0]).long().cumprod(0).sum())
    row = p[n] if acc == n else (p[acc] - q[acc]).clamp_min(0)
    return acc, int(torch.multinomial(row if row.sum() > 0 else p[acc], 1, generator=g))

def _resample_from_p(drafts, p, q, g):      # the right acceptance test, but redraws from p instead of the residual
    n, d = drafts.numel(), drafts.view(-1, 1)
    u = torch.rand(n, generator=g)
    acc = int((u * q[:n].gather(-1, d)[:, 0] < p[:n].gather(-1, d)[:, 0]).long().cumprod(0).sum())
    return acc, int(torch.multinomial(p[acc], 1, generator=g))

ALPHA = 1e-3


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=2.0, top_p=0.9, top_k=3)])
def test_speculative_sampling_is_lossless(small_world, sampling):
    "Joint distribution of the first 4 generated tokens (256 cells): speculative sampling vs the target's exact one."
    exact = _exact_joint(small_world["target"], small_world["prompt"], SN, **sampling)
    counts, lengths = _spec_counts(small_world, **sampling)
    x2, df, pv = _chi2_pvalue(counts, exact)
    print(sampling, x2, df, pv, sum(lengths) / len(lengths))
    assert df >= 8 and pv > ALPHA, (x2, df, pv)
    assert 1 < sum(lengths) / len(lengths) < SB and max(lengths) > 1   # drafts were accepted and rejected
    if sampling.get("top_k"): return
    # the same test on plain sampling (calibration: the exact joint is what the target samples)
    g, plain = torch.Generator().manual_seed(2), torch.zeros(SV ** SN)
    for _ in range(SM):
        toks = sample_generate(small_world["target"], small_world["prompt"], SN, generator=g, **sampling)["tokens"]
        plain[sum(int(t) * SV ** (SN - 1 - i) for i, t in enumerate(toks))] += 1
    assert _chi2_pvalue(plain, exact)[2] > ALPHA


@pytest.mark.parametrize("broken", [_always_accept, _accept_with_p, _resample_from_p])
def test_broken_acceptance_rule_fails(small_world, broken):
    "Control: the same test, same runs and seed, rejects each wrong rule (the test has the power to catch them)."
    exact = _exact_joint(small_world["target"], small_world["prompt"], SN, temperature=1.0)
    counts, _ = _spec_counts(small_world, verify=broken, temperature=1.0)
    x2, df, pv = _chi2_pvalue(counts, exact)
    print(broken.__name__, x2, df, pv)
    assert pv < ALPHA, (broken.__name__, x2, df, pv)


def test_rejection_verify_edges():
    "Zero target mass on a draft: always rejected; p == q: always accepted; all accepted: bonus from the last row."
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    for _ in range(50):
        assert rejection_verify(torch.tensor([0]), p, torch.tensor([[1.0, 0.0, 0.0]]), g) == (0, 1)
    q = torch.tensor([[0.3, 0.3, 0.4]])
    pp = torch.cat([q, torch.tensor([[0.0, 0.0, 1.0]])])
    for _ in range(50):
        assert rejection_verify(torch.multinomial(q[0], 1, generator=g), pp, q, g)[0] == 1
        assert rejection_verify(torch.zeros(0, dtype=torch.long), pp[1:], q[:0], g) == (0, 2)


def test_sampling_temperature_zero_is_greedy(world):
    "temperature=0 through the sampling arguments is the greedy loop: same tokens as plain greedy decoding."
    p, g = world["prompts"][0], world["greedy"][0]
    out = speculative_generate(world["trained"], world["target"], p, N_NEW, B, temperature=0.0, seed=3)
    assert torch.equal(out["tokens"], g)
    assert torch.equal(sample_generate(world["target"], p, N_NEW, temperature=0.0)["tokens"], g)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(world["trained"], world["target"], p, N_NEW, B, temperature=1.0, top_p=0.0)


# ---------------------------------------------------------------- benchmark prompt sets
from dflash_nb.prompts import read_prompt_file, render_prompts, PromptFileError
from dflash_nb.tau import prompt_set_tau

PROMPTS = REPO / "tests" / "data" / "prompts"


def test_prompt_files_render_like_the_chat_template():
    "Bundled files: prompt / system / messages records, a trailing reference answer dropped, ids = apply_chat_template."
    tok = load_tokenizer(qwen3_tokenizer_dir())
    for f in ("math.jsonl", "chat.jsonl"):
        convs = read_prompt_file(PROMPTS / f)
        assert all(c[-1]["role"] == "user" for c in convs)
        for c, ids in zip(convs, render_prompts(convs, tok)):
            ref = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert ids.tolist() == list(ref)
    convs = read_prompt_file(PROMPTS / "math.jsonl")
    assert convs[1][0] == {"role": "system", "content": "You are a careful math tutor."} and len(convs[2]) == 1
    # template kwargs pass through: thinking off renders the empty think block the Qwen3 template adds
    on, off = render_prompts(convs[:1], tok)[0], render_prompts(convs[:1], tok, chat_template_kwargs={"enable_thinking": False})[0]
    assert "<think>" not in tok.decode(on) and tok.decode(off).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("text,msg", [("{\"prompt\": \"a\"}\nnot json\n", "x.jsonl:2: not JSON"),
                                      ("{\"oops\": \"a\"}\n", "x.jsonl:1: no prompt or messages field"),
                                      ("{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}]}\n", "x.jsonl:1: nothing to answer"),
                                      ("\n\n", "x.jsonl: no records")])
def test_prompt_file_errors(tmp_path, text, msg):
    (tmp_path / "x.jsonl").write_text(text)
    with pytest.raises(PromptFileError, match=msg): read_prompt_file(tmp_path / "x.jsonl")


def test_prompt_set_tau_matches_the_loop(world):
    "τ of a prompt set is the loop's: forced perfect drafts at T=0 give τ = B; at T=1 the same drafts are accepted less."
    forced = ForcedProposer(world["refs"], B, "perfect")
    res = prompt_set_tau(forced, world["target"], world["prompts"][:4], (0.0,), N_NEW, B, world["cfg"].target_layer_ids)
    assert res[0.0]["tau"] == B and res[0.0]["prompts"] == 4 and res[0.0]["tokens"] == 4 * (N_NEW - 1)
    res = prompt_set_tau(world["trained"], world["target"], world["prompts"][:4], (0.0, 1.0), N_NEW, B)
    greedy_lengths = sum((speculative_generate(world["trained"], world["target"], p, N_NEW, B)["accept_lengths"]
                          for p in world["prompts"][:4]), [])
    assert res[0.0]["tau"] == sum(greedy_lengths) / len(greedy_lengths)
    again = prompt_set_tau(world["trained"], world["target"], world["prompts"][:4], (1.0,), N_NEW, B)
    assert again[1.0]["tau"] == res[1.0]["tau"] and 1.0 <= res[1.0]["tau"] <= B   # seeded: reproducible


def test_cli_prompts(tmp_path):
    "`python -m dflash_nb.evaluate --prompts A B --temperature 0 1 --json`: one row per file, one column per temperature."
    from dflash_nb.export import export_drafter
    cfg = DrafterConfig.from_target(tiny_target().config, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=151669)
    t = tiny_target()
    export_drafter(DFlashDrafter(cfg, t.get_input_embeddings(), t.get_output_embeddings()), cfg, tmp_path / "drafter")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "dflash_nb.evaluate", "--drafter", str(tmp_path / "drafter"), "--target", "tiny"]
    r = subprocess.run(base + ["--prompts", str(PROMPTS / "math.jsonl"), str(PROMPTS / "chat.jsonl"), "--temperature", "0", "1",
                               "--max-new-tokens", "6", "--chat-template-kwargs", '{"enable_thinking": false}',
                               "--speedup", "--measure-speedup", "1", "--json", str(tmp_path / "res.json")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(l for l in lines if l.startswith("prompt set"))
    assert "τ @ T=0" in head and "τ @ T=1" in head
    rows = {}
    for l in lines:   # the τ table comes first (the speed-up tables repeat the row names)
        if l.startswith(("math.jsonl", "chat.jsonl")): rows.setdefault(l.split()[0], l.split()[1:])
    assert rows["math.jsonl"][0] == "3" and rows["chat.jsonl"][0] == "2" and all(len(v) == 3 for v in rows.values())
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["temperatures"] == [0.0, 1.0] and res["chat_template_kwargs"] == {"enable_thinking": False}
    for name, row in rows.items():
        for T, shown in zip(("0", "1"), row[1:]):
            cell = res["prompt_sets"][name][T]
            assert f"{cell['tau']:.3f}" == shown and sum(cell["histogram"]) == cell["cycles"] and len(cell["per_position"]) == 3
            # expected speed-up = τ · t_1 / (t_drafter + t_block) from the costs measured in the run; the real one timed
            c = res["forward_costs"]
            assert cell["expected_speedup"] == pytest.approx(cell["tau"] * c["target_1"] / (c["drafter"] + c["target_block"]))
            assert cell["measured"]["prompts"] == 1 and cell["measured_speedup"] > 0
    assert "expected speed-up" in r.stdout and "measured: speculative loop vs plain decoding" in r.stdout
    assert res["forward_costs"]["block_size"] == 4 and min(res["forward_costs"][k] for k in ("target_1", "target_block", "drafter")) > 0
    # a bad record: one line naming the file and line, exit status 2, before any model is loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"oops": 1}\n')
    r = subprocess.run(base + ["--prompts", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    want = f"python -m dflash_nb.evaluate: error: {bad}:2: no prompt or messages field"
    assert r.returncode == 2 and r.stderr.strip() == want, r.stderr


def test_bf16_target_with_fp32_drafter(world):
    "The GPU layout (bf16 target, so bf16 shared embedding and lm_head; fp32 drafter weights; no autocast) evaluates."
    from dflash_nb.build import build_drafter
    target = copy.deepcopy(world["target"]).to(torch.bfloat16)
    feats = TargetFeatures(target, world["cfg"].target_layer_ids)
    drafter = build_drafter(world["cfg"], feats, torch.device("cpu"), seed=0).eval()
    assert drafter.fc.weight.dtype == torch.float32 and drafter.lm_head.weight.dtype == torch.bfloat16
    walk = acceptance_length(drafter, feats, world["samples"][:3], block_size=B)
    assert walk["samples"] == 3 and walk["tau"] >= 1
    for kw in (dict(), dict(temperature=1.0, generator=torch.Generator().manual_seed(0))):
        out = speculative_generate(drafter, target, world["prompts"][0], 5, block_size=B, **kw)
        assert out["tokens"].numel() == 5


# ---------------------------------------------------------------- hybrid targets: snapshot of the linear-attention state
from dflash_nb.decoding import snapshot_linear_state, restore_cache
from dflash_nb.tau import format_drafts, show_drafts
from dflash_nb.evaluate import main as eval_main

HB, H_NEW = 4, 11   # block size, generated tokens on the hybrid target


@pytest.fixture(scope="module")
def hybrid():
    "A tiny Qwen3.5-layout target (linear + full attention), a random drafter on it, and three chat prompts."
    torch.set_num_threads(1)
    target = tiny_target("qwen3_5", num_layers=3)
    cfg = DrafterConfig.from_target(target.config, num_hidden_layers=1, block_size=HB, target_layer_ids=[0, 1],
                                    mask_token_id=151669)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()
    tok = load_tokenizer(qwen3_tokenizer_dir())
    prompts = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
               for q in ("What is 2 + 2?", "Name a prime number.", "Write a haiku about rain.")]
    refs = [torch.cat([p, greedy_generate(target, p, H_NEW)["tokens"]]) for p in prompts]
    return dict(target=target, drafter=drafter, prompts=prompts, refs=refs, tok=tok)


class _Recording:
    "Wraps a proposer and keeps a copy of the drafter context (features) the loop hands it every cycle."
    def __init__(self, inner): self.inner, self.seen = inner, []
    def propose(self, input_ids, features, anchors, position_ids=None):
        self.seen.append(features.clone())
        return self.inner.propose(input_ids, features, anchors)
    def propose_sampled(self, input_ids, features, anchors, *args, **kw):
        self.seen.append(features.clone())
        return self.inner.propose_sampled(input_ids, features, anchors, *args, **kw)


class _SelfSampler:
    "The target drafting for itself from its own distributions (q = p): every draft is accepted at any temperature."
    block_size = HB
    def __init__(self, model): self.model = model
    def propose_sampled(self, input_ids, features, anchors, temperature, top_p=1.0, top_k=0, generator=None, position_ids=None):
        from dflash_nb.decoding import sampling_probs
        seq, qs = input_ids[: int(anchors[0]) + 1], []
        for _ in range(HB - 1):
            q = sampling_probs(self.model(input_ids=seq[None]).logits[0, -1], temperature, top_p, top_k)
            seq = torch.cat([seq, torch.multinomial(q, 1, generator=generator)]); qs.append(q)
        return seq[-(HB - 1):][None], torch.stack(qs)[None]
    propose = None


def _both_modes(hybrid, make, prompt, temperature, seed):
    "Run snapshot and recompute with fresh proposers and generators seeded alike; return both results, contexts, generators."
    runs = {}
    for mode in ("snapshot", "recompute"):
        rec, gen = _Recording(make()), torch.Generator().manual_seed(seed)
        out = speculative_generate(rec, hybrid["target"], prompt, H_NEW, HB, [0, 1], cache=mode, temperature=temperature,
                                   generator=gen)
        runs[mode] = (out, rec.seen, gen)
    return runs["snapshot"], runs["recompute"]


# forced proposers replay the greedy text (at T > 0 the text leaves it); the self-sampler exists for T > 0 only
@pytest.mark.parametrize("temperature,proposer", [(0.0, "random"), (0.0, "prefix"), (0.0, "perfect"), (1.0, "random"),
                                                  (1.0, "self")])
def test_snapshot_equals_recompute(hybrid, proposer, temperature):
    "Same tokens, accepted lengths, drafter context and generator use as the recompute reference; fewer target tokens."
    for i, (p, ref) in enumerate(zip(hybrid["prompts"], hybrid["refs"])):
        make = {"random": lambda: DrafterProposer(hybrid["drafter"], HB), "prefix": lambda: ForcedProposer([ref], HB, "prefix"),
                "perfect": lambda: ForcedProposer([ref], HB, "perfect"), "self": lambda: _SelfSampler(hybrid["target"])}[proposer]
        (s, fs, gs), (r, fr, gr) = _both_modes(hybrid, make, p, temperature, seed=i)
        assert s["cache"] == "snapshot" and r["cache"] == "recompute"
        assert torch.equal(s["tokens"], r["tokens"]) and s["accept_lengths"] == r["accept_lengths"]
        assert temperature > 0 or torch.equal(s["tokens"], ref[len(p):])       # greedy: the target's own text
        assert torch.equal(gs.get_state(), gr.get_state())                      # the generator drew the same numbers
        assert len(fs) == len(fr) and all(torch.allclose(x, y, atol=1e-4) for x, y in zip(fs, fr))   # fp32 rounding
        assert s["target_tokens"] < r["target_tokens"]
        cycles = len(s["accept_lengths"])
        rollbacks = s["forwards"] - 1 - cycles
        if proposer in ("perfect", "self"):    # every draft accepted: the state after the block is kept, never restored
            assert rollbacks == 0 and s["accept_lengths"][:-1] == [HB] * (cycles - 1)
        if proposer == "random":               # rejections: restored and fed again (not in the last cycle)
            assert rollbacks == sum(l < HB for l in s["accept_lengths"][:-1]) > 0


def test_restore_cache_rolls_back_the_linear_state(hybrid):
    "After a block is fed and rolled back, feeding the kept part again gives the no-cache logits; without the restore it doesn't."
    from transformers import DynamicCache
    from dflash_nb.decoding import _model_kwargs_cache_name
    t, x = hybrid["target"], hybrid["refs"][0][:30]
    want = t(input_ids=x[None, :24]).logits[0, -1]
    for restore in (True, False):
        kv = DynamicCache(config=t.config)
        feed = lambda ids, start: t(input_ids=ids[None], position_ids=torch.arange(start, start + len(ids))[None],
                                    use_cache=True, **{_model_kwargs_cache_name(t): kv}).logits[0]
        feed(x[:20], 0)
        saved = snapshot_linear_state(kv)
        assert len(saved) == 2                        # layers 0 and 1 are linear attention, layer 2 full attention
        feed(x[20:28], 20)
        if restore: restore_cache(kv, saved, 20)
        else:                                         # crop only the attention KV: the linear state keeps the block
            restore_cache(kv, [], 20)
        assert kv.get_seq_length() == 20
        got = feed(x[20:24], 20)[-1]
        assert torch.allclose(got, want, atol=1e-4) == restore


def test_snapshot_cost_is_flat_in_context(hybrid):
    "Target tokens per committed token: at most 2B on a long or short prompt with snapshot; recompute grows with the prompt."
    t, dr = hybrid["target"], hybrid["drafter"]
    per_token = {}
    for n in (40, 160):
        p = torch.arange(1000, 1000 + n)
        for mode in ("snapshot", "recompute"):
            out = speculative_generate(dr, t, p, 8, HB, [0, 1], cache=mode)
            per_token[mode, n] = (out["target_tokens"] - n) / (out["tokens"].numel() - 1)   # prefill excluded
    assert per_token["snapshot", 40] == per_token["snapshot", 160] <= 2 * HB
    assert per_token["recompute", 160] > 3 * per_token["recompute", 40] > 3 * 2 * HB


def test_cache_mode_errors(hybrid):
    "An unknown cache mode, and a plain KV cache on a target whose linear-attention state it could not roll back."
    with pytest.raises(ValueError, match="cache must be one of auto, dynamic, snapshot, recompute; got 'kv'"):
        speculative_generate(hybrid["drafter"], hybrid["target"], hybrid["prompts"][0], 4, HB, cache="kv")
    with pytest.raises(ValueError, match="cache='dynamic' can't roll back linear_attention layers: use 'snapshot'"):
        speculative_generate(hybrid["drafter"], hybrid["target"], hybrid["prompts"][0], 4, HB, cache="dynamic")


def test_snapshot_on_an_attention_only_target(hybrid):
    "No linear layers to snapshot: 'snapshot' crops like 'dynamic' and feeds nothing twice."
    t = tiny_target(num_layers=3)
    p = hybrid["prompts"][1]
    ref = torch.cat([p, greedy_generate(t, p, H_NEW)["tokens"]])
    runs = {c: speculative_generate(ForcedProposer([ref], HB, "prefix"), t, p, H_NEW, HB, [0, 1], cache=c)
            for c in ("snapshot", "dynamic")}
    assert all(torch.equal(r["tokens"], ref[len(p):]) for r in runs.values())
    assert runs["snapshot"]["forwards"] == runs["dynamic"]["forwards"] == 1 + len(runs["dynamic"]["accept_lengths"])
    assert runs["snapshot"]["target_tokens"] == runs["dynamic"]["target_tokens"]


def test_forward_costs_on_a_hybrid_target(hybrid):
    "--speedup times the target on a block and rolls its cache back each time: the linear state by a snapshot."
    from dflash_nb.decoding import forward_costs
    c = forward_costs(hybrid["drafter"], hybrid["target"], hybrid["prompts"][0], HB, [0, 1], repeats=1)
    assert min(c[k] for k in ("target_1", "target_block", "drafter")) > 0 and c["prompt_tokens"] == len(hybrid["prompts"][0])


def test_format_drafts(hybrid):
    "Accepted drafts in brackets per cycle, the target's tokens bare; a stop token among the drafts stays a draft."
    as_ids = lambda ids: "".join(f"<{t}>" for t in ids)
    assert format_drafts(dict(tokens=[5, 6, 7, 8, 9], accept_lengths=[3, 1], drafted=[2, 0]), as_ids) == "<5>[<6><7>]<8><9>"
    assert format_drafts(dict(tokens=[5, 6, 7], accept_lengths=[2], drafted=[2]), as_ids) == "<5>[<6><7>]"
    assert format_drafts(dict(tokens=[5, 6], accept_lengths=[1], drafted=[1]), as_ids, color=True) == "<5>\x1b[32m<6>\x1b[0m"
    p, ref = hybrid["prompts"][0], hybrid["refs"][0]
    r = speculative_generate(ForcedProposer([ref], HB, "prefix"), hybrid["target"], p, H_NEW, HB, [0, 1])
    marked = format_drafts(r, as_ids)
    assert marked.replace("[", "").replace("]", "") == as_ids(r["tokens"].tolist())
    assert marked.count("[") == sum(d > 0 for d in r["drafted"]) > 0
    assert sum(r["drafted"]) == sum(r["accept_lengths"]) - len(r["accept_lengths"])   # one target token per cycle
    # stop on a token the perfect drafter proposes: the last cycle ends on an accepted draft, nothing bare after it
    stop = int(ref[len(p) + 2])
    r = speculative_generate(ForcedProposer([ref], HB, "perfect"), hybrid["target"], p, H_NEW, HB, [0, 1],
                             stop_token_ids=[stop])
    assert r["drafted"][-1] == r["accept_lengths"][-1] and format_drafts(r, as_ids).endswith(f"<{stop}>]")
    text = show_drafts(ForcedProposer([ref], HB, "prefix"), hybrid["target"], [p], H_NEW, hybrid["tok"].decode, HB,
                       layer_ids=[0, 1])
    assert text.startswith("--- sample 0: τ ") and "[" in text


def test_cli_show_drafts(tmp_path, capsys):
    "`--show-drafts N` prints N held-out continuations (--data) or prompt-file continuations with the drafts marked."
    from dflash_nb.records import DataConfig
    from dflash_nb.inputs import write_jsonl
    from dflash_nb.shards import tokenize_dataset
    from dflash_nb.export import export_drafter
    recs = [{"prompt": f"Question {i}: why is the sky blue?", "completion": "Because of Rayleigh scattering of sunlight."}
            for i in range(3)]
    tokenize_dataset([str(write_jsonl(recs, tmp_path / "in.jsonl"))], qwen3_tokenizer_dir(), tmp_path / "data",
                     DataConfig(min_loss_tokens=4, workers=1), verbose=False)
    t = tiny_target()
    cfg = DrafterConfig.from_target(t.config, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3], mask_token_id=151669)
    export_drafter(DFlashDrafter(cfg, t.get_input_embeddings(), t.get_output_embeddings()), cfg, tmp_path / "drafter")
    base = ["--drafter", str(tmp_path / "drafter"), "--target", "tiny", "--max-new-tokens", "6", "--show-drafts", "2"]
    res = eval_main(base + ["--data", str(tmp_path / "data"), "--num-samples", "1"])
    out = capsys.readouterr().out
    assert "accepted drafts in [brackets]" in out and res["drafts"] in out
    assert res["drafts"].count("--- sample ") == 2 and "--- sample 1: τ " in out
    res = eval_main(base + ["--prompts", str(PROMPTS / "math.jsonl"), "--temperature", "1"])
    assert res["drafts"].count("--- sample ") == 2 and "drafts at temperature 1" in capsys.readouterr().out
# ---------------------------------------------------------------- benchmark files as people have them
from dflash_nb.prompts import read_prompt_specs, MultiTurn, detect_prompt_format
from dflash_nb.evaluate import cli
import pyarrow as pa, pyarrow.parquet as pq

# one record in each benchmark's published shape (the fields its public copies carry), reference answers included
BENCH = {
    "gsm8k": ({"question": "Natalia sold clips to 48 friends in April. How many in May?",
               "answer": "48/2 = 24\n#### 72"},
              "Natalia sold clips to 48 friends in April. How many in May?"),
    "math500": ({"problem": "Convert $(0,3)$ to polar coordinates.", "solution": "We have $r = 3$.",
                 "answer": "(3, \\frac{\\pi}{2})",
                 "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
                "Convert $(0,3)$ to polar coordinates."),
    "humaneval": ({"task_id": "HumanEval/0",
                   "prompt": "def has_close(numbers):\n    \"\"\"Any two closer than 1?\"\"\"\n",
                   "canonical_solution": "    return False\n", "test": "def check(c): pass",
                   "entry_point": "has_close"},
                  "Complete the following Python function.\n\n```python\n"
                  "def has_close(numbers):\n    \"\"\"Any two closer than 1?\"\"\"\n```"),
    "mbpp": ({"task_id": 11, "text": "Write a function to remove a character.", "code": "def remove(s, c): return s",
              "test_list": ["assert remove('ab', 'a') == 'b'", "assert remove('a', 'a') == ''"], "test_setup_code": ""},
             "Write a function to remove a character.\nYour code should pass these tests:\n\n"
             "assert remove('ab', 'a') == 'b'\nassert remove('a', 'a') == ''"),
    "mbpp_sanitized": ({"task_id": 2, "prompt": "Write a function to find shared elements.",
                        "code": "def f(a, b): return a",
                        "test_imports": [], "test_list": ["assert f(1, 2) == 1"]},
                       "Write a function to find shared elements.\nYour code should pass these tests:\n\n"
                       "assert f(1, 2) == 1"),
    "alpaca": ({"instruction": "Rewrite the sentence in passive voice.", "input": "The cat ate the fish.",
                "output": "The fish..."},
               "Rewrite the sentence in passive voice.\n\nThe cat ate the fish."),
    "alpaca_no_input": ({"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well."},
                        "Give three tips for staying healthy."),
}


def _write(path: Path, recs: list, kind: str) -> Path:
    "Records as JSONL, Parquet (as the hub serves the benchmarks) or one JSON array."
    if kind == "parquet": pq.write_table(pa.Table.from_pylist(recs), path)
    elif kind == "json": path.write_text(json.dumps(recs, indent=1))
    else: path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def qwen_tok():
    "The real Qwen3 tokenizer, loaded once for the 21 format cases."
    return load_tokenizer(qwen3_tokenizer_dir())


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "json"])
@pytest.mark.parametrize("name", list(BENCH))
def test_benchmark_formats(tmp_path, name, kind, qwen_tok):
    "Each benchmark's own fields are told apart and become the user turn the benchmark asks, never its answer."
    rec, asked = BENCH[name]
    f = _write(tmp_path / f"{name}.{kind}", [rec, rec], kind)
    pf = read_prompt_file(f)
    assert pf.format == name.split("_")[0] and pf.detected and len(pf) == 2 and pf.followups == [[], []]
    assert pf[0] == [{"role": "user", "content": asked}]
    for answer_field in ("answer", "solution", "canonical_solution", "code", "output"):
        if isinstance(rec.get(answer_field), str): assert rec[answer_field] not in json.dumps(pf.conversations)
    ids = render_prompts(pf, qwen_tok)[0]
    ref = qwen_tok.apply_chat_template(pf[0], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids.tolist() == list(ref)


def test_mtbench_format_and_named_formats(tmp_path):
    "MT-Bench's turns (and H4's list-valued prompt) stay separate turns; FORMAT=FILE names a format and the table row."
    mt = [{"question_id": 81, "category": "writing",
           "turns": ["Write a travel blog post.", "Rewrite it starting with A."],
           "reference": ["ref 1", "ref 2"]},
          {"question_id": 101, "category": "reasoning", "turns": ["Who is second?"]}]
    pf = read_prompt_file(_write(tmp_path / "question.jsonl", mt, "jsonl"))
    assert pf.format == "mtbench" and pf.turns == 3 and "ref 1" not in json.dumps(pf.conversations)
    assert pf[0] == [{"role": "user", "content": "Write a travel blog post."}]
    assert pf.followups == [["Rewrite it starting with A."], []]
    h4_rows = [{"prompt": ["One?", "Two?"], "prompt_id": 1, "category": "x"}]   # H4's copy: turns in `prompt`
    h4 = read_prompt_file(_write(tmp_path / "h4.parquet", h4_rows, "parquet"))
    assert h4.format == "prompt" and h4.followups == [["Two?"]]
    # a GSM8K parquet with a file name that says nothing, named; a JSONL told from its fields; the same file twice
    pq_file = _write(tmp_path / "test-00000-of-00001.parquet", [BENCH["gsm8k"][0]] * 3, "parquet")
    sets = read_prompt_specs([f"gsm8k={pq_file}", str(tmp_path / "question.jsonl")], max_records=2)
    assert {n: (pf.format, pf.detected, len(pf)) for n, pf in sets.items()} == {
        "gsm8k": ("gsm8k", False, 2), "question.jsonl": ("mtbench", True, 2)}
    assert list(read_prompt_specs([f"gsm8k={pq_file}", f"gsm8k={pq_file}"])) == [f"gsm8k={pq_file}"]   # same file
    assert detect_prompt_format({"prompt": "x", "entry_point": "f"}) == "humaneval"


@pytest.mark.parametrize("text,fmt,msg", [
    ('{"messages": [{"role": "narrator", "content": "Once."}, {"role": "user", "content": "Go on."}]}\n', None,
     "x.jsonl:1: messages[0].role 'narrator' is not one"),
    ('{"prompt": "ok"}\n{"prompt": "hi", "x": ' + "[" * 40 + "]" * 40 + "}\n", None,
     "x.jsonl:2: nested deeper than 32 levels"),
    ('{"prompt": "ok"}\n{"prompt": ' + "[" * 5000 + "]" * 5000 + "}\n", None, "x.jsonl:2: "),
    ('{"question": "fine"}\n{"question": 3}\n', None, "x.jsonl:2: 'question' must be a string, got int"),
    ('{"question": "fine"}\n{"question": "  "}\n', None, "x.jsonl:2: 'question' is empty"),
    ('{"turns": []}\n', None, "x.jsonl:1: 'turns' must be a non-empty list of strings"),
    ('{"turns": ["a", 7]}\n', None, "x.jsonl:1: 'turns[1]' must be a string"),
    ('{"instruction": "a", "input": ["b"]}\n', None, "x.jsonl:1: 'input' must be a string"),
    ('{"question": "a"}\n', "mtbench", "x.jsonl:1: 'turns' must be a non-empty list"),
    ('{"question": "a"}\n', "gsm9k", "unknown format 'gsm9k'"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', None, "x.jsonl:2: not JSON"),
    ('{"prompt": "a"}\n\xff\n', None, "x.jsonl:2: not JSON (invalid UTF-8"),
    ('[{"prompt": "a"}, 3]', None, "x.jsonl: record 2: record must be a JSON object"),
    ('{"id": 1, "label": "x"}\n', None,
     "x.jsonl:1: no prompt or messages field, and no benchmark's fields (id, label)"),
])
def test_prompt_file_validation(tmp_path, text, fmt, msg):
    (tmp_path / "x.jsonl").write_bytes(text.encode("utf-8") if "\xff" not in text else text.encode("latin-1"))
    with pytest.raises(PromptFileError) as e: read_prompt_file(tmp_path / "x.jsonl", prompt_format=fmt)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_prompt_files_stream_and_cap_records(tmp_path):
    "A record over the cap fails before it is read whole: a 64 MB line costs no more memory than the cap; Parquet too."
    import tracemalloc
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"prompt": "fine"}\n{"prompt": "')
        f.write(b"x" * (64 << 20))
    tracemalloc.start()
    with pytest.raises(PromptFileError, match=r"big.jsonl:2: record larger than 4096 bytes \(--max-record-bytes\)"):
        read_prompt_file(big, max_record_bytes=4096)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    # --max-prompts: only the first records are read, the malformed tail is never reached
    with open(big, "ab") as f: f.write(b'"}\nnot json\n')
    assert len(read_prompt_file(big, max_records=1)) == 1
    rows = [{"question": "short"}, {"question": "y" * 5000}]
    with pytest.raises(PromptFileError, match="x.parquet: row 2: record larger than 4096 bytes"):
        read_prompt_file(_write(tmp_path / "x.parquet", rows, "parquet"), max_record_bytes=4096)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(PromptFileError, match="broken.parquet: not a readable Parquet file"):
        read_prompt_file(tmp_path / "broken.parquet")


def test_mtbench_answers_turn_by_turn(world, tmp_path):
    "Turn 2 is asked after the target's own answer to turn 1 (decoded into the conversation); τ counts both turns."
    tok = load_tokenizer(qwen3_tokenizer_dir())
    mt = [{"question_id": 1, "turns": ["What is 3 plus 4?", "And times 2?"]},
          {"question_id": 2, "turns": ["Name a sea."]}]
    items = render_prompts(read_prompt_file(_write(tmp_path / "mt.jsonl", mt, "jsonl")), tok)
    assert isinstance(items[0], MultiTurn) and isinstance(items[1], torch.Tensor)
    drafter, target, eot = world["trained"], world["target"], tok.convert_tokens_to_ids("<|im_end|>")
    res = prompt_set_tau(drafter, target, items, (0.0, 1.0), N_NEW, B, stop_token_ids=[eot])
    assert res[0.0]["turns"] == 3 and res[0.0]["prompts"] == 2
    # the same by hand: turn 1, its answer decoded into the conversation, turn 2; then the single-turn prompt
    first = speculative_generate(drafter, target, items[0].first_prompt(), N_NEW, B, stop_token_ids=[eot])
    answer = tok.decode(first["tokens"], skip_special_tokens=True)
    conv = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "And times 2?"}]
    second_prompt = render_prompts([conv], tok)[0]
    assert tok.decode(second_prompt).count("<|im_start|>assistant") == 2   # the target's answer is in the context
    second = speculative_generate(drafter, target, second_prompt, N_NEW, B, stop_token_ids=[eot])
    last = speculative_generate(drafter, target, items[1], N_NEW, B, stop_token_ids=[eot])
    lengths = first["accept_lengths"] + second["accept_lengths"] + last["accept_lengths"]
    assert res[0.0]["cycles"] == len(lengths) and res[0.0]["tau"] == sum(lengths) / len(lengths)
    again = prompt_set_tau(drafter, target, items, (1.0,), N_NEW, B, stop_token_ids=[eot])
    assert again[1.0]["tau"] == res[1.0]["tau"] and again[1.0]["turns"] == 3   # one seeded generator per prompt


def test_cli_benchmark_files(tmp_path, capsys, monkeypatch):
    "`--prompts gsm8k=FILE.parquet mt.jsonl`: each file's format is said, one row each; a bad record: one line, exit 2."
    from dflash_nb.evaluate import main
    from dflash_nb.export import export_drafter
    t = tiny_target()
    cfg = DrafterConfig.from_target(t.config, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=151669)
    export_drafter(DFlashDrafter(cfg, t.get_input_embeddings(), t.get_output_embeddings()), cfg, tmp_path / "drafter")
    gsm = _write(tmp_path / "test-00000-of-00001.parquet", [BENCH["gsm8k"][0]] * 3, "parquet")
    mt = _write(tmp_path / "mt.jsonl", [{"question_id": 1, "turns": ["Hi.", "Again."]}], "jsonl")
    base = ["--drafter", str(tmp_path / "drafter"), "--target", "tiny", "--max-new-tokens", "5"]
    res = main(base + ["--prompts", f"gsm8k={gsm}", str(mt), "--max-prompts", "2", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert f"format of gsm8k: gsm8k (named), 2 prompts from {gsm}" in out
    assert f"format of mt.jsonl: mtbench (told from its fields), 1 prompts (2 user turns) from {mt}" in out
    rows = {l.split()[0]: l.split()[1:] for l in out.splitlines() if l.startswith(("gsm8k ", "mt.jsonl "))}
    assert rows["gsm8k"][0] == "2" and rows["mt.jsonl"][0] == "1"
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["prompt_files"]["mt.jsonl"] == dict(path=str(mt), format="mtbench", detected=True, prompts=1, turns=2)
    assert saved["prompt_sets"]["mt.jsonl"]["0"]["turns"] == 2 and res["prompt_sets"]["gsm8k"]["0"]["prompts"] == 2
    narrated = {"messages": [{"role": "narrator", "content": "x"}, {"role": "user", "content": "y"}]}
    bad = _write(tmp_path / "bad.jsonl", [narrated], "jsonl")
    monkeypatch.setattr(sys, "argv", ["evaluate", *base, "--prompts", str(bad)])
    with pytest.raises(SystemExit) as e: cli()   # the console entry: run_cli prints one line, exit 2
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert err.startswith(f"python -m dflash_nb.evaluate: error: {bad}:1: messages[0].role 'narrator'")
