"""What a test session started does not outlive it, however pytest ends: Ctrl-C, SIGTERM, or SIGKILL.

Tests start servers (SeaweedFS in a session of its own), vLLM workers (sessions of their own), console scripts and
training processes, some for minutes. Ctrl-C runs the fixtures' teardown; SIGKILL (an out-of-memory kill, a CI runner's
timeout) runs nothing. So `conftest.py` marks the session: a random value in `DFLASH_TEST_SESSION`, set before any test
runs, which every process the session starts inherits (pytest-xdist workers too, and anything they start, unless a test
gives a child an environment made from scratch). It starts this guard, a child that asks the kernel for SIGTERM when
its parent dies (PR_SET_PDEATHSIG) and waits. When pytest has gone without dismissing it, the guard lets the processes
that watch their own parent end first (a vLLM worker removes its files), then terminates every process that still
carries the mark (SIGTERM, SIGKILL after a grace), and removes the /dev/shm files they held. Files tests write live
under pytest's base temp directory, which pytest itself prunes (it keeps the last three).

    python tests/session_guard.py MARK_VALUE PARENT_PID     # started by conftest.py, not by hand
"""
import ctypes, os, signal, sys, threading, time

MARK = "DFLASH_TEST_SESSION"
GRACE_S = 5.0          # seconds processes get to end by themselves, then again after SIGTERM before SIGKILL
PR_SET_PDEATHSIG = 1


def marked(value: str) -> list[int]:
    "Pids of the live processes started with MARK=value in their environment, this one left out."
    needle, out = f"\0{MARK}={value}\0".encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid(): continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f: env = b"\0" + f.read()
        except OSError: continue                   # gone meanwhile, or not ours to read
        if needle in env: out.append(int(d))       # a zombie's environ reads empty: never listed
    return out


def end_all(value: str, settle: float = 0.0, grace: float = GRACE_S) -> list[int]:
    """Terminate every process marked `value` that is still there after `settle` seconds (SIGTERM, SIGKILL after
    `grace`); remove the /dev/shm files they held. The pids it had to end."""
    from dflash_nb.vllm_worker import shm_files
    t0 = time.monotonic()
    while marked(value) and time.monotonic() - t0 < settle: time.sleep(0.1)
    pids = marked(value)
    if not pids: return []
    held = shm_files(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked(value):
            try: os.kill(pid, sig)
            except ProcessLookupError: pass
        t0 = time.monotonic()
        while marked(value) and time.monotonic() - t0 < grace: time.sleep(0.1)
    for f in held:
        try: os.unlink(f)
        except OSError: pass
    return pids


def main(value: str, parent: int):
    gone, dismissed = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: gone.set())
    signal.signal(signal.SIGUSR1, lambda *_: dismissed.set())       # pytest ended and cleaned up itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)                    # Ctrl-C is pytest's to handle
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    while not (gone.is_set() or dismissed.is_set()):
        if os.getppid() != parent: break                            # died before the prctl took
        gone.wait(1.0)
    if dismissed.is_set(): return
    left = end_all(value, settle=GRACE_S)   # vLLM workers watch their parent's pipe and remove their own files first
    if left: print(f"session_guard: pytest ended without cleaning up; ended {len(left)} processes it had started",
                   file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
