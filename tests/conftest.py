"""Shared pytest setup: the `gpu` marker skips where there is no CUDA device; pytest-xdist workers share the cores;
nothing the session starts outlives it (tests/session_guard.py)."""
import os, signal, subprocess, sys, uuid
from pathlib import Path
import pytest, torch

from session_guard import MARK, end_all

pytest_plugins = ["s3_server"]  # the `s3_server` fixture: a real SeaweedFS S3 server on 127.0.0.1 (tests/s3_server.py)


def pytest_collection_modifyitems(config, items):
    if _workers() > 1:   # the modules holding `slow` tests start first, so no worker ends alone on a long one
        slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)   # stable: file order kept otherwise
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _workers() -> int:
    "How many pytest-xdist workers share this run (1 without `-n`)."
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _worker_share() -> int:
    "Torch threads per worker under `pytest -n N`: N workers x all cores each would oversubscribe the cores."
    return max(1, (os.cpu_count() or 1) // _workers())


def pytest_configure(config):
    if _workers() > 1: torch.set_num_threads(_worker_share())
    if not hasattr(config, "workerinput"): _start_guard(config)   # once, in the process that runs the session


def _start_guard(config):
    "Mark the session in the environment every process it starts inherits, and start its guard (not marked itself)."
    value = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != MARK}
    os.environ[MARK] = value
    # from the main thread: the guard's PR_SET_PDEATHSIG fires when the thread that started it ends
    config._session_guard = subprocess.Popen([sys.executable, str(Path(__file__).with_name("session_guard.py")), value,
                                              str(os.getpid())], stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=True)   # Ctrl-C reaches pytest, not it


def pytest_unconfigure(config):
    "The session's processes have ended (or are ended here, and named); the guard is dismissed."
    guard = getattr(config, "_session_guard", None)
    if guard is None: return
    left = end_all(os.environ[MARK], settle=2.0)   # xdist workers may take a moment to exit
    guard.send_signal(signal.SIGUSR1)
    guard.wait()
    if left: print(f"\nconftest: {len(left)} processes the tests started were still running at the end; ended",
                   file=sys.stderr)


@pytest.fixture(autouse=True, scope="module")
def _worker_threads():
    "Under `-n N` each module starts with the worker's share, whatever thread count an earlier module left set."
    if _workers() > 1: torch.set_num_threads(_worker_share())
    yield
