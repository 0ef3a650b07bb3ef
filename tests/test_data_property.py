"""Property test of the whole data pipeline: random valid, malformed and adversarial records through tokenize_dataset. Every record
is in the output with an exact loss mask, or counted in the audit under the reason it was dropped; nothing crashes; the output
is the same bytes for one worker and for two."""
import json, unicodedata
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dflash_nb.records import DataConfig, load_tokenizer, qwen3_tokenizer_dir
from dflash_nb.shards import read_shards, tokenize_dataset


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(qwen3_tokenizer_dir())


_text = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="<>\r") | st.sampled_from(["\n", "\t", " "]),
                max_size=40)

# adversarial lines and the audit reason each must be counted under
BAD = [(b'{"prompt": "broken", "completion": ', "bad_json"),
       (b"[" * 50_000 + b"]" * 50_000, "bad_json"),                                   # nesting too deep
       (b'{"prompt": "big", "completion": ' + b"7" * 6000 + b"}", "bad_json"),       # a number too long to read
       (b'{"prompt": "bad \xff\xfe utf8", "completion": "x"}', "bad_utf8"),
       (json.dumps({"prompt": "Q", "completion": 42}).encode(), "wrong_type"),
       (json.dumps({"prompt": "Q", "completion": 1e308 * 10}).encode(), "wrong_type"),  # Infinity
       (json.dumps([1, 2]).encode(), "wrong_type"),
       (json.dumps({"messages": "x"}).encode(), "wrong_type"),
       (json.dumps({"prompt": "no answer"}).encode(), "missing_field"),
       (json.dumps({"messages": []}).encode(), "empty_conversation"),
       (json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}).encode(), "unknown_role"),
       (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "no_assistant"),
       (b'{"prompt": "lone \\ud800", "completion": "x"}', "bad_text")]

_valid = st.tuples(st.sampled_from(["flat", "chat", "inline"]), _text, _text, _text)
_item = st.one_of(_valid.map(lambda v: ("valid", v)), st.sampled_from(range(len(BAD))).map(lambda i: ("bad", i)),
                  st.integers(0, 20).map(lambda i: ("dup", i)))


def _record(i: int, shape: str, prompt: str, reasoning: str, content: str) -> dict:
    prompt = f"Q{i}. {prompt}"                             # unique: the only duplicates are the ones asked for
    if shape == "flat": return {"prompt": prompt, "completion": content, "reasoning": reasoning}
    if shape == "inline": return {"prompt": prompt, "response": f"<think>\n{reasoning}\n</think>\n\n{content}"}
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": content, "reasoning_content": reasoning}]}


def _generated(reasoning: str, content: str) -> str:
    return unicodedata.normalize("NFC", f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}<|im_end|>")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(items=st.lists(_item, min_size=1, max_size=12))
@example(items=[("dup", 0)])                                                 # nothing but an empty file
@example(items=[("valid", ("flat", "Hi", "Think.\n", "Hello!")), ("bad", 1), ("valid", ("inline", "", "\nr", "\n\nc")), ("dup", 0),
                ("valid", ("chat", "naïve café", "", "🙂 x")), ("dup", 1)] + [("bad", i) for i in range(len(BAD))])
def test_every_record_kept_exactly_or_counted(tok, tmp_path_factory, items):
    tmp = tmp_path_factory.mktemp("prop")
    lines, want, kinds, valid_lines, n_dup = [], {}, Counter(), [], 0
    raw = b""
    for i, (what, v) in enumerate(items):
        if what == "valid":
            shape, p, r, c = v
            if shape == "inline": r, c = r.replace("</think>", ""), c                     # (the alphabet has no '<' anyway)
            line = json.dumps(_record(i, shape, p, r, c), ensure_ascii=False).encode()
            want[len(raw)] = _generated(r if shape != "inline" else r, c); valid_lines.append(line)
        elif what == "bad":
            line, kind = BAD[v]; kinds[kind] += 1
        else:
            if not valid_lines: continue
            line = valid_lines[v % len(valid_lines)]; n_dup += 1
        lines.append(line); raw += line + b"\n"
    (tmp / "in.jsonl").write_bytes(raw)
    if not lines: kinds["empty_file"] += 1                 # a file without records is reported as such (it is not a record)
    cfg = DataConfig(min_loss_tokens=1, max_malformed_fraction=1.0, force=True, shard_bytes=400, batch_size=3, max_examples=50)
    m1 = tokenize_dataset(str(tmp / "in.jsonl"), tok, tmp / "one", cfg, workers=1, verbose=False)
    a = m1["audit"]
    assert a["records"] == len(lines)
    assert a["malformed"]["by_kind"] == dict(sorted(kinds.items()))
    assert a["duplicates"]["count"] == n_dup and a["dropped"]["count"] == sum(kinds.values()) - kinds["empty_file"] + n_dup
    assert a["kept"] == len(want) and a["degenerate"]["count"] == 0 and a["truncated"]["count"] == 0
    ds = read_shards(tmp / "one")
    got = {}
    for s in ds:
        ids, mask = np.array(s["input_ids"]), np.array(s["loss_mask"], dtype=bool)
        assert mask.any() and np.all(np.diff(np.flatnonzero(mask)) == 1) and s["n_loss_tokens"] == mask.sum()
        got[int(s["source"].split("@")[1])] = tok.decode(ids[mask])
    assert got == want                                   # every kept record once, at its own line, with its exact loss mask
    m2 = tokenize_dataset(str(tmp / "in.jsonl"), tok, tmp / "two", cfg, workers=2, start_method="fork", verbose=False)
    assert m2["audit"] == a and m2["duplicates"] == m1["duplicates"] and m2["shards"] == m1["shards"]
    assert {p.name: p.read_bytes() for p in (tmp / "one").glob("shard-*")} == {p.name: p.read_bytes() for p in (tmp / "two").glob("shard-*")}
