"""How the thin scripts in scripts/ and benchmarks/ start: with only the standard library, so a plain
`python3 scripts/x.py` works on a host whose Python lacks the package's dependencies.

If the running Python cannot import them, the script runs again under the repo's .venv (made by
scripts/install-tools.sh); with no .venv either, it says so in one line and exits 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from llmstack import REPO_ROOT

REQUIRED_MODULES = ("prometheus_client", "requests", "yaml")
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"


def missing_modules() -> list[str]:
    return [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]


def run_module(module: str, prog: str) -> None:
    """Run `module.main` as the program `prog` under the CLI conventions (llmstack.cli)."""
    missing = missing_modules()
    if missing:
        in_venv = Path(sys.prefix).resolve() == VENV_PYTHON.parent.parent.resolve()
        if VENV_PYTHON.exists() and not in_venv:
            os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), sys.argv[0], *sys.argv[1:]])
        print(
            f"{prog}: error: Python modules missing ({', '.join(missing)}); run scripts/install-tools.sh "
            f"(makes .venv) or: pip install -e . -c constraints.txt",
            file=sys.stderr,
        )
        sys.exit(2)
    from llmstack.cli import main_exit

    main_exit(prog, importlib.import_module(module).main)
