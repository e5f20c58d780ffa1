"""CI runs what the README tells a user to run: the install commands and the test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(section: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", body, re.S) for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install, tests = _bash_blocks("Install"), _bash_blocks("Tests")
    assert install and tests
    for command in install + tests:
        assert command in ci or command.replace("pip install", "pip install -q") in ci, command
    # torch first and pinned: anything else would let pip pull a multi-GB CUDA build.
    assert install[0] == "python -m pip install torch==2.13.0"
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
