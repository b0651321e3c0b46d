from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "results"


def pytest_collection_modifyitems(items):
    # Tests that break the stack (stopping vLLM) run after every other test.
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)


def pytest_configure(config):
    config.addinivalue_line("markers", "destructive: breaks the shared stack; runs last")


@pytest.fixture(scope="session")
def stack(request, tmp_path_factory):
    from stack import Stack

    stack = Stack(tmp_path_factory.mktemp("stack"))
    failures_before = request.session.testsfailed
    try:
        stack.start()
    except Exception:
        save_diagnostics(stack, "start")
        stack.stop()
        raise
    yield stack
    if request.session.testsfailed > failures_before:
        save_diagnostics(stack, "failed")
    stack.stop()


def save_diagnostics(stack, reason: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{stack.project}-{reason}.log"
    text = stack.diagnostics()
    path.write_text(text)
    tail = "\n".join(text.splitlines()[-60:])
    print(f"\n[stack diagnostics saved to {path}]\n{tail}")
