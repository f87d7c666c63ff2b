"""Test order: the long runs first.

Under `pytest -n 2 --dist loadgroup --no-loadscope-reorder` (`make test`), each worker takes the
next group of tests in this order as it gets free. The launcher tests (a Slurm cluster, real
training) and the rendered projects' suites take minutes each; started first, they run side
by side, and the many short checks fill in the end, so that both workers finish together.
"""

from __future__ import annotations

import pytest

#: Modules of minutes-long tests, longest first; the others follow in their usual order.
LONG_FIRST = ["test_launchers.py", "test_project_suite.py", "test_update.py", "test_user_tasks.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)
