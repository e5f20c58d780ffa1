"""benchmarks/profile_diff.py on two real cProfile files: steps counted by calls of TRL's
`_generate` (a stand-in in a file named grpo_trainer.py), own time per step, and the function
that grew most first, its calls per step counted."""

import cProfile
import importlib.util

from benchmarks import profile_diff

TRAINER = """
import time


class GRPOTrainer:
    def _generate(self, work):
        for _ in range(work):
            time.sleep(0.002)
"""


def profile(tmp_path, name: str, generations: int, work: int) -> str:
    source = tmp_path / "grpo_trainer.py"
    source.write_text(TRAINER)
    spec = importlib.util.spec_from_file_location("grpo_trainer", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    profiler = cProfile.Profile()
    with profiler:
        for _ in range(generations):
            module.GRPOTrainer()._generate(work)
    path = str(tmp_path / name)
    profiler.dump_stats(path)
    return path


def test_the_function_that_grew_comes_first(tmp_path, capsys):
    base, other = profile(tmp_path, "base.prof", 2, 1), profile(tmp_path, "other.prof", 4, 5)
    profile_diff.main([base, other, "--top", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{base}: 2 step(s)") and lines[1].startswith(f"{other}: 4 step(s)")
    assert "sleep" in lines[4] and "+4 calls" in lines[4], lines  # 5 sleeps per generation against 1
