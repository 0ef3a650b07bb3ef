"""bench/prompt_set.py: a prompt set from the standard library's docstrings and the machine's manual pages, de-duplicated,
split by source text (no held-out prompt shares its source with a training prompt); too few prompts is one line, exit 2."""
import json, subprocess, sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, str(REPO / "bench" / "prompt_set.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_the_set_is_deduplicated_and_split_by_source(tmp_path):
    p = run("--out", str(tmp_path), "--min-prompts", "1000")
    assert p.returncode == 0, p.stderr
    rows = {side: [json.loads(l) for l in (tmp_path / f"{side}.jsonl").read_text().splitlines()]
            for side in ("train", "heldout")}
    train, held = rows["train"], rows["heldout"]
    assert len(train) >= 1000 and held
    prompts = [r["prompt"] for r in train + held]
    assert len(set(prompts)) == len(prompts)                                   # no prompt twice
    assert not {r["source_digest"] for r in train} & {r["source_digest"] for r in held}   # no shared source text
    assert {r["kind"] for r in train} == {"explain", "summarise", "continue", "answer", "code"}
    manifest = json.loads((tmp_path / "prompt_set.json").read_text())
    assert (manifest["train"], manifest["heldout"]) == (len(train), len(held))
    again = tmp_path / "again"
    assert run("--out", str(again), "--min-prompts", "1000").returncode == 0
    assert (again / "train.jsonl").read_bytes() == (tmp_path / "train.jsonl").read_bytes()   # deterministic


def test_fewer_prompts_than_asked_is_one_line(tmp_path):
    p = run("--out", str(tmp_path), "--min-prompts", "100000000")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "fewer than --min-prompts 100000000" in lines[0], p.stderr
    assert not (tmp_path / "train.jsonl").exists()
