"""Data pipeline (dflash_nb.data) with the real Qwen3 tokenizer: loss masks, audit, malformed input, determinism, resume."""
import json, subprocess, sys, unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from dflash_nb.records import (DataConfig, SampleEncoder, conversation_samples, load_tokenizer, normalize_record,
                            qwen3_tokenizer_dir, template_fingerprint)
from dflash_nb.inputs import synthetic_records, write_jsonl
from dflash_nb.shards import (DataAuditError, DataMismatchError, OutDirError, check_template, load_manifest,
                              read_shards, shard_path, tokenize_dataset)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(qwen3_tokenizer_dir())


def generated(reasoning: str, content: str) -> str:
    "What the target generates for one assistant turn with the Qwen3 thinking template (nothing of it is in the generation prompt)."
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}<|im_end|>"


# Three record shapes, each single- and multi-turn. Every record comes with the list of (reasoning, content) of the turns
# that must be trained on: the final one, or with all_turns every assistant turn.
R1, C1 = "The user wants a greeting.\nKeep it short: one line.", "Hello! 👋 How can I help?"
R2, C2 = "Sum: 3 + 4 = 7, then ×2 → 14.\n\n```python\nprint((3 + 4) * 2)\n```", "\n14 — computed as $(3+4)\\cdot 2$."
R3, C3 = "\nNaïve café check: é is U+00E9.\n", "Done."

SINGLE = [
    ({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Greet me."},
                   {"role": "assistant", "content": C1, "reasoning_content": R1}]}, [(R1, C1)]),
    ({"prompt": "Greet me.", "completion": C1, "reasoning": R1}, [(R1, C1)]),
    ({"prompt": "Greet me.", "response": f"<think>\n{R1}\n</think>\n\n{C1}"}, [(R1, C1)]),
]
MULTI = [
    ({"messages": [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": C1, "reasoning_content": R1},
                   {"role": "user", "content": "Compute (3+4)*2."}, {"role": "assistant", "content": C2, "reasoning_content": R2},
                   {"role": "user", "content": "Check café."}, {"role": "assistant", "content": C3, "reasoning_content": R3}]},
     [(R1, C1), (R2, C2), (R3, C3)]),
    ({"messages": [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": C1, "reasoning_content": R1},
                   {"role": "user", "content": "Compute (3+4)*2."}], "completion": C2, "thinking": R2}, [(R1, C1), (R2, C2)]),
    ({"messages": [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": f"<think>\n{R1}\n</think>\n\n{C1}"},
                   {"role": "user", "content": "Check café."}, {"role": "assistant", "content": f"<think>{R3}</think>{C3}"}]},
     [(R1, C1), (R3, C3)]),
]


@pytest.mark.parametrize("rec,turns", SINGLE + MULTI, ids=["chat", "flat", "inline", "chat-multi", "flat-multi", "inline-multi"])
@pytest.mark.parametrize("all_turns", [False, True], ids=["final", "all_turns"])
def test_mask_decodes_to_generated_text(tok, rec, turns, all_turns):
    enc = SampleEncoder(tok)
    convs = conversation_samples(normalize_record(rec), all_turns)
    want = turns if all_turns else turns[-1:]
    assert len(convs) == len(want)
    for (_, conv), (r, c), x in zip(convs, want, enc.encode([c for _, c in convs])):
        assert tok.decode(x.ids[x.lo:x.hi]) == generated(r, c)
        # everything before the mask is the prompt with generation prompt, byte-identical to apply_chat_template,
        # and the whole sample is the template's full rendering
        assert tok.decode(x.ids[:x.lo]) == tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=True)
        assert tok.decode(x.ids) == tok.apply_chat_template(conv, tokenize=False, enable_thinking=True)


def test_mask_end_to_end_through_shards(tok, tmp_path):
    "The same property, through JSONL -> shards -> read_shards, for every shape, single- and multi-turn, with all_turns."
    recs = [r for r, _ in SINGLE + MULTI]
    want = [generated(r, c) for _, turns in SINGLE + MULTI for r, c in turns]
    write_jsonl(recs, tmp_path / "in.jsonl")
    tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", workers=1, all_turns=True,
                     min_loss_tokens=1, dedupe=False, verbose=False)     # the shapes repeat one conversation on purpose
    ds = read_shards(tmp_path / "out")
    got = []
    for s in ds:
        ids, m = np.array(s["input_ids"]), np.array(s["loss_mask"], dtype=bool)
        assert s["n_loss_tokens"] == m.sum() and s["n_tokens"] == len(ids)
        assert np.all(np.diff(np.flatnonzero(m)) == 1)          # one contiguous run
        got.append(tok.decode(ids[m]))
    assert got == want


_text = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="<>\r") | st.sampled_from(["\n", "\t", " "]),
                max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_text, reasoning=_text, content=_text)
def test_mask_property(tok, prompt, reasoning, content):
    "For any texts, the masked tokens decode to the generated text (NFC: the Qwen3 tokenizer normalises)."
    x = SampleEncoder(tok).encode([normalize_record({"prompt": prompt, "completion": content, "reasoning": reasoning})])[0]
    assert tok.decode(x.ids[x.lo:x.hi]) == unicodedata.normalize("NFC", generated(reasoning, content))
    assert not x.straddle


def seed_failure_data(path: Path) -> Path:
    "A degenerate data set: 87% of samples with empty reasoning and a 3-token answer."
    recs = [{"prompt": f"Is {i} even?", "completion": ["Yes it is", "No it isn't"][i % 2]} for i in range(87)]
    return write_jsonl(recs + synthetic_records(13, seed=3, approx_tokens=300), path)


def test_seed_failure_fails_clearly_then_force(tmp_path):
    data = seed_failure_data(tmp_path / "seed.jsonl")
    cmd = [sys.executable, "-m", "dflash_nb.data", "--input", str(data), "--tokenizer", str(qwen3_tokenizer_dir()),
           "--out", str(tmp_path / "out"), "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "87 of 100 samples (87.0%) have fewer than 16 loss tokens" in r.stderr
    assert "87% of samples have empty reasoning" in r.stderr and "--force" in r.stderr
    assert "degenerate (<16 loss)" in r.stdout                    # the audit table was printed before failing
    assert not (tmp_path / "out" / "manifest.json").exists() and (tmp_path / "out" / "audit.json").exists()
    with pytest.raises(FileNotFoundError, match="audit failed"):
        read_shards(tmp_path / "out")

    r = subprocess.run(cmd + ["--force"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    m = load_manifest(tmp_path / "out")
    a = m["audit"]
    assert m["forced"] is True and "87 of 100 samples" in a["problems"][0]
    assert (a["samples"], a["kept"], a["degenerate"]["count"], a["degenerate"]["share"]) == (100, 13, 87, 0.87)
    assert a["empty_reasoning"] == {"count": 87, "share": 0.87}
    assert a["loss_tokens_percentiles"]["p50"] <= 9 and a["loss_tokens_percentiles"]["p100"] > 100
    assert len(read_shards(tmp_path / "out")) == 13


def test_malformed_input_counted_and_good_samples_kept(tmp_path):
    good = synthetic_records(6, seed=5, approx_tokens=150)
    long_rec = {"prompt": "Write a lot.", "completion": "word " * 3000, "reasoning": "Plan: many words."}
    lines = [json.dumps(good[0]),                                             # 1
             '{"prompt": "broken", "completion": ',                           # 2 bad_json
             json.dumps(good[1]),                                             # 3
             json.dumps({"prompt": "no answer here"}),                        # 4 missing_field
             json.dumps({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}),  # 5 missing_field
             json.dumps({"prompt": "Q", "completion": 42}),                   # 6 wrong_type
             json.dumps({"messages": "not a list"}),                          # 7 wrong_type
             json.dumps([1, 2, 3]),                                           # 8 wrong_type
             json.dumps(good[2]),                                             # 9
             "",                                                              # 10 blank: skipped silently
             json.dumps(long_rec),                                            # 11 too long: truncated
             json.dumps({"messages": [{"role": "user", "content": "hi"}]}),   # 12 no_assistant
             '{"prompt": "lone surrogate \\ud800", "completion": "x"}',       # 13 bad_text (the tokenizer rejects it)
             json.dumps(good[3]),                                             # 14
             ]
    raw = b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n"                                   # opens with a UTF-8 BOM
    raw += b'{"prompt": "bad \xff\xfe utf8", "completion": "x"}\n'                                   # 15 bad_utf8
    raw += json.dumps(good[4]).encode() + b"\n" + json.dumps(good[5]).encode()                           # 16, 17 (no final newline)
    d = tmp_path / "in"; d.mkdir()
    (d / "mixed.jsonl").write_bytes(raw)
    (d / "empty.jsonl").write_bytes(b"")
    cfg = DataConfig(workers=1, max_seq_len=2048, shard_bytes=1500)    # many byte ranges: line numbers must still be right
    with pytest.raises(DataAuditError, match=r"9 of 16 records \(56\.\d%\) were dropped, over the limit of 1% \(max_malformed_fraction\): "
                                             r"bad_json 1, bad_text 1, bad_utf8 1, missing_field 2, no_assistant 1, wrong_type 3"):
        tokenize_dataset(str(d), qwen3_tokenizer_dir(), tmp_path / "out", cfg, verbose=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    cfg.max_malformed_fraction = 0.7
    m = tokenize_dataset(str(d), qwen3_tokenizer_dir(), tmp_path / "out", cfg, verbose=False)
    a = m["audit"]
    assert m["run"]["shards_skipped"] == len(m["shards"]) and a["dropped"]["count"] == 9
    assert a["malformed"]["by_kind"] == {"bad_json": 1, "bad_text": 1, "bad_utf8": 1, "empty_file": 1, "missing_field": 2,
                                         "no_assistant": 1, "wrong_type": 3}
    ex = a["malformed"]["examples"]
    assert ex["bad_json"] == ["mixed.jsonl:2: bad_json: Expecting value (character 36)"]
    assert [e.split(": ")[0] for e in ex["missing_field"]] == ["mixed.jsonl:4", "mixed.jsonl:5"]
    assert [e.split(": ")[0] for e in ex["wrong_type"]] == ["mixed.jsonl:6", "mixed.jsonl:7", "mixed.jsonl:8"]
    assert ex["bad_utf8"][0].startswith("mixed.jsonl:15: bad_utf8") and ex["bad_text"][0].startswith("mixed.jsonl:13: bad_text")
    assert ex["empty_file"] == ["empty.jsonl: empty_file: the file holds no records"]
    assert a["truncated"]["count"] == 1 and a["kept"] == 7 and a["records"] == 16
    ds = read_shards(tmp_path / "out")
    line_start = lambda rec: raw.rfind(b"\n", 0, raw.index(json.dumps(rec).encode())) + 1     # source = byte where the line starts
    offsets, long_off = [line_start(g) for g in good], line_start(long_rec)
    assert offsets[0] == 0
    assert sorted(s["source"] for s in ds) == sorted([f"mixed.jsonl@{o}" for o in offsets] + [f"mixed.jsonl@{long_off}"])
    long = next(s for s in ds if s["source"] == f"mixed.jsonl@{long_off}")
    assert long["n_tokens"] == 2048 and long["n_loss_tokens"] == sum(long["loss_mask"]) > 2000

    m = tokenize_dataset(str(d), qwen3_tokenizer_dir(), tmp_path / "drop", cfg, overlong="drop", verbose=False)
    assert (m["audit"]["truncated"]["dropped"], m["audit"]["kept"]) == (1, 6)


def _shard_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.arrow"))}


def test_deterministic_across_runs_and_workers(tmp_path):
    write_jsonl(synthetic_records(12, seed=7, approx_tokens=400), tmp_path / "in" / "a.jsonl")
    write_jsonl(synthetic_records(5, seed=8, approx_tokens=400), tmp_path / "in" / "b.jsonl")
    cfg = DataConfig(shard_bytes=6000)
    m1 = tokenize_dataset(str(tmp_path / "in"), qwen3_tokenizer_dir(), tmp_path / "o1", cfg, workers=1, verbose=False)
    assert len(m1["shards"]) >= 4
    for method in ("fork", "spawn"):          # forked workers inherit the encoder; spawned ones rebuild it from JSON
        m2 = tokenize_dataset(str(tmp_path / "in"), qwen3_tokenizer_dir(), tmp_path / method, cfg, workers=2, start_method=method,
                              verbose=False)
        assert m2["run"]["workers"] == 2
        assert _shard_bytes(tmp_path / "o1") == _shard_bytes(tmp_path / method)
        assert m1["audit"] == m2["audit"] and m1["shards"] == m2["shards"]


def test_resume_skips_finished_and_repairs(tmp_path):
    write_jsonl(synthetic_records(9, seed=9, approx_tokens=300), tmp_path / "in.jsonl")
    cfg = DataConfig(workers=1, shard_bytes=4000)
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", cfg, verbose=False)
    ref, n = _shard_bytes(tmp_path / "out"), len(m["shards"])
    assert n >= 3
    # a killed run's leftovers: a temp file, a shard cut short, a missing shard, and a shard from a bigger earlier plan
    (tmp_path / "out" / f".shard-00001.arrow.tmp-{m['dataset_id']}-{2**22 + 1}").write_bytes(b"partial")   # our id, a dead pid
    p = shard_path(tmp_path / "out", 1); p.write_bytes(p.read_bytes()[:100])
    shard_path(tmp_path / "out", 2).unlink()
    shard_path(tmp_path / "out", n + 3).write_bytes(shard_path(tmp_path / "out", 0).read_bytes())   # ours, by its statistics
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", cfg, verbose=False)
    assert m["run"]["shards_skipped"] == n - 2
    assert _shard_bytes(tmp_path / "out") == ref
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(ref) | {"manifest.json"}
    # a content-changing setting invalidates every shard
    with pytest.raises(OutDirError, match="holds another data set"):
        tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", cfg, max_seq_len=256, verbose=False)
    assert _shard_bytes(tmp_path / "out") == ref and load_manifest(tmp_path / "out")    # refused: nothing touched
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", cfg, max_seq_len=256, replace=True,
                         verbose=False)
    assert m["run"]["shards_skipped"] == 0 and max(read_shards(tmp_path / "out").lengths) == 256


def test_manifest_fingerprints_and_template_refusal(tok, tmp_path):
    write_jsonl(synthetic_records(2, approx_tokens=100), tmp_path / "in.jsonl")
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", workers=1, verbose=False)
    assert m["template_kwargs"] == {"enable_thinking": True}
    assert m["template_fingerprint"] == template_fingerprint(tok, {"enable_thinking": True})
    check_template(m, tok)

    other = load_tokenizer(qwen3_tokenizer_dir())      # the same tokenizer with another chat template
    other.chat_template = tok.chat_template.replace("<think>\\n", "<think>")
    with pytest.raises(DataMismatchError, match="another chat template"):
        check_template(m, other)


def test_generation_prompt_part_is_not_masked():
    "With a template whose generation prompt already opens the thinking block (as Qwen3.5/3.6 do), the mask starts after it."
    t = load_tokenizer(qwen3_tokenizer_dir())
    gen = "{{- '<|im_start|>assistant\\n' }}"
    assert t.chat_template.count(gen) == 1
    t.chat_template = t.chat_template.replace(gen, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    for rec, turns in SINGLE + MULTI:
        conv = normalize_record(rec)
        x = SampleEncoder(t).encode([conv])[0]
        r, c = turns[-1]
        assert t.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True).endswith("<think>\n")
        assert t.decode(x.ids[x.lo:x.hi]) == generated(r, c)[len("<think>\n"):]
        assert not x.straddle
