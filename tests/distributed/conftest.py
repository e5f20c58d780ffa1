import sys
from pathlib import Path

# The workers and the launcher import each other as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "workers"))
