import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "examples" / "gpt", Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
