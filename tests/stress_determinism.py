"""Run the trainer's bitwise-equality tests (exact resume after SIGKILL, 2 gloo ranks == 1 rank) REPEAT times in a row
while every core is kept busy by CPU-burning processes; prints one line per repetition and exits 1 on any failure.

    .venv/bin/python tests/stress_determinism.py [REPEAT]      # run once by hand: minutes, not part of the suite
"""
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from _trainer_common import cpu_load, REPO

TESTS = ["tests/test_trainer.py::test_exact_resume_after_sigkill",
         "tests/test_trainer.py::test_two_gloo_ranks_equal_one_rank"]

if __name__ == "__main__":
    repeat, failed = int(sys.argv[1]) if len(sys.argv) > 1 else 5, 0
    with cpu_load() as burners:
        for i in range(repeat):
            t = time.time()
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=REPO,
                               capture_output=True, text=True)
            failed += p.returncode != 0
            print(f"run {i + 1}/{repeat} under {len(burners)} CPU burners: {p.stdout.strip().splitlines()[-1]} "
                  f"({time.time() - t:.0f} s)", flush=True)
    sys.exit(1 if failed else 0)
