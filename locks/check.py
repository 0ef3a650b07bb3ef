"""Does each lock still answer its loose requirements? One line naming the package when it does not.

    python locks/check.py                    # every lock; exit 1 with one line per mismatch, 0 when all hold
    python locks/check.py --drift FREEZE     # what a `pip freeze` of another venv has that locks/train.txt does not
    python locks/check.py --installed UV PYTHON [ALLOWED ...]
                                             # the venv of PYTHON misses nothing its packages need, as `UV pip check`
                                             # sees it (ALLOWED: packages installed --no-deps on purpose;
                                             # the Makefile's --no-emit-package names are left out too)

The loose requirements are what a user's `pip install dflash_nb` asks for (settings.ini: requirements, dev_requirements,
gguf_requirements) plus the tested toolchain pins of locks/train.in; for the serving venv, locks/serving.in. A lock is
the exact set `make install` / `make serving` install (`pip install --no-deps -r`), written by `make lock`. Someone who
edits one side and not the other (a new requirement without a pin, a pin outside a bound) is told which package, and so
is one who tampers with a lock: a package pinned twice, or a pin removed that another pinned package needs. Who needs
whom comes from two places: the lock's own `# via` lines (a removed package that others were listed under), and the
installed metadata (`Requires-Dist`) of the pinned versions in the venv the lock is installed into (.venv,
.venv-serving), which names a removed leaf too: its `# via` lines left with it, but the package that needs it still
says so. Where no venv holds a pinned version yet (a fresh machine), a removed leaf is caught after the install, by
`--installed`, from uv's own `uv pip check`, since `make install` installs `--no-deps` and nothing would bring it back.
A lock or requirements file that is missing, not text, or not requirements is one line too, exit 2.
Runs on the machine's python before any venv exists: packaging from pip's vendored copy when not installed.
"""
from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:                                         # a bare python: pip carries its own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

LOCKS = Path(__file__).resolve().parent
REPO = LOCKS.parent
SETTINGS_KEYS = ("requirements", "dev_requirements", "gguf_requirements")
VENVS = {"train.txt": ".venv", "serving.txt": ".venv-serving"}   # where `make install` / `make serving` put each lock
# (the Makefile's VENV and SERVING_VENV); locks/gpu.txt is compiled --no-deps: what its pins need is the machine's


class Unreadable(Exception):
    "A lock, requirements or freeze file that is missing or not text: one line naming it, exit 2."


def text_of(path: Path) -> str:
    "The file's text, or `Unreadable` naming it (missing, a directory, not UTF-8 text)."
    try: return path.read_text(encoding="utf-8")
    except FileNotFoundError: raise Unreadable(f"{_name(path)}: no such file (run `make lock`)") from None
    except UnicodeDecodeError: raise Unreadable(f"{_name(path)}: not a text file") from None
    except OSError as e: raise Unreadable(f"{_name(path)}: cannot read it ({e.strerror})") from None


def _name(path: Path) -> str:
    "`locks/x.txt` for a file of the repository's locks dir, else the path as given."
    return f"locks/{path.name}" if path.parent.name == "locks" else str(path)


def requirement_lines(path: Path) -> list[str]:
    "The requirement lines of a requirements file: comments, blank lines and pip options dropped."
    lines = (line.split("#", 1)[0].strip() for line in text_of(path).splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def requirement(text: str, source: str) -> Requirement:
    "A parsed requirement, or `Unreadable` naming where the text came from."
    try: return Requirement(text)
    except InvalidRequirement as e:
        raise Unreadable(f"{source}: not a requirement: {text!r} ({str(e).splitlines()[0]})") from None


def settings_requirements(settings: Path) -> list[str]:
    "The space-separated requirement lists of settings.ini that setup.py installs (core, dev and gguf extras)."
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(settings)
    return [req for key in SETTINGS_KEYS for req in cfg["DEFAULT"].get(key, "").split()]


PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)")


def pin_list(lock: Path) -> list[tuple[str, str]]:
    "(canonical name, version) of every `name==version` line of a lock, in order, repeats kept."
    found = []
    for line in requirement_lines(lock):
        match = PIN.fullmatch(line)
        if not match:
            raise Unreadable(f"{_name(lock)}: not an exact pin: {line!r} (run `make lock`)")
        found.append((canonicalize_name(match.group(1)), match.group(3)))
    return found


def pins(lock: Path) -> dict[str, str]:
    "name -> version of every `name==version` line of a lock (canonical names, as pip compares them; first of a twin)."
    found = {}
    for pkg, version in pin_list(lock): found.setdefault(pkg, version)
    return found


def needed_by(lock: Path) -> dict[str, list[str]]:
    "pinned package -> the packages its `# via` lines say need it (requirements files and setup.py left out)."
    out, current, in_via = {}, None, False
    for line in text_of(lock).splitlines():
        match = PIN.match(line)
        if match:
            current, in_via = canonicalize_name(match.group(1)), False
            continue
        text = line.strip()
        if text.startswith("# via"):
            in_via, text = True, "#   " + text[len("# via"):].strip()
        if in_via and text.startswith("#   ") and current:
            who = text[4:].strip()
            if who and not who.startswith("-") and " " not in who: out.setdefault(current, []).append(who)
        elif not text.startswith("#"): in_via = False
    return out


def not_emitted(repo: Path) -> set[str]:
    "Packages `make lock` leaves out of a lock on purpose (the repository Makefile's --no-emit-package list)."
    makefile = repo / "Makefile"
    text = makefile.read_text() if makefile.is_file() else ""
    return {canonicalize_name(n) for n in re.findall(r"--no-emit-package (\S+)", text)}


def tampered(lock: Path) -> list[str]:
    "A package pinned twice; a package that the lock says needs pinned ones, yet has no pin itself (one line each)."
    name, problems, seen = _name(lock), [], {}
    for pkg, version in pin_list(lock):
        seen.setdefault(pkg, []).append(version)
    problems += [f"{name}: pins {pkg} {len(v)} times ({', '.join(v)}); run `make lock`"
                 for pkg, v in seen.items() if len(v) > 1]
    skip, unpinned = not_emitted(lock.resolve().parent.parent), {}
    for child, parents in needed_by(lock).items():
        for parent in parents:
            if canonicalize_name(parent) not in seen and canonicalize_name(parent) not in skip:
                unpinned.setdefault(canonicalize_name(parent), []).append(child)
    for parent, children in unpinned.items():
        shown = ", ".join(children[:3]) + (f" and {len(children) - 3} more" if len(children) > 3 else "")
        problems.append(f"{name}: {parent} has no pin, yet the lock says it needs {shown} (removed?); run `make lock`")
    return problems


def installed(venv: Path) -> tuple[dict, dict]:
    """(name -> (version, its Requires-Dist lines) of every distribution installed in `venv`, the marker environment
    of the venv's python); ({}, {}) where there is no venv."""
    import email.parser
    cfg = venv / "pyvenv.cfg"
    if not cfg.is_file(): return {}, {}
    found = re.search(r"(?m)^version(?:_info)?\s*=\s*(\d+\.\d+\.\d+)", cfg.read_text(errors="replace"))
    env = dict(default_environment())
    if found: env.update(python_full_version=found.group(1), python_version=".".join(found.group(1).split(".")[:2]))
    dists = {}
    for meta in venv.glob("lib/python*/site-packages/*.dist-info/METADATA"):
        head = email.parser.HeaderParser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
        if head["Name"] and head["Version"]:
            dists[canonicalize_name(head["Name"])] = (head["Version"], head.get_all("Requires-Dist") or [])
    return dists, env


def _same_version(a: str, b: str) -> bool:
    "Whether two versions are one release (a local label such as torch's +cpu aside)."
    try: return Version(a).public == Version(b).public
    except InvalidVersion: return False


def _needs(text: str, env: dict, extras: set) -> Requirement | None:
    "The Requires-Dist line `text` as a requirement where it applies here (its marker, with `extras` requested)."
    try: req = Requirement(text)
    except InvalidRequirement: return None
    if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ["", *sorted(extras)]): return req
    return None


def lost(lock: Path, venv: Path, loose: list[tuple[str, str]] = ()) -> list[str]:
    """A package that a pinned one needs, by the installed metadata of the pinned version in `venv`, yet the lock does
    not pin (one line each); nothing for a package installed at another version, or where there is no venv."""
    pinned, (dists, env) = pins(lock), installed(venv)
    skip, extras = not_emitted(lock.resolve().parent.parent), {}
    for source, text in loose:                              # `pkg[extra]` asked by settings.ini or a .in file
        req = requirement(text, source)
        extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    needed, grew = {}, True
    while grew:                                             # until no package asks a new extra of another
        grew = False
        for name, version in pinned.items():
            if name not in dists or not _same_version(dists[name][0], version): continue
            for req in filter(None, (_needs(t, env, extras.get(name, set())) for t in dists[name][1])):
                dep = canonicalize_name(req.name)
                if dep not in pinned and dep not in skip: needed.setdefault(dep, {})[f"{name}=={version}"] = None
                grew |= not set(req.extras) <= extras.get(dep, set())
                extras.setdefault(dep, set()).update(req.extras)
    return [f"{_name(lock)}: {dep} has no pin, yet {', '.join(who)} needs it (its metadata in {venv.name}; "
            "removed?); run `make lock`" for dep, who in needed.items()]


def mismatches(lock: Path, loose: list[tuple[str, str]], venv: Path | None = None) -> list[str]:
    "One line per loose requirement (source, text) that the lock's pins do not satisfy, or pin the lock lost."
    pinned, problems, missing = pins(lock), [], set()
    name = _name(lock)
    for source, text in loose:
        req = requirement(text, source)
        if req.marker is not None and not req.marker.evaluate():
            continue                                        # not for this platform/python
        version = pinned.get(canonicalize_name(req.name))
        if version is None:
            missing.add(canonicalize_name(req.name))
            problems.append(f"{name}: no pin for {req.name} ({source} asks {text}); run `make lock`")
        elif not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{name}: pins {req.name}=={version}, but {source} asks {text}; run `make lock`")
    # a loose requirement without a pin is said once, not again as the parent of what it needs or as a lost pin
    named = lambda p: p.split(": ", 1)[1].split(" ", 1)[0]
    said = [p for p in tampered(lock) if named(p) not in missing]
    said += [p for p in (lost(lock, venv, loose) if venv else []) if named(p) not in missing | set(map(named, said))]
    return said + problems


def check(repo: Path = REPO, venvs: dict | None = None) -> list[str]:
    """Every mismatch between the locks and their loose requirements (an empty list when all hold); `venvs`: lock file
    name -> the venv whose installed metadata says what its pins need (default: `VENVS` in `repo`)."""
    locks, venvs = repo / "locks", {k: repo / v for k, v in VENVS.items()} if venvs is None else venvs
    train = [("settings.ini", r) for r in settings_requirements(repo / "settings.ini")]
    train += [("locks/train.in", r) for r in requirement_lines(locks / "train.in")]
    serving = [("locks/serving.in", r) for r in requirement_lines(locks / "serving.in")]
    gpu = [("locks/gpu.in", r) for r in requirement_lines(locks / "gpu.in")]
    return (mismatches(locks / "train.txt", train, venvs.get("train.txt"))
            + mismatches(locks / "serving.txt", serving, venvs.get("serving.txt")) + mismatches(locks / "gpu.txt", gpu))


def installed_problems(report: str, allowed: list[str], repo: Path = REPO) -> list[str]:
    "The `requires` lines of a `uv pip check` report, but those of `allowed` packages or of packages left out."
    ok, left_out = {canonicalize_name(n) for n in allowed}, not_emitted(repo)
    requires = re.compile(r"The package `([^`]+)` requires `([A-Za-z0-9._-]+)")
    found = [requires.match(line.strip()) for line in report.splitlines()]
    return [m.string.strip() for m in found if m and canonicalize_name(m.group(1)) not in ok
            and canonicalize_name(m.group(2)) not in left_out]


def uv_check(uv: str, python: str) -> str:
    "What `uv pip check` reports for the venv of `python` (exit 1 means it found something), or `Unreadable`."
    try: out = subprocess.run([uv, "pip", "check", "--python", python], capture_output=True, text=True, timeout=300)
    except OSError as e: raise Unreadable(f"{uv}: cannot run it ({e.strerror})") from None
    if out.returncode not in (0, 1):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unreadable(f"{uv} pip check --python {python}: exit {out.returncode}: {last}")
    return out.stdout + out.stderr


def drift(lock: Path, freeze: Path) -> list[str]:
    "One line per package whose version in a freeze differs from the lock's (or that only one of them has)."
    locked = pins(lock)
    found = {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in requirement_lines(freeze))
             if v}
    names = sorted(set(locked) | set(found))
    return [f"{n}: locked {locked.get(n, '-')}, newest {found.get(n, '-')}" for n in names
            if Version(locked.get(n, "0")) != Version(found.get(n, "0"))]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--drift"]:
        if len(argv) != 2: raise Unreadable("usage: python locks/check.py --drift FREEZE")
        changed = drift(LOCKS / "train.txt", Path(argv[1]))
        print(f"{len(changed)} packages differ from locks/train.txt" + "".join(f"\n  {c}" for c in changed))
        return 0
    if argv[:1] == ["--installed"]:
        if len(argv) < 3: raise Unreadable("usage: python locks/check.py --installed UV PYTHON [ALLOWED ...]")
        problems = installed_problems(uv_check(argv[1], argv[2]), argv[3:])
        print("\n".join(f"the venv misses what a package needs: {p} (a pin removed or changed? run `make lock`)"
                        for p in problems) if problems else "the venv holds everything its packages need")
        return 1 if problems else 0
    problems = check()
    print("\n".join(problems) if problems else "locks match their loose requirements")
    return 1 if problems else 0


if __name__ == "__main__":
    try: sys.exit(main(sys.argv[1:]))
    except Unreadable as e:
        print(f"locks/check.py: {e}", file=sys.stderr)
        sys.exit(2)
