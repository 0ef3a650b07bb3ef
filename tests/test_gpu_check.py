"""dflash-gpu-check --dry-run (chapter 13d_gpu_check): the GPU check's steps end to end on CPU (tiny shapes), its JSON files and its budget.

The numbers of a dry run mean nothing; what is tested is that every step runs, writes the JSON it promises, that the
Triton kernel (interpreter) and the other backends agree with the float64 reference, that the pipeline's
extrapolation arithmetic is what it prints, and that a budget too small for a step skips it and says why."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"          # the wrapper for a checkout whose package is not installed
CHECK = [sys.executable, "-m", "dflash_nb.gpu_check"]
STEPS = ["env", "parity", "speed", "pipeline", "target", "tp", "sweep", "tests"]
DRY_BUDGET = 600   # seconds: a ceiling for a shared CI box, not what a quiet one takes (300 ran out at load ~12)
FILES = {"env": "gpu_env.json", "parity": "gpu_parity.json", "speed": "gpu_speed.json", "pipeline": "gpu_pipeline.json",
         "target": "gpu_target.json", "tp": "gpu_tp.json", "sweep": "gpu_sweep.json", "tests": "gpu_tests.json"}
NO_CUDA = "skipped: needs 2 CUDA devices, this machine has 0 (dry run: CUDA hidden)"   # step tp in every dry run


def run(*args, timeout=240):
    t = time.monotonic()
    p = subprocess.run([*CHECK, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO / "tests")
    return p, time.monotonic() - t


def load(path):
    return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    "One dry run with room for every step (the budget is a ceiling: ~60 s on two quiet cores, ~180 s at load 10, over 300 s at load 12)."
    out = tmp_path_factory.mktemp("gpu_check")
    p, wall = run("--dry-run", "--budget", str(DRY_BUDGET), "--sweep", "--out", str(out), timeout=DRY_BUDGET + 60)
    return out, p, wall


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_its_json(full):
    out, p, wall = full
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(f.name for f in out.iterdir())
    ran = {k: v for k, v in FILES.items() if k != "tp"}                  # tp needs two GPUs: skipped, no file
    assert files == sorted([*ran.values(), "gpu_check.json"])            # <= 8 files, no .tmp left over
    assert sum(f.stat().st_size for f in out.iterdir()) < 16 * 2**20
    s = load(out / "gpu_check.json")
    assert s["dry_run"] is True and s["budget_s"] == DRY_BUDGET and s["status"] == "ok" and s["cuda_devices"] == 0
    assert [st["name"] for st in s["steps"]] == STEPS
    tp = next(st for st in s["steps"] if st["name"] == "tp")
    assert tp["status"] == "skipped" and tp["reason"] == NO_CUDA and tp["wall_s"] == 0, tp
    for st in s["steps"]:
        if st["name"] == "tp":
            continue
        assert st["status"] == "ok", st
        assert 0 < st["limit_s"] <= DRY_BUDGET and st["expected_s"] > 0
        d = load(out / st["file"])
        assert d["step"] == st["name"] and d["complete"] is True and d["dry_run"] is True and d["errors"] == []
        assert d["headline"] and d["headline"] == st["headline"]
    assert s["elapsed_s"] <= DRY_BUDGET and wall < DRY_BUDGET + 10
    # the table comes last: one line per step with its status
    table = p.stdout[p.stdout.rindex("step "):]
    for name in STEPS:
        want = [name, "skipped" if name == "tp" else "ok"]
        assert any(line.split()[:2] == want for line in table.splitlines()), table
    assert "needs 2 CUDA devices, this machine has 0" in table


@pytest.mark.slow
def test_dry_run_env_imports_the_package_the_check_runs_from(full):
    out, _, _ = full
    env = load(out / "gpu_env.json")["env"]
    # the steps import the dflash_nb the check was started with, kernels/ as dflash_nb.kernels (the dflash_nb/kernels
    # link of the checkout, or what setup.py installs); written relative to the checkout, no machine path
    import dflash_nb
    assert Path(env["dflash_nb_kernels"]).name == "kernels" and Path(env["dflash_nb_kernels"]).parent.name == "dflash_nb"
    assert Path(env["dflash_nb"]).name == "dflash_nb" and not env["dflash_nb"].startswith("/"), env["dflash_nb"]
    if Path(dflash_nb.__file__).resolve().parents[1] == REPO: assert env["dflash_nb"] == "dflash_nb"
    assert env["imported_optional_at_import"] == []           # no boto3 & co. pulled in by importing the package
    assert env["device"] == "cpu (dry run)" and env["torch"]


@pytest.mark.slow
def test_dry_run_parity_all_backends_against_float64(full):
    out, _, _ = full
    d = load(out / FILES["parity"])
    got = {(c["case"], c["window"] is not None) for c in d["cases"]}
    assert got == {("flagship", False), ("flagship", True), ("narrow_window", True), ("reduced", False), ("reduced", True)}
    narrow = next(c for c in d["cases"] if c["case"] == "narrow_window")
    assert narrow["window"] < narrow["B"] and narrow["anchors_past_W_minus_B_plus_1"] > 0
    for c in d["cases"]:
        assert set(c["backends"]) == {"sdpa", "triton", "flex"} and c["visible_pairs"] > 0
        for name, r in c["backends"].items():
            assert r["ok"] is True, (c["case"], name, r)
            assert 0 < r["out"] < 0.05
            if name == "flex":                                      # no flex backward on CPU: said, not faked
                assert "dq" not in r and "no flex_attention backward on CPU" in r["grads"]
            else:
                assert all(0 < r[t] <= r["bound"][t] for t in ("dq", "dk", "dv"))
    assert d["all_ok"] is True


@pytest.mark.slow
def test_dry_run_speed_and_sweep(full):
    out, _, _ = full
    d = load(out / FILES["speed"])
    assert [r["kind"] for r in d["runs"]] == ["sliding", "full"]
    for r in d["runs"]:
        assert 0 < r["density"] <= 1 and r["visible_pairs_per_head"] > 0
        for name in ("triton", "flex", "sdpa"):
            b = r["backends"][name]
            assert b["ms_fwd"] > 0 and b["tflops_fwd"] > 0
            assert ("ms_fwd_bwd" in b) == (name != "flex")
    # on CPU with the interpreter: flex cannot train; the kernel and sdpa both pass, are timed, the faster is taken
    auto = d["auto"]
    assert "flex failed" in auto["reason"] and sorted(auto["ms_per_step"]) == ["sdpa", "triton"]
    assert auto["backend"] == min(auto["ms_per_step"], key=auto["ms_per_step"].get)
    sw = load(out / FILES["sweep"])
    assert all(sw["best"]["sliding"][k] is not None for k in ("fwd", "dq", "dkdv"))


@pytest.mark.slow
def test_dry_run_pipeline_arithmetic(full):
    out, _, _ = full
    d = load(out / FILES["pipeline"])
    ph, ex = d["phases"], d["extrapolation"]
    I, Ih = ph["I"]["seconds_per_row"], ph["I_half"]["seconds_per_row"]
    nf, nh = ph["I"]["layers_run"], ph["I_half"]["layers_run"]
    assert (nf, nh) == (7, 3) and d["target"]["layers"] == 8     # ids end at L - 2 (L - 1 is refused)
    assert ex["per_layer_s"] == pytest.approx((I - Ih) / (nf - nh))
    assert ex["I_64_layer_target_s"] == pytest.approx(ex["overhead_s"] + 62 * ex["per_layer_s"])
    assert f"{ex['I_64_layer_target_s']:.4f}" in ex["arithmetic"][-1]
    T = {int(n): v["seconds_per_row"] for n, v in ph["T"].items()}
    assert sorted(T) == [4, 8] and all(t > 0 for t in T.values())
    assert ph["P"]["seconds_per_row"] > 0
    bal = d["balance"]
    if bal["anchors_balancing_64_layer_target"] is not None:
        t0, t1 = bal["t0_s"], bal["t1_s_per_anchor"]
        assert t0 + t1 * bal["anchors_balancing_64_layer_target"] == pytest.approx(ex["I_64_layer_target_s"])
    assert d["drafter"]["layers"] == 5 and d["drafter"]["layer_types"] == ["sliding"] * 4 + ["full"]
    t = load(out / FILES["tests"])
    assert t["counts"]["skipped"] > 0 and t["counts"]["failed"] == t["counts"]["error"] == 0   # no CUDA: all skipped


def test_tiny_budget_skips_what_does_not_fit(tmp_path):
    earlier = (REPO / "bench" / "results" / "gpu_parity.json").read_bytes()   # an earlier run's result
    (tmp_path / "gpu_parity.json").write_bytes(earlier)
    # 10 s (5 kept for the summary): less than any step's plan (gpu_plan: env 8 s, the cheapest later one 6 s), so
    # every step is skipped and says why; env's status is checked for any outcome should its plan shrink
    p, wall = run("--dry-run", "--budget", "10", "--sweep", "--out", str(tmp_path))
    s = load(tmp_path / "gpu_check.json")
    steps = {st["name"]: st for st in s["steps"]}
    assert list(steps) == STEPS
    env = steps["env"]
    assert env["status"] in ("ok", "timeout", "skipped") and env.get("limit_s", 0) <= 10 - 5
    assert (tmp_path / FILES["env"]).exists() == (env["status"] != "skipped")
    for name in STEPS[1:]:
        why = NO_CUDA if name == "tp" else "of the 10 s budget left"      # no second GPU comes before the budget
        assert steps[name]["status"] == "skipped" and why in steps[name]["reason"], steps[name]
        assert "headline" not in steps[name]                              # not the earlier run's headline
        assert (tmp_path / FILES[name]).exists() == (name == "parity")
    # a step that did not run leaves the earlier file whole, and the summary says it is an earlier run's
    assert (tmp_path / "gpu_parity.json").read_bytes() == earlier and s["earlier_files"] == ["gpu_parity.json"]
    assert p.returncode == (1 if env["status"] == "timeout" else 0)
    assert wall < 10 + 8
    assert "skipped" in p.stdout[p.stdout.rindex("step "):]


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    for args, what in ((["--budget", "abc"], "got 'abc'"), (["--budget", "0"], "must be >= 1, got 0"),
                       (["--frobnicate"], "unknown flag --frobnicate"), (["--budget"], "--budget: needs a value"),
                       (["--dry-run", "--wheels", str(tmp_path)], "no .whl files in"),
                       (["--wheels"], "--wheels: needs a value"),
                       (["--step", "frob", "--out", "x.json"], "--step: one of env, parity")):
        p, _ = run(*args, timeout=30)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and what in p.stderr, (args, p.stderr)
    assert not list(tmp_path.iterdir())
    (tmp_path / "out").mkdir(); (tmp_path / "out" / "gpu_env.json").write_text("{}")  # a usage error keeps earlier results
    p, _ = run("--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "none"), timeout=30)
    assert p.returncode == 2 and (tmp_path / "out" / "gpu_env.json").read_text() == "{}"
    p = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PYTHON": "/nonexistent/python"})
    assert p.returncode == 2 and "/nonexistent/python" in p.stderr
    p = subprocess.run(["bash", str(SCRIPT), "--budget", "0"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable})    # the wrapper hands its arguments on
    assert p.returncode == 2 and "--budget: must be >= 1, got 0" in p.stderr, p.stderr


def test_step_value_is_said_once():
    p, _ = run("--step", "bogus", timeout=30)
    assert p.returncode == 2 and p.stderr.count("bogus") == 1, p.stderr
    assert p.stderr.strip().endswith("--step: one of env, parity, speed, sweep, pipeline, target, tp, got 'bogus'")


def snapshot(d):
    "name -> bytes of every entry of directory `d` (links as their target text)."
    return {f.name: os.readlink(f) if f.is_symlink() else f.read_bytes() for f in sorted(Path(d).iterdir())}


def test_no_cuda_device_without_dry_run_refuses_and_writes_nothing(tmp_path):
    """No CUDA device and no --dry-run: one line naming --dry-run, exit 2, every earlier result intact; in the default
    bench/results/ of a checkout (a copy here, so the repository's own results are never at stake) and in an --out."""
    co = tmp_path / "checkout"
    shutil.copytree(REPO / "dflash_nb", co / "dflash_nb", ignore=shutil.ignore_patterns("__pycache__"))
    results = co / "bench" / "results"
    results.mkdir(parents=True)
    for f in [REPO / "bench" / "results" / "README.md", *(REPO / "bench" / "results").glob("gpu_*.json")]:
        shutil.copy(f, results)
    mine = tmp_path / "mine"
    shutil.copytree(results, mine, ignore=shutil.ignore_patterns("README.md"))
    before = {d: snapshot(d) for d in (results, mine)}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(co)}    # the copy's dflash_nb; no GPU seen
    for extra in ([], ["--out", str(mine)]):
        p = subprocess.run([*CHECK, "--budget", "20", *extra], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env=env)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--dry-run" in p.stderr, p.stderr
        assert "no CUDA device" in p.stderr and not p.stdout
    assert {d: snapshot(d) for d in (results, mine)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout", "mine"]


def test_out_holding_files_the_check_did_not_write_is_refused(tmp_path):
    "--out is claimed: a file the check did not write (a foreign gpu_check.json, any other file, a link) refuses it."
    ours = (REPO / "bench" / "results" / "gpu_env.json").read_bytes()
    cases = {"foreign_summary": {"gpu_check.json": b'{"mine": true}'},
             "other_file": {"gpu_env.json": ours, "notes.txt": b"mine"},
             "not_a_record": {"gpu_parity.json": ours}}                      # env's record under parity's name
    for name, files in cases.items():
        d = tmp_path / name
        d.mkdir()
        for f, data in files.items(): (d / f).write_bytes(data)
        p, _ = run("--dry-run", "--budget", "10", "--out", str(d), timeout=60)
        bad = next(f for f in files if f != "gpu_env.json")
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (name, p.stderr)
        assert f"did not write ({bad})" in p.stderr and "pick another --out" in p.stderr, (name, p.stderr)
        assert snapshot(d) == files, name
    link = tmp_path / "link"
    link.mkdir()
    (link / "gpu_env.json").symlink_to(REPO / "bench" / "results" / "gpu_env.json")
    p, _ = run("--dry-run", "--budget", "10", "--out", str(link), timeout=60)
    assert p.returncode == 2 and "did not write (gpu_env.json)" in p.stderr, p.stderr
    assert os.readlink(link / "gpu_env.json") == str(REPO / "bench" / "results" / "gpu_env.json")


def proc_stat(pid):
    "(ppid, process group) of a live process, or None."
    try: text = Path(f"/proc/{pid}/stat").read_text()
    except OSError: return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2])


def pids():
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def cmdline(pid):
    try: return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError: return b""


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_stopping_the_check_ends_its_running_step_first(tmp_path, sig, rc):
    """SIGTERM (Ctrl-C) to a real dry run while a step runs: the step's whole process group is gone when the check
    exits 143 (130), and nothing in --out appears or changes after that; the stopped step's file never lands there."""
    out = tmp_path / "out"
    check = subprocess.Popen([*CHECK, "--dry-run", "--budget", "600", "--out", str(out)], cwd=REPO / "tests",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    step = None
    try:
        t0 = time.monotonic()
        while step is None and time.monotonic() - t0 < 60 and check.poll() is None:
            step = next((pid for pid in pids() if (proc_stat(pid) or (0,))[0] == check.pid
                         and b"--step" in cmdline(pid)), None)
            time.sleep(0.05)
        assert step is not None, "no step process started"
        time.sleep(1)                                                    # the step is at work (imports torch & co.)
        check.send_signal(sig)
        _, err = check.communicate(timeout=60)
        assert check.returncode == rc, err
        assert [pid for pid in pids() if (proc_stat(pid) or (0, 0))[1] == step] == []   # its group: none left
        after = snapshot(out)
        time.sleep(4)                                                    # a surviving step would write by now
        assert snapshot(out) == after
        s = json.loads(after["gpu_check.json"])
        assert s["status"] == "stopped" and s["steps"][-1]["status"] == "stopped", s["steps"]
        assert all(st["status"] in ("ok", "skipped") for st in s["steps"][:-1]), s["steps"]
        assert sorted(after) == sorted(["gpu_check.json", *(st["file"] for st in s["steps"] if st["status"] == "ok")])
        assert ("stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted (Ctrl-C)") in err.splitlines()[-1]
    finally:
        if check.poll() is None: check.kill()
        if step is not None and proc_stat(step) is not None: os.killpg(step, signal.SIGKILL)   # the old bug's orphan


def test_gpu_plan_fits_the_default_budget_on_paper():
    """One plan (dflash_nb.gpu_plan): the GPU steps (without --sweep) and the summary's reserve fit the default budget,
    every part fits its step, and the check takes its limits from there."""
    from dflash_nb import gpu_plan
    assert gpu_plan.default_plan_s(dry_run=False) <= gpu_plan.BUDGET_S == 400
    # step tp runs only with two GPUs; there the check adds its plan to the default budget, which then fits too
    tp = gpu_plan.PLAN[False]["tp"]["step"]
    assert gpu_plan.default_plan_s(dry_run=False, gpus=2) == gpu_plan.default_plan_s(dry_run=False) + tp
    assert gpu_plan.default_plan_s(dry_run=False, gpus=2) <= gpu_plan.BUDGET_S + tp
    for dry in (False, True):
        for name, p in gpu_plan.PLAN[dry].items():
            assert all(0 < s <= p["step"] for s in p.get("parts", {}).values()), (dry, name)
    assert gpu_plan.step_limits("pipeline", False) == (100, 100, 150) and gpu_plan.step_limits("tests", False)[1] == 30


@pytest.mark.slow
def test_dry_run_target_forward_step(full):
    "The target step: the FLOP formula, the runs it could do here, why it skipped the others, the projection."
    out, _, _ = full
    d = load(out / FILES["target"])
    assert "2 * P_run * T" in d["flop_formula"] and d["peak_bf16_tflops"] is None       # no peak for a CPU
    r = d["rows"]
    assert r["padded_tokens"] >= r["real_tokens"] == sum(map(sum, r["doc_lengths"])) > 0
    fla = d["fast_paths"]["linear_attention_kernel"] != "torch reference"
    assert ("kernels/padded" in d["runs"]) == fla and "reference/padded" in d["runs"]
    run = d["runs"]["reference/padded"]
    assert run["useful_tflops"] == pytest.approx(r["useful_tflop"] / run["seconds"])
    skipped = {s["what"]: s["why"] for s in d["skipped"]}
    # the torch path packs too (the Gated DeltaNet conv and recurrence once per document): nothing padded computed
    assert d["runs"]["reference/packed"]["tokens_computed"] == r["real_tokens"] and "reference/packed" not in skipped
    if not fla:
        assert "--wheels" in skipped["kernels"]
    for packing, tokens in (("padded", r["padded_tokens"]), ("packed", r["real_tokens"])):   # the dense stack packs
        if f"dense/{packing}" in d["runs"]:
            assert d["runs"][f"dense/{packing}"]["tokens_computed"] == tokens
    checks = d["packed_equals_per_document"]    # every packed path is checked against per-document features
    assert set(checks) == {k for k in d["runs"] if k.endswith("/packed")} and "dense/packed" in checks
    assert all(c["ok"] and c["max_rel_err"] <= c["tol"] and c["documents"] >= 1 for c in checks.values()), checks
    assert d["auto_path"]["packing"] in ("packed", "padded") and d["matmul_peak_tflops"] > 0
    pr = d["projection"]
    best = max(v["useful_tflops"] for k, v in d["runs"].items() if not k.startswith("dense/"))
    flops = pr["epoch_tokens"] * pr["flops_per_token_64_layer"]
    assert pr["hours_per_epoch"] == pytest.approx(flops / (2 * best * 1e12) / 3600)


def test_peak_table_and_flop_formula():
    "The bf16 peak by device name (override wins), and the useful FLOPs of a row against a count by hand."
    from dflash_nb import gpu_target as gpu_flops, gpu_target as gpu_models
    assert gpu_flops.peak_tflops("NVIDIA H200") == 989 and gpu_flops.peak_tflops("NVIDIA GH200 480GB") == 989
    assert gpu_flops.peak_tflops("NVIDIA L40S") == 362 and gpu_flops.peak_tflops("NVIDIA L40") == 181
    assert gpu_flops.peak_tflops("Some new GPU") is None and gpu_flops.peak_tflops("NVIDIA H200", 500) == 500
    import torch
    dims = gpu_models.TARGET_DIMS[True]
    m = gpu_models.hybrid_target(torch.device("cpu"), dims, 4, torch.float32)    # layers 0-2 Gated DeltaNet, 3 full
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in m.model.layers]
    docs = [5, 3]
    want = 2 * sum(per_layer) * 8 + 4 * dims["num_attention_heads"] * dims["head_dim"] * (15 + 6) \
        + 3 * 6 * dims["linear_num_value_heads"] * dims["linear_key_head_dim"] * dims["linear_value_head_dim"] * 8
    assert gpu_flops.target_row_flops(m, 3, docs) == want
    assert gpu_flops.target_row_flops(m, 1, docs) == 2 * sum(per_layer[:2]) * 8 + 2 * 6 * 4 * 16 * 16 * 8


def test_packed_check_catches_a_leaking_document():
    "Fault injection: features whose first tokens of a document carry the previous document's last one fail the check."
    import torch
    from dflash_nb.gpu_target import packed_vs_per_document
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([0] * 5 + [1] * 3 + [2] * 6 + [-1] * 2)
    row = dict(input_ids=torch.randint(0, 50, (16,), generator=g), doc_ids=doc_ids)
    clean = torch.randn(16, 8, generator=g) * (doc_ids >= 0)[:, None]
    per_doc = lambda ids, docs: clean                                            # noqa: E731
    leaky = clean.clone()
    leaky[5:7] += clean[4]                                                       # document 0 leaks into document 1
    good = packed_vs_per_document(lambda ids, docs: clean + 1e-4, per_doc, row, [5, 3, 6])
    bad = packed_vs_per_document(lambda ids, docs: leaky, per_doc, row, [5, 3, 6])
    assert good["ok"] and good["max_rel_err"] < 1e-3 and good["documents"] == 3
    assert not bad["ok"] and bad["max_rel_err_first_4_tokens_of_later_documents"] == bad["max_rel_err"] > 0.1


@pytest.mark.slow
def test_tp_step_dry_run_on_cpu(tmp_path):
    """Step tp's own command (what dflash-gpu-check runs on >= 2 GPUs) in its dry run: the two 2-process runs on CPU (gloo,
    fp32, a tiny hybrid), its step record with the halved weights, the split target's features and the all-reduce."""
    out = tmp_path / "gpu_tp.json"
    p = subprocess.run([sys.executable, "-m", "dflash_nb.gpu_check", "--step", "tp", "--dry-run", "--out", str(out),
                        "--deadline-s", "240"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = load(out)
    assert d["step"] == "tp" and d["dry_run"] is True and d["complete"] is True and d["errors"] == []
    c = d["compare"]
    assert c["params_ratio_tp2_over_tp1"] == pytest.approx(0.5, abs=0.02)
    assert c["features_max_rel_err"] < 1e-5 and c["forward_median_s"]["tp2"] > 0
    assert [r["tp"] for r in d["runs"]["tp1"] + d["runs"]["tp2"]] == [1, 1, 2, 2]
    assert d["allreduce"]["bytes"] == sum(d["documents"]) * d["target"]["hidden_size"] * 4
    assert "tp2/tp1: weights per rank 0.50x" in d["headline"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_target_tp_results_add_up():
    "bench/results/target_tp.json: the measured halving, and the projection's table equal to its own parts."
    d = load(REPO / "bench" / "results" / "target_tp.json")
    assert "/work/" not in json.dumps(d) and "/tmp/" not in json.dumps(d)
    for arch in ("qwen3", "qwen3_5"):
        m = d["measured"][arch]
        assert m["params_ratio_tp2_over_tp1"] == pytest.approx(0.5, abs=0.01) and m["features_max_rel_err"] < 1e-4
        assert m["kinds_tp2"]["norms"]["split_share"] == 0 and m["kinds_tp2"]["mlp"]["split_share"] == 1
    pr = d["projection"]
    assert pr["projected"] is True and pr["card_gb"] == 80 and pr["gpus"] == 8
    for name, m in pr["models"].items():
        for r in m["rows"]:
            parts = r["target_gb"] + r["drafter_gb"] + r["embed_head_copies_gb"] + r["activations_gb"]
            assert r["total_gb"] == pytest.approx(parts) and r["fits"] == (r["total_gb"] <= 80)
            assert r["dp"] * r["tp"] == 8 and (r["embed_head_copies_gb"] > 0) == (r["tp"] > 1)
        fit = [r["tp"] for r in m["rows"] if r["fits"] and r["heads_divide"]]
        assert m["smallest_tp_that_fits"] == (fit[0] if fit else None)
    q = pr["models"]["Qwen3.6-27B"]
    assert q["heads"] == {"q": 24, "kv": 4, "tp_max_by_heads": 4} and q["layers_run"] == 62
