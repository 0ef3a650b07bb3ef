"""Every input checked, every template setting recorded: chat_template_kwargs (Qwen3.6-style preserve_thinking), thinking off,
fingerprints by tokenizer part, the dropped-record ceiling, input listing, bad lines, and an --out never destroyed (real Qwen3 tokenizer)."""
import json, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

from dflash_nb import inputs as inputs_mod
from dflash_nb.records import load_tokenizer, normalize_record, qwen3_tokenizer_dir, template_fingerprint
from dflash_nb.inputs import InputError, list_inputs
from dflash_nb.inputs import synthetic_records, write_jsonl
from dflash_nb.shards import (CorruptFileError, DataAuditError, DataMismatchError, OutDirError, check_template,
                              load_manifest, read_shards, shard_path, tokenize_dataset)
from dflash_nb.config import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from _data_common import drops_tool_turns, qwen36_style, tokenizer_copy   # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
R1, C1, R2, C2 = "First I greet.", "Hello there, how can I help you today?", "Then I add: 3 + 4 = 7.", "The sum of three and four is seven."
MULTI = {"messages": [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": C1, "reasoning_content": R1},
                      {"role": "user", "content": "Add 3 and 4."}, {"role": "assistant", "content": C2, "reasoning_content": R2}]}


@pytest.fixture(scope="module")
def q36(tmp_path_factory):
    return tokenizer_copy(tmp_path_factory.mktemp("tok") / "qwen36", qwen36_style)


def _samples(out):
    ds = read_shards(out)
    tok = load_tokenizer(qwen3_tokenizer_dir())
    res = []
    for s in ds:
        ids, m = np.array(s["input_ids"]), np.array(s["loss_mask"], dtype=bool)
        res.append((tok.decode(ids[:np.argmax(m)]), tok.decode(ids[m])))
    return res


def test_preserve_thinking_renders_earlier_reasoning_and_changes_the_fingerprint(q36, tmp_path):
    write_jsonl([MULTI] + synthetic_records(3, seed=1, approx_tokens=150), tmp_path / "in.jsonl")
    base = tokenize_dataset(str(tmp_path / "in.jsonl"), q36, tmp_path / "base", workers=1, verbose=False)
    r = subprocess.run([sys.executable, "-m", "dflash_nb.data", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(q36),
                        "--out", str(tmp_path / "keep"), "--workers", "1", "--chat-template-kwargs", '{"preserve_thinking": true}'],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    keep = load_manifest(tmp_path / "keep")
    assert keep["template_kwargs"] == {"enable_thinking": True, "preserve_thinking": True}
    assert keep["config"]["chat_template_kwargs"] == {"preserve_thinking": True}
    assert keep["template_fingerprint"] != base["template_fingerprint"]
    tok = load_tokenizer(q36)
    assert keep["template_fingerprint"] == template_fingerprint(tok, {"enable_thinking": True, "preserve_thinking": True})
    check_template(keep, tok)
    (p0, g0), (p1, g1) = _samples(tmp_path / "base")[0], _samples(tmp_path / "keep")[0]
    # the generation prompt of a Qwen3.6-style template opens the thinking block: the mask starts after it
    assert g0 == g1 == f"{R2}\n</think>\n\n{C2}<|im_end|>"
    assert R1 not in p0 and f"<think>\n{R1}\n</think>\n\n{C1}" in p1      # earlier reasoning only with preserve_thinking
    conv = normalize_record(MULTI)
    assert p1 == tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True, preserve_thinking=True)
    r = subprocess.run([sys.executable, "-m", "dflash_nb.data", "--input", "x", "--tokenizer", str(q36), "--out", str(tmp_path / "o"),
                        "--chat-template-kwargs", "[1]"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "python -m dflash_nb.data: error: --chat-template-kwargs: expected dict, got [1]"


def test_thinking_off_strips_reasoning_counted_and_fails_when_most_lose_it(tmp_path):
    recs = [MULTI] + synthetic_records(8, seed=2, approx_tokens=120)
    write_jsonl(recs, tmp_path / "in.jsonl")
    kw = dict(workers=1, enable_thinking=False, min_loss_tokens=1, verbose=False)
    with pytest.raises(DataAuditError, match=r"9 of 9 samples \(100.0%\) had reasoning that the chat template with thinking off does not "
                                             r"render, so it was stripped.*enable_thinking=true.*--force"):
        tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", **kw)
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", force=True, **kw)
    a = m["audit"]
    assert (a["kept"], a["malformed"]["count"], a["reasoning_stripped"]["count"]) == (9, 0, 9)     # no template_error any more
    assert m["template_kwargs"] == {"enable_thinking": False}
    prompt, gen = _samples(tmp_path / "out")[0]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and gen == f"{C2}<|im_end|>"
    # a few reasoning records among plain ones stay under the limit
    plain = [{"prompt": f"Say something about the number {i}.", "completion": f"The number {i} is " + "quite nice " * 10} for i in range(19)]
    write_jsonl(plain + [MULTI], tmp_path / "few.jsonl")
    m = tokenize_dataset(str(tmp_path / "few.jsonl"), qwen3_tokenizer_dir(), tmp_path / "few", **kw)
    assert (m["audit"]["kept"], m["audit"]["reasoning_stripped"]["count"], m["forced"]) == (20, 1, False)


def test_fingerprint_names_the_tokenizer_part_that_differs(tmp_path):
    write_jsonl(synthetic_records(2, approx_tokens=100), tmp_path / "in.jsonl")
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), tmp_path / "out", workers=1, verbose=False)

    def other_split(j):       # another pre-tokenizer split pattern: the vocabulary is the same, ids are not
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+"
        return j
    from transformers import PreTrainedTokenizerFast
    tok = load_tokenizer(qwen3_tokenizer_dir())
    def as_class(path):       # what AutoTokenizer gives for a folder that does not name the tokenizer class
        t = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>")
        t.chat_template = tok.chat_template
        return t
    same_file, other = as_class(qwen3_tokenizer_dir()), as_class(tokenizer_copy(tmp_path / "split", backend=other_split))
    assert tok.get_vocab() == other.get_vocab() and tok("12345 hello").input_ids != other("12345 hello").input_ids
    with pytest.raises(DataMismatchError, match=r"another tokenizer than the target's \(different: class, decoder, pre_tokenizer\)"):
        check_template(m, other)
    with pytest.raises(DataMismatchError, match=r"another tokenizer than the target's \(different: class, decoder, pre_tokenizer\)"):
        check_template(m, same_file)
    # (the same files as another class split text differently too)
    # the trainer's check keeps the class of the error, so its CLI reports it as one line
    from dflash_nb.trainer import check_template as trainer_check
    with pytest.raises(DataMismatchError, match=f"refusing to train on {tmp_path}.*class, decoder, pre_tokenizer"):
        trainer_check(m, other, tmp_path)


def test_bad_records_are_counted_never_a_crash(tmp_path):
    good = synthetic_records(4, seed=3, approx_tokens=120)
    notool = tokenizer_copy(tmp_path / "notool", drops_tool_turns)
    lines = [json.dumps(good[0]),
             json.dumps({"messages": [{"role": "wizard", "content": "Cast a spell."}, {"role": "assistant", "content": C1}]}),  # unknown_role
             json.dumps({"messages": []}),                                                                                # empty_conversation
             json.dumps({"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "SUNNY-42"},
                                      {"role": "assistant", "content": C1, "reasoning_content": R1}]}),                  # dropped_turn
             "[" * 100_000 + "]" * 100_000,                                                                             # RecursionError
             '{"prompt": "big", "completion": ' + "9" * 10_000 + "}",                                                   # too long a number
             '{"prompt": "inf", "completion": 1e999}',                                                                  # inf: wrong_type
             '{"prompt": NaN, "completion": "x"}',
             json.dumps(good[1]), json.dumps(good[1]),                                                                  # a duplicate
             json.dumps(good[2])]
    # a UTF-16 line: its bytes are not UTF-8, and its newline byte leaves a second line (a NUL): bad_utf8 and bad_json
    raw = "\n".join(lines).encode() + b"\n" + '{"prompt": "utf-16", "completion": "x"}\n'.encode("utf-16") + b"\n" + json.dumps(good[3]).encode()
    (tmp_path / "in.jsonl").write_bytes(raw)
    with pytest.raises(DataAuditError, match=r"10 of 14 records .* were dropped.*bad_json 3, bad_utf8 1, dropped_turn 1, duplicate 1, "
                                             r"empty_conversation 1, unknown_role 1, wrong_type 2"):
        tokenize_dataset(str(tmp_path / "in.jsonl"), notool, tmp_path / "out", workers=1, verbose=False)
    a = json.loads((tmp_path / "out" / "audit.json").read_text())["audit"]
    ex = {k: v[0] for k, v in a["malformed"]["examples"].items()}
    assert ex["unknown_role"].startswith("in.jsonl:2: unknown_role: messages[0].role 'wizard' is not one the template renders")
    assert ex["dropped_turn"] == "in.jsonl:4: dropped_turn: the chat template leaves out messages[1] (role 'tool')"
    assert ex["bad_json"] == "in.jsonl:5: bad_json: nested too deeply"
    assert a["duplicates"]["examples"][0].startswith("in.jsonl@") and a["kept"] == 4
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), notool, tmp_path / "out", workers=1, max_malformed_fraction=0.75, verbose=False)
    ds = read_shards(tmp_path / "out")
    assert len(ds) == 4 and len({tuple(s["input_ids"]) for s in ds}) == 4 and list(ds.lengths) == [s["n_tokens"] for s in ds]
    assert sum(len(r) for r in m["duplicates"].values()) == 1


def test_inputs_symlink_loop_same_file_once_and_unreadable_named(tmp_path, monkeypatch):
    d = tmp_path / "in"
    write_jsonl(synthetic_records(2, seed=4, approx_tokens=80), d / "a.jsonl")
    write_jsonl(synthetic_records(2, seed=5, approx_tokens=80), d / "sub" / "b.jsonl")
    (d / "sub" / "loop").symlink_to(d)
    (d / "sub" / "deeper").mkdir(); (d / "sub" / "deeper" / "up").symlink_to(d / "sub")
    (d / "same.jsonl").symlink_to(d / "a.jsonl")
    files = list_inputs([str(d / "**" / "*.jsonl"), str(d / "sub"), str(d / "a.jsonl")])
    assert [f.name for f in files] == ["a.jsonl", "sub/b.jsonl"]
    with pytest.raises(InputError, match="does not exist"):
        list_inputs(str(tmp_path / "nope.jsonl"))
    real_open = inputs_mod.open_input                                   # fault injection: one input cannot be read
    def failing(f, start=0, cfg=None):
        if f.name == "sub/b.jsonl": raise PermissionError(13, "Permission denied", f.uri)
        return real_open(f, start, cfg)
    monkeypatch.setattr(inputs_mod, "open_input", failing)
    with pytest.raises(InputError, match=f"input {d / 'sub' / 'b.jsonl'}: cannot read it: PermissionError"):
        tokenize_dataset(str(d), qwen3_tokenizer_dir(), tmp_path / "out", workers=1, verbose=False)


def test_tokenizer_that_is_not_a_directory_fails_at_once(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer Qwen/Qwen3-8B: no such directory \(to download it from the Hugging Face hub, write hub:Qwen/Qwen3-8B\)"):
        load_tokenizer("Qwen/Qwen3-8B")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_nb.data", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_out_dir_is_never_destroyed(tmp_path):
    "The data CLI deletes nothing it did not write and touches nothing before its arguments are checked."
    write_jsonl(synthetic_records(3, seed=6, approx_tokens=100), tmp_path / "in.jsonl")
    out = tmp_path / "out"
    tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), out, workers=1, shard_bytes=2000, verbose=False)
    (out / "README.md").write_text("my notes")
    (out / "shard-00099.txt").write_text("not a shard name")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # a typo in the arguments, a missing input, another data set: refused, nothing touched, one line naming the culprit, exit 2
    r = _cli("--input", tmp_path / "in.jsonl", "--tokenizer", tmp_path / "typo", "--out", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"tokenizer {tmp_path / 'typo'}: no such directory" in r.stderr
    r = _cli("--input", tmp_path / "missing.jsonl", "--tokenizer", qwen3_tokenizer_dir(), "--out", out)
    assert r.returncode == 2 and r.stderr.strip() == f"python -m dflash_nb.data: error: input {tmp_path / 'missing.jsonl'} does not exist"
    r = _cli("--input", tmp_path / "in.jsonl", "--tokenizer", qwen3_tokenizer_dir(), "--out", out, "max_seq_len=512", "--workers", "1")
    assert r.returncode == 2 and f"--out {out} holds another data set" in r.stderr and "--replace" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --replace deletes the other data set's files, and only those
    r = _cli("--input", tmp_path / "in.jsonl", "--tokenizer", qwen3_tokenizer_dir(), "--out", out, "max_seq_len=512", "--workers", "1",
             "--replace")
    assert r.returncode == 0, r.stderr
    assert (out / "README.md").read_text() == "my notes" and (out / "shard-00099.txt").exists()
    assert load_manifest(out)["config"]["max_seq_len"] == 512 and len(read_shards(out)) == 3
    # a shard-named file this program did not write, in a directory without a data set: refused even with --replace
    foreign = tmp_path / "foreign"; foreign.mkdir()
    (foreign / "shard-00000.arrow").write_bytes(b"someone else's file")
    for extra in ([], ["--replace"]):
        with pytest.raises(OutDirError, match="shard-00000.arrow was not written by python -m dflash_nb.data"):
            tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), foreign, workers=1, verbose=False,
                             replace=bool(extra))
    assert (foreign / "shard-00000.arrow").read_bytes() == b"someone else's file" and len(list(foreign.iterdir())) == 1


def test_corrupt_shard_and_manifest_name_the_file(tmp_path):
    write_jsonl(synthetic_records(2, seed=7, approx_tokens=80), tmp_path / "in.jsonl")
    out = tmp_path / "out"
    tokenize_dataset(str(tmp_path / "in.jsonl"), qwen3_tokenizer_dir(), out, workers=1, verbose=False)
    p = shard_path(out, 0); good = p.read_bytes()
    p.write_bytes(good[:50])
    with pytest.raises(CorruptFileError, match=f"shard {p}: cannot read it .*rerun python -m dflash_nb.data"):
        read_shards(out)
    p.write_bytes(good)
    (out / "manifest.json").write_text('{"format": "dflash_nb.data/2", "shar')
    with pytest.raises(CorruptFileError, match=f"{out / 'manifest.json'}: not a readable manifest"):
        read_shards(out)


def test_preserve_thinking_data_trains_and_other_settings_are_refused(q36, tmp_path):
    "Data rendered with the target's template and preserve_thinking trains; the same data under another template is refused."
    from _trainer_common import train_cfg
    from dflash_nb.trainer import train
    write_jsonl(synthetic_records(12, seed=9, approx_tokens=40), tmp_path / "in.jsonl")
    data = tmp_path / "data"
    m = tokenize_dataset(str(tmp_path / "in.jsonl"), q36, data, workers=1, max_seq_len=160, min_loss_tokens=8,
                         chat_template_kwargs={"preserve_thinking": True}, verbose=False)
    assert m["template_kwargs"] == {"enable_thinking": True, "preserve_thinking": True}
    s = train(train_cfg(tmp_path / "run", data, steps=2, target={"tokenizer": str(q36)}))
    assert s["steps"] == 2 and s["stopped"] is None
    with pytest.raises(DataMismatchError, match=f"refusing to train on {data}: the data was made with another chat template"):
        train(train_cfg(tmp_path / "run2", data, steps=2))            # the bundled Qwen3 template is not the one the data has
