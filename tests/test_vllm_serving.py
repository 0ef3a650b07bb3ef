"""vLLM is the judge: a drafter trained here, exported, and served by vLLM (the serving environment `make serving`
builds) must leave greedy output unchanged and reach, by vLLM's own counters, the acceptance length dflash_nb measures
on the same prompts (`prompt_set_tau`, what `dflash-eval --prompts` reports): token ids in on both sides, the same
budget and stop ids. All-full and all-sliding drafters are served on this CPU; a drafter mixing the two needs vLLM's V2
model runner, which needs a GPU Triton, and vLLM says so.

The all-full export is judged through `dflash-eval --engine vllm` (its JSON holds dflash_nb's τ and histogram next
to vLLM's counters), the all-sliding one by an engine of its own. Cost: one short training run (~1 min), three engines
started at once (plain, sliding, the refused mixed one) and the console script's two, ~30 s each on an idle machine."""
import dataclasses, json, os, shutil, signal, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest, torch

from _serving_common import served_target, write_served_target
from dflash_nb.anchors import anchor_block_labels, block_input_ids, block_position_ids, make_packed_row, sample_anchors
from dflash_nb.attention import AnchorBlockLayout
from dflash_nb.tau import prompt_set_tau
from dflash_nb.export import export_drafter, load_exported_drafter
from dflash_nb.loss import block_loss
from dflash_nb.model import DFlashDrafter, DrafterConfig, resolve_mask_token_id
from dflash_nb.prompts import (MAX_PROMPT_RECORD_BYTES, read_prompt_specs,
                               render_prompts)
from dflash_nb.records import load_tokenizer, qwen3_tokenizer_dir
from dflash_nb.serving import ServingError, VLLMEngine
from dflash_nb.target import TargetFeatures

pytestmark = pytest.mark.slow

B, N_NEW, STEPS, WINDOW = 4, 32, 80, 8   # block size, new tokens per prompt, training steps, the sliding layers' window
WORDS = ("the a of to and in is that it for on with as was at by an be this from or have not are but cat dog house "
         "river code model token block draft target speed light water stone music paper").split()


def prompt_file(path, n=12, seed=0):
    "A JSONL prompt file of `n` user prompts of 8-16 words (fixed seed), as `dflash-eval --prompts` reads them."
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        k = int(torch.randint(8, 17, (1,), generator=g))
        words = [WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=g)]
        lines.append(json.dumps({"prompt": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def rendered(path, tok) -> list[list[int]]:
    "The prompts of `path` as token ids, rendered with the chat template exactly as `dflash-eval --prompts` does."
    pf = read_prompt_specs([str(path)], None, MAX_PROMPT_RECORD_BYTES)[path.name]
    return [p.tolist() for p in render_prompts(pf, tok)]


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
    pfile = prompt_file(root / "prompts.jsonl")
    ps, stop = rendered(pfile, tok), [int(target.config.eos_token_id)]   # the stop ids dflash-eval uses for it
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
    return dict(target=target, target_dir=target_dir, prompt_file=pfile, prompts=ps, greedy=greedy, stop=stop,
                exports=exports, root=root)


def ours(served, name) -> dict:
    "dflash_nb's τ on the prompts, as `dflash-eval --prompts` computes it, for the export `name` loaded back."
    t = served["target"]
    drafter = load_exported_drafter(served["exports"][name], t.get_input_embeddings(), t.get_output_embeddings())
    return prompt_set_tau(drafter, t, [torch.tensor(p) for p in served["prompts"]], (0.0,), N_NEW, B,
                          stop_token_ids=served["stop"])[0.0]


def start(served, name):
    "A vLLM engine for the target, with the export `name` as its drafter (None: without); the error if it refuses."
    try: return VLLMEngine(served["target_dir"], name and served["exports"][name], max_model_len=256)
    except ServingError as e: return e


@pytest.fixture(scope="module")
def runs(served):
    "vLLM's greedy outputs and counters without a drafter, with the sliding export, and the mixed one's refusal."
    t0, out, names = time.perf_counter(), {}, (None, "sliding", "mixed")
    with ThreadPoolExecutor(3) as pool:   # started at once: most of a start is importing vLLM
        engines = dict(zip(names, pool.map(lambda name: start(served, name), names)))
    for name, engine in engines.items():
        if isinstance(engine, ServingError):
            out[name] = engine
            continue
        with engine:
            r = engine.generate(served["prompts"], N_NEW, stop_token_ids=served["stop"])
            out[name or "plain"] = dict(outputs=r["outputs"], spec=engine.spec_metrics())
    print(f"vLLM engines {names}: {time.perf_counter() - t0:.0f} s")
    return out


@pytest.fixture(scope="module")
def cli(served):
    "`dflash-eval --engine vllm` on the all-full export, through the console script: its stdout and its JSON cell."
    out = served["root"] / "eval.json"
    cmd = [str(Path(sys.executable).with_name("dflash-eval")), "--engine", "vllm",
           "--drafter", str(served["exports"]["full"]), "--target", str(served["target_dir"]),
           "--prompts", str(served["prompt_file"]), "--max-new-tokens", str(N_NEW), "--json", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"dflash-eval --engine vllm: {time.perf_counter() - t0:.0f} s")
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(stdout=r.stdout, cell=json.loads(out.read_text())["prompt_sets"]["prompts.jsonl"]["0"])


def test_vllm_greedy_is_the_targets_greedy_with_and_without_the_drafter(served, runs, cli):
    assert runs["plain"]["outputs"] == served["greedy"]                  # vLLM's target is transformers' target
    assert runs["plain"]["spec"] is None
    assert runs["sliding"]["outputs"] == runs["plain"]["outputs"]        # lossless: the drafter changes no token
    v = cli["cell"]["vllm"]
    assert v["identical"] == v["prompts"] == len(served["prompts"])     # the full export, compared by dflash-eval


def accepted_at_least(hist) -> list[int]:
    "From a histogram of accepted + 1 (index 0: nothing accepted): cycles whose accepted prefix reached slot k = 1.."
    return [sum(hist[k:]) for k in range(1, len(hist))]


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_vllm_acceptance_equals_dflash_nb_tau(served, runs, cli, name):
    "vLLM's counters against dflash_nb's τ: for the full export both as dflash-eval reports them, side by side."
    if name == "full": spec, mine = cli["cell"]["vllm"], cli["cell"]
    else: spec, mine = runs[name]["spec"], ours(served, name)
    tau = 1 + spec["accepted"] / spec["drafts"]
    msg = (f"{name}: vLLM τ {tau:.4f} ({spec['drafts']} drafts, {spec['accepted']} accepted, per position "
           f"{spec['accepted_per_pos']}), dflash_nb τ {mine['tau']:.4f} ({mine['cycles']} cycles, "
           f"histogram {mine['histogram']})")
    print(msg)
    assert spec["accepted"] > 0 and mine["tau"] > 1.0, msg                  # the drafter drafts something accepted
    assert abs(tau - mine["tau"]) <= 0.02 * mine["tau"], msg
    assert abs(spec["drafts"] - mine["cycles"]) <= 0.02 * mine["cycles"], msg
    for k, (theirs, mine_k) in enumerate(zip(spec["accepted_per_pos"], accepted_at_least(mine["histogram"])), 1):
        assert abs(theirs - mine_k) <= max(2, 0.05 * mine_k), f"slot {k}: vLLM {theirs}, dflash_nb {mine_k}; {msg}"


def test_the_sliding_window_matters_here(served, runs, cli):
    "The sliding variant is not the full one in disguise: the window is shorter than the sequences, τ differs."
    assert max(len(p) for p in served["prompts"]) + N_NEW > 2 * WINDOW
    full = {k: cli["cell"]["vllm"][k] for k in ("drafts", "accepted", "accepted_per_pos")}
    assert {k: runs["sliding"]["spec"][k] for k in full} != full


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU with Triton vLLM's V2 model runner serves this layout")
def test_a_mixed_layout_needs_vllms_v2_runner_which_this_cpu_lacks(runs):
    e = runs["mixed"]
    assert isinstance(e, ServingError), e
    assert "mixed sliding/full dflash drafts" in str(e) and "\n" not in str(e), str(e)
    assert any("Model Runner V2 requires Triton" in line for line in e.log), e.log[-5:]


def test_dflash_eval_engine_vllm_reports_vllm_next_to_dflash_nb(cli):
    "`dflash-eval --engine vllm`: vLLM's τ and speed-up next to dflash_nb's, in the tables and the JSON."
    assert "vLLM τ @ T=0" in cli["stdout"] and "speed-up @ T=0" in cli["stdout"], cli["stdout"]
    cell, v = cli["cell"], cli["cell"]["vllm"]
    assert cell["vllm_tau"] == v["tau"] == pytest.approx(1 + v["accepted"] / v["drafts"])
    assert cell["vllm_speedup"] == pytest.approx(v["tokens_per_s"] / v["plain_tokens_per_s"])
    assert v["per_position"] == pytest.approx([c / v["drafts"] for c in v["accepted_per_pos"]])
    assert len(v["accepted_per_pos"]) == B - 1 and v["tokens"] > 0 and v["plain_tokens_per_s"] > 0


def eval_cmd(served, out, *extra) -> list[str]:
    return [str(Path(sys.executable).with_name("dflash-eval")), "--engine", "vllm",
            "--drafter", str(served["exports"]["full"]), "--target", str(served["target_dir"]),
            "--prompts", str(served["prompt_file"]), "--max-new-tokens", str(N_NEW), "--json", str(out), *extra]


def test_dflash_eval_sweeps_k_and_batch_size(served):
    "Two cells (k 2 at batch 1 and 12): vLLM's acceptance length and both rates per cell, outputs unchanged, best k."
    out = served["root"] / "sweep.json"
    r = subprocess.run(eval_cmd(served, out, "--num-speculative-tokens", "2", "--batch-size", "12", "1"),
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    sw = json.loads(out.read_text())["vllm_sweep"]
    assert [(c["k"], c["batch"]) for c in sw["cells"]] == [(2, 1), (2, 12)]
    for c in sw["cells"]:
        assert c["identical"] == c["prompts"] == len(served["prompts"]), c      # lossless at every batch size
        assert c["tau"] == pytest.approx(1 + c["accepted"] / c["drafts"]) and c["tau"] > 1.0, c
        assert len(c["accepted_per_pos"]) == 2 and c["plain_tokens_per_s"] > 0 and c["tokens_per_s"] > 0
        assert c["speedup"] == pytest.approx(c["tokens_per_s"] / c["plain_tokens_per_s"])
    assert sw["best"]["batch"] == 1 and sw["recommended_k"] == 2
    assert "best at batch 1: k = 2" in r.stdout, r.stdout[-2000:]


def workers_of(pid: int) -> list[int]:
    "Live processes whose parent is `pid` and that run the vLLM worker script."
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid) and \
               b"vllm_worker.py" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, IndexError): pass
    return out


def alive(pids) -> list[int]:
    "Those of `pids` still running (a zombie, dead but not yet waited for, does not count)."
    out = []
    for w in pids:
        try: state = Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError): continue
        if state != "Z": out.append(w)
    return out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signal_during_a_sweep_leaves_no_worker(served, sig):
    """SIGTERM while the sweep's engine loads: exit 143 at once. SIGKILL (the parent cannot act): the worker sees its
    pipe close. Either way the worker and everything it started are gone within seconds, with its TMPDIR."""
    tmp = Path(tempfile.mkdtemp(prefix="ev-", dir="/tmp"))   # the caller's TMPDIR (short: the worker's is made in it)
    try: signal_the_sweep(served, tmp, getattr(signal, sig))
    finally: shutil.rmtree(tmp, ignore_errors=True)


def test_a_load_past_load_timeout_is_one_line_and_leaves_nothing(served):
    """`dflash-eval --engine vllm --load-timeout 2`: vLLM takes longer than that to load, so the worker is stopped with
    everything it started; one line naming the flag, exit 2, the worker's TMPDIR gone."""
    tmp = Path(tempfile.mkdtemp(prefix="ev-", dir="/tmp"))
    try:
        r = subprocess.run(eval_cmd(served, served["root"] / "never.json", "--load-timeout", "2"),
                           capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
        last = r.stderr.splitlines()[-1]                       # after the progress lines of its own target's load
        assert r.returncode == 2 and last.startswith("dflash-eval: error: the vLLM worker did not answer 'load' "
                                                     "within 2 s (hung?)"), r.stderr[-2000:]
        assert last.endswith("(the timeout: --load-timeout or DFLASH_WORKER_TIMEOUT)"), last
        assert os.listdir(tmp) == [] and workers_of(os.getpid()) == [], os.listdir(tmp)
    finally: shutil.rmtree(tmp, ignore_errors=True)


def test_tensor_parallel_size_reaches_vllm(tmp_path):
    """`dflash-eval --engine vllm --tensor-parallel-size 4` hands vLLM tensor_parallel_size=4 (the sweep: no target,
    no trained drafter loaded here): the served target's 2 attention heads cannot be split 4 ways, and vLLM's own
    refusal is the one line, exit 2, nothing left in the worker's TMPDIR (~20 s here). A size vLLM accepts (2) takes
    ~90 s to load and serve on this CPU, so that run is described in chapter 01h_regen, not repeated here."""
    target = write_served_target(tmp_path / "target")
    export = tmp_path / "export"                               # what the sweep reads of an export before vLLM loads
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"block_size": B, "dflash_config": {"block_size": B}}))
    tmp = Path(tempfile.mkdtemp(prefix="ev-", dir="/tmp"))
    try:
        r = subprocess.run([str(Path(sys.executable).with_name("dflash-eval")), "--engine", "vllm", "--drafter",
                            str(export), "--target", str(target), "--prompts", str(prompt_file(tmp_path / "p.jsonl")),
                            "--max-new-tokens", "4", "--num-speculative-tokens", "1", "--batch-size", "1",
                            "--tensor-parallel-size", "4"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "TMPDIR": str(tmp)})
        assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
            "dflash-eval: error: ValidationError: Total number of attention heads (2) must be divisible by tensor "
            "parallel size (4)."), r.stderr[-2000:]
        assert os.listdir(tmp) == [] and workers_of(os.getpid()) == [], os.listdir(tmp)
    finally: shutil.rmtree(tmp, ignore_errors=True)


def signal_the_sweep(served, tmp, sig):
    "Start `dflash-eval --engine vllm` under TMPDIR `tmp`, send it `sig` while vLLM loads, check nothing is left."
    from dflash_nb.vllm_worker import group_members
    p = subprocess.Popen(eval_cmd(served, served["root"] / "never.json", "--num-speculative-tokens", "1", "3",
                                  "--batch-size", "1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp)})
    t0 = time.monotonic()
    while not workers_of(p.pid) and p.poll() is None and time.monotonic() - t0 < 300: time.sleep(0.2)
    started = workers_of(p.pid)
    assert started, "no vLLM worker started"
    time.sleep(2)   # inside vLLM's start
    group = [*started, *group_members(started[0])]
    assert os.listdir(tmp), "the worker's TMPDIR is not in the caller's"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (143 if sig == signal.SIGTERM else -9), err[-2000:]
    t0 = time.monotonic()
    while alive(group) and time.monotonic() - t0 < 20: time.sleep(0.05)
    assert alive(group) == [] and time.monotonic() - t0 < 10, group
    assert os.listdir(tmp) == [], os.listdir(tmp)
