"""The embedded demo, end to end, through the real entry point (`python -m dflash_nb.train` with only overrides, so the
packaged demo config is used): regenerate with the tiny target → tokenize + audit → train → τ before/after → export."""
import json, subprocess, sys, time
import pytest
from _trainer_common import env, REPO


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_demo_end_to_end(tmp_path):
    run_dir = tmp_path / "demo"
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "dflash_nb.train", f"train.run_dir={run_dir}"],   # the full demo, only moved
                       cwd=REPO, env={**env(), "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=1200)
    wall = time.time() - t0
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads((run_dir / "report.json").read_text())
    # every step left its output where the final message says
    assert len((run_dir / "generated" / "train.jsonl").read_text().splitlines()) == 121
    assert len((run_dir / "generated" / "heldout.jsonl").read_text().splitlines()) == 16
    m = json.loads((run_dir / "data" / "train" / "manifest.json").read_text())
    assert m["audit"]["samples"] == 121
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000300"
    cfg = json.loads((run_dir / "drafter" / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert (run_dir / "drafter" / "model.safetensors").exists()
    for where in ("generated completions", "tokenized data", "checkpoints", "exported drafter", "acceptance length tau"):
        assert where in p.stdout
    # the drafter learned the target's own outputs: τ rises clearly on held-out prompts
    before, after = r["tau_before"]["tau"], r["tau_after"]["tau"]
    print(f"demo: tau {before:.3f} -> {after:.3f} in {wall:.0f}s")
    assert before < 1.1 and after > before + 0.15, (before, after)   # measured: 1.00 -> 1.27
