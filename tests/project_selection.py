"""A pytest plugin for the rendered projects' suites in the pairwise cover (test_project_suite.py
loads it with `-p project_selection`): the tests that are the same whatever the options (the
fault tests, those that train tasks of their own and those of modules no option changes) never
run, the other single-process tests always do, and of the multi-process tests only those under
the node ids given with `--multi-process-from` (a test, or a whole module)."""

from __future__ import annotations

import pytest

#: Tests that are the same in every project: the default project runs them.
ONCE = ("faults", "own_tasks", "standalone")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--multi-process-from",
        action="append",
        default=[],
        metavar="NODE_ID",
        help="run the multi-process tests of this test or module too",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.getoption("multi_process_from")

    def wanted(item: pytest.Item) -> bool:
        if any(item.get_closest_marker(name) for name in ONCE):
            return False
        if not item.get_closest_marker("distributed"):
            return True
        return any(item.nodeid == node or item.nodeid.startswith(f"{node}::") for node in chosen)

    deselected = [item for item in items if not wanted(item)]
    config.hook.pytest_deselected(items=deselected)
    items[:] = [item for item in items if wanted(item)]
