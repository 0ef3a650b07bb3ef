"""Does each lock still answer its loose requirements? One line naming the package when it does not.

    python locks/check.py                    # every lock; exit 1 with one line per mismatch, 0 when all hold
    python locks/check.py --drift FREEZE     # what a `pip freeze` of another venv has that locks/train.txt does not

The loose requirements are what a user's `pip install dflash_nb` asks for (settings.ini: requirements, dev_requirements,
gguf_requirements) plus the tested toolchain pins of locks/train.in; for the serving venv, locks/serving.in. A lock is
the exact set `make install` / `make serving` install (`pip install --no-deps -r`), written by `make lock`. Someone who
edits one side and not the other (a new requirement without a pin, a pin outside a bound) is told which package.
Runs on the machine's python before any venv exists: packaging from pip's vendored copy when not installed.
"""
import configparser
import re
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:                                         # a bare python: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

LOCKS = Path(__file__).resolve().parent
REPO = LOCKS.parent
SETTINGS_KEYS = ("requirements", "dev_requirements", "gguf_requirements")


def requirement_lines(path: Path) -> list[str]:
    "The requirement lines of a requirements file: comments, blank lines and pip options dropped."
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def settings_requirements(settings: Path) -> list[str]:
    "The space-separated requirement lists of settings.ini that setup.py installs (core, dev and gguf extras)."
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(settings)
    return [req for key in SETTINGS_KEYS for req in cfg["DEFAULT"].get(key, "").split()]


def pins(lock: Path) -> dict[str, str]:
    "name -> version of every `name==version` line of a lock (the names canonical, as pip compares them)."
    found = {}
    for line in requirement_lines(lock):
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", line)
        if not match:
            raise SystemExit(f"locks/{lock.name}: not an exact pin: {line!r} (run `make lock`)")
        found[canonicalize_name(match.group(1))] = match.group(3)
    return found


def mismatches(lock: Path, loose: list[tuple[str, str]]) -> list[str]:
    "One line per loose requirement (source, text) that the lock's pins do not satisfy."
    pinned, problems = pins(lock), []
    name = f"locks/{lock.name}"
    for source, text in loose:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue                                        # not for this platform/python
        version = pinned.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{name}: no pin for {req.name} ({source} asks {text}); run `make lock`")
        elif not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{name}: pins {req.name}=={version}, but {source} asks {text}; run `make lock`")
    return problems


def check(repo: Path = REPO) -> list[str]:
    "Every mismatch between the locks and their loose requirements (an empty list when all hold)."
    locks = repo / "locks"
    train = [("settings.ini", r) for r in settings_requirements(repo / "settings.ini")]
    train += [("locks/train.in", r) for r in requirement_lines(locks / "train.in")]
    serving = [("locks/serving.in", r) for r in requirement_lines(locks / "serving.in")]
    gpu = [("locks/gpu.in", r) for r in requirement_lines(locks / "gpu.in")]
    return (mismatches(locks / "train.txt", train) + mismatches(locks / "serving.txt", serving)
            + mismatches(locks / "gpu.txt", gpu))


def drift(lock: Path, freeze: Path) -> list[str]:
    "One line per package whose version in a freeze differs from the lock's (or that only one of them has)."
    locked = pins(lock)
    found = {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in requirement_lines(freeze))
             if v}
    names = sorted(set(locked) | set(found))
    return [f"{n}: locked {locked.get(n, '-')}, newest {found.get(n, '-')}" for n in names
            if Version(locked.get(n, "0")) != Version(found.get(n, "0"))]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drift"]:
        changed = drift(LOCKS / "train.txt", Path(sys.argv[2]))
        print(f"{len(changed)} packages differ from locks/train.txt" + "".join(f"\n  {c}" for c in changed))
        sys.exit(0)
    problems = check()
    print("\n".join(problems) if problems else "locks match their loose requirements")
    sys.exit(1 if problems else 0)
