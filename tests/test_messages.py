"""Every error message can be grepped back to its source (issue 45 item 2): inside an exception message, adjacent string
literals split over source lines may break only at a clause boundary, never between two words of one phrase, so any
phrase a user copies from a printed message is found whole on one source line. An exception message here is a string in
a `raise` statement or in the arguments of a call whose callee name ends in `Error` or is `error` (`ConfigError(...)`
built then raised, `parser.error(...)`). A break is at a clause boundary when the earlier piece ends with ": ", "; ",
", ", ". ", "? " or "— ", or ends with a space and the next piece starts with "(". `python tests/test_messages.py`
lists the breaks that are not."""
import io, re, tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLAUSE_ENDS = (": ", "; ", ", ", ". ", "? ", "— ")
_QUOTED = re.compile(r"(?s)^[A-Za-z]*('''|\"\"\"|'|\")(.*)\1$")


def _body(literal: str) -> str:
    "The text of one string literal as written in the source, without its prefix and quotes."
    m = _QUOTED.match(literal)
    return m.group(2) if m else literal


def _literals(source: str):
    "The tokens of `source`, an f-string (FSTRING_START..FSTRING_END on Python 3.12+) folded into one STRING token."
    lines = source.splitlines(keepends=True)
    fstart, depth = None, 0
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        name = tokenize.tok_name[t.type]
        if name == "FSTRING_START":
            fstart, depth = (fstart or t), depth + 1
        elif name == "FSTRING_END":
            depth -= 1
            if not depth:
                (r0, c0), (r1, c1) = fstart.start, t.end
                text = "".join(lines[r0 - 1:r1])[c0:len("".join(lines[r0 - 1:r1 - 1])) + c1]
                yield tokenize.TokenInfo(tokenize.STRING, text, fstart.start, t.end, fstart.line)
                fstart = None
        elif not depth:
            yield t


def mid_phrase_breaks(source: str) -> list[tuple[int, str, str]]:
    "(line, end of the earlier piece, start of the next) for each break inside an exception message not at a clause boundary."
    found, group, parens, in_raise, prev = [], [], [], False, None

    def close_group():
        if len(group) > 1 and (in_raise or "err" in parens):
            for a, b in zip(group, group[1:]):
                if b.start[0] == a.end[0]: continue
                before, after = _body(a.string), _body(b.string)
                if before.endswith(CLAUSE_ENDS) or (before.endswith(" ") and after.startswith("(")): continue
                found.append((a.start[0], before[-40:], after[:40]))
        group.clear()

    for t in _literals(source):
        if t.type == tokenize.STRING:
            group.append(t)
            continue
        if t.type in (tokenize.NL, tokenize.COMMENT): continue
        close_group()
        if t.type == tokenize.NAME and t.string == "raise": in_raise = True
        elif t.type == tokenize.NEWLINE: in_raise, parens = False, []
        elif t.type == tokenize.OP and t.string in "([{":
            callee = prev.string if prev is not None and prev.type == tokenize.NAME and t.string == "(" else ""
            parens.append("err" if callee.endswith("Error") or callee == "error" else "other")
        elif t.type == tokenize.OP and t.string in ")]}" and parens: parens.pop()
        prev = t
    return found


def modules() -> list[Path]:
    return sorted((REPO / "dflash_nb").glob("*.py")) + \
        sorted((REPO / "kernels").glob("*.py"))


def test_the_checker_finds_a_planted_mid_phrase_break():
    planted = 'def f(path):\n    raise ConfigError(f"{path}: the file has no "\n                      "content field")\n'
    assert [line for line, _, _ in mid_phrase_breaks(planted)] == [2]
    built = 'err = ExpectedError("the run "\n                    "stopped")\nparser.error("no "\n "such flag")\n'
    assert [line for line, _, _ in mid_phrase_breaks(built)] == [1, 3]


def test_the_checker_passes_clause_boundaries_and_other_strings():
    clauses = ('raise ConfigError(f"{path}: the file has no content field; "\n'
               '                  "add one. " "Or else "\n                  "(see the docs)")\n')
    assert mid_phrase_breaks(clauses) == []
    not_a_message = 'print("a long "\n      "line")\nx = ValueError\n'
    assert mid_phrase_breaks(not_a_message) == []


def test_every_error_message_breaks_only_at_a_clause():
    bad = [f"{p.relative_to(REPO)}:{line}: ...{end!r} + {start!r}..."
           for p in modules() for line, end, start in mid_phrase_breaks(p.read_text())]
    assert not bad, "error messages split mid-phrase (re-wrap at a clause, or build from named parts):\n" + "\n".join(bad)


if __name__ == "__main__":
    for p in modules():
        for line, end, start in mid_phrase_breaks(p.read_text()):
            print(f"{p.relative_to(REPO)}:{line}: ...{end!r} + {start!r}...")
