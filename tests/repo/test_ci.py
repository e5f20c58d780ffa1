"""CI runs what the README tells a user to run: its quick start is `make demo` / `make test`,
the Makefile's set-up is the README's Install commands, `make test` runs the README's test
command, and `.ci/run` is `make quality`, `make test`, then `make test-stacks` (the compatibility
suite on every stack in stacks/, each venv built by the rule that builds .venv). The ranges start
at versions CI pins, and torch's are the series the plugin tables FSDP2's private attributes for.
The docs name only paths and modules that exist. The Makefile is read through `make -n` (what
make would run), not by parsing its text."""

import configparser
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from accel_gradsync.compat.versions import TESTED_TORCH, is_tested_torch

ROOT = Path(__file__).resolve().parents[2]
TITLE_COMMAND = "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --defer-grad-sync"


def _section(section: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]


def _bash_blocks(section: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", _section(section), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def _make_would_run(target: str, *args: str) -> list[str]:
    """The commands `make TARGET` runs from scratch (-B: as if nothing were built yet)."""
    command = ["make", "-n", "-B", "-s", target, *args]
    out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip() and not line.startswith("make")]


def _pins(name: str) -> dict[str, Version]:
    lines = [line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {package.lower(): Version(version) for package, version in pins}


def _requirements() -> list[Requirement]:
    """setup.cfg's install_requires and the recipes, test and bench extras (quality tools are not ranged)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in ("recipes", "test", "bench"):
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip()]


def test_quick_start_is_make_demo_and_make_test():
    assert _bash_blocks("Quick start") == ["make demo", "make test"]


STACKS = sorted(p.stem for p in (ROOT / "stacks").glob("*.txt"))


def test_ci_checks_quality_then_is_make_test_then_the_stacks():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    assert commands[-3:] == ["make quality", "make test", "make test-stacks"]


# What a stack's installs need in their environment: torch 2.15.0 lies above the cap this CI
# machine's pip config puts on torch (the releases on its disk), so that stack's installs lift it.
PIP_ENV = {"torch-2.15": "PIP_CONSTRAINT=/dev/null "}


def test_make_test_stacks_runs_the_compat_suite_on_every_stack_in_its_own_venv():
    """Each stack's venv is built by `setup`'s rule from its stacks/ file (its torch pin first, on
    its own, in the environment its `# pip-env:` line names), and the suite runs with that venv's
    python. Every tested torch series has a stack or constraints.txt."""
    assert STACKS == ["torch-2.15", "trl-vllm", "vllm-0.33"]
    for stack in STACKS:
        args = [f"VENV=.venv-stacks/{stack}", f"CONSTRAINTS=stacks/{stack}.txt", "EXTRAS=recipes,test"]
        would_run = _make_would_run("test-compat", *args)
        torch = _pins(f"stacks/{stack}.txt")["torch"]
        env = PIP_ENV.get(stack, "")
        assert would_run == [
            f"test -x .venv-stacks/{stack}/bin/python || python3 -m venv .venv-stacks/{stack}",
            f"{env}python -m pip install torch=={torch}",
            f'{env}python -m pip install -c stacks/{stack}.txt -e ".[recipes,test]"',
            f"touch .venv-stacks/{stack}/.installed",
            "HF_HUB_OFFLINE=1 python -m pytest -q -m compat",
        ]
        assert is_tested_torch(str(torch))
    show = ["make", "-s", "--eval", "show-stacks: ; @echo $(STACKS)", "show-stacks"]
    out = subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == STACKS  # what `make test-stacks` loops over


def test_make_sets_up_with_the_readme_install_commands():
    install = _bash_blocks("Install")
    assert install == _make_would_run("setup")[1:-1]  # between creating the venv and marking it done
    # torch first and pinned: anything else would let pip pull a multi-GB CUDA build.
    assert install[0] == f"python -m pip install torch=={_pins('constraints.txt')['torch']}"
    assert "-c constraints.txt" in install[1]


def test_make_test_and_demo_run_the_readme_commands_after_the_set_up():
    setup = _make_would_run("setup")
    (readme_test,) = _bash_blocks("Tests")
    assert _make_would_run("test") == setup + [readme_test]
    demo = _make_would_run("demo")
    assert demo[:-2] == setup and demo[-2].endswith(TITLE_COMMAND)
    assert _bash_blocks("GRPO recipe")[0] == TITLE_COMMAND
    # ...then the summary line and the curve, from the run's output_dir, as README's What next says.
    assert demo[-1] == "python recipes/plot_rewards.py runs/grpo/trainer_state.json runs/grpo/reward_curve.png"
    assert demo[-1].removeprefix("python ") in " ".join(_section("What next").split())


def test_make_runs_its_commands_inside_the_venv():
    """`python`, `accelerate` and `pytest` in a recipe are the venv's, not whatever is on PATH."""
    out = subprocess.run(
        ["make", "-s", "--eval", "show-path: ; @echo $$PATH", "show-path"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split(":")[0] == str(ROOT / ".venv" / "bin")


def test_make_quality_runs_ruff_and_mypy_pinned():
    assert _make_would_run("quality")[-3:] == ["ruff check .", "ruff format --check .", "mypy"]
    assert {"ruff", "mypy"} <= set(_pins("constraints.txt"))


def test_the_ranges_start_at_the_tested_pins():
    """A lower bound is a version some CI stack tests (to the precision it is written), never an
    older one, and every stack's pins are inside the ranges."""
    stacks = [_pins("constraints.txt")] + [_pins(f"stacks/{s}.txt") for s in STACKS]
    for requirement in _requirements():
        pins = [stack[requirement.name.lower()] for stack in stacks if requirement.name.lower() in stack]
        assert all(requirement.specifier.contains(pin) for pin in pins), (requirement, pins)
        (lower,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        assert any(lower.release == pin.release[: len(lower.release)] for pin in pins), (requirement, pins)


def test_torch_is_the_series_the_plugin_tables():
    """setup.cfg allows exactly the series compat/fsdp2.py tables, and CI tests each of them."""
    (torch,) = [r for r in _requirements() if r.name == "torch"]
    major, minor = map(int, TESTED_TORCH[-1].split("."))
    assert str(torch.specifier) == f"<{major}.{minor + 1},>={TESTED_TORCH[0]}"
    pinned = [_pins("constraints.txt")["torch"]] + [_pins(f"stacks/{s}.txt")["torch"] for s in STACKS]
    assert all(is_tested_torch(str(pin)) for pin in pinned)
    assert {f"{p.major}.{p.minor}" for p in pinned} == set(TESTED_TORCH)


DOCS = [
    "README.md",
    "docs/modes.md",
    "docs/recipe.md",
    "docs/estimate.md",
    "docs/install.md",
    "docs/architecture.md",
    "docs/performance.md",
]
REPO_PATH = re.compile(
    r"`((?:accel_gradsync|recipes|accelerate_configs|benchmarks|testbed|tests|docs|examples)/[\w./-]*)"
)


def test_docs_name_only_paths_and_modules_that_exist():
    """A file, folder or `accel_gradsync.<module>.<name>` the docs name in backticks exists (a
    module moved into its layer leaves no stale path behind)."""
    import importlib

    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for path in REPO_PATH.findall(text):
            assert (ROOT / path).exists(), f"{doc} names {path}"
        for dotted in re.findall(r"`(accel_gradsync(?:\.\w+)+)", text):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable module, then its attributes
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    assert hasattr(obj, attribute), f"{doc} names {dotted}"
                    obj = getattr(obj, attribute)
                break
