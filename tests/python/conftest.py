"""Fixtures of the Python tests: a real daemon (the binary built by tests/run.sh, see
tests/daemon.py) on its host backend, on a private socket; its shared memory is memfds, counted
among its open fds. A failed test's report shows the log of every daemon it started.

tests/, tests/python/ and its folders are packages, so pytest puts the repository root on
``sys.path`` and names each test file by its path (``tests.python.torch.test_torch``): the
folder ``tests/python/torch`` never shadows the ``torch`` package."""

from __future__ import annotations

import sys

import pytest

from tests import daemon as daemons
from tests.daemon import Daemon


def pytest_configure(config):
    config.addinivalue_line("markers", "no_daemon: runs without the daemon binary")


#: Where this test's daemons begin in ``tests.daemon.STARTED``.
FIRST_DAEMON = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[FIRST_DAEMON] = len(daemons.STARTED)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report shows the logs of the daemons it started and of those still
    running (a module's shared daemon)."""
    report = yield
    if report.failed:
        first = item.stash.get(FIRST_DAEMON, 0)
        for i, d in enumerate(daemons.STARTED):
            if i >= first or d.proc.poll() is None:
                report.sections.append((f"daemon log ({d.log_path})", d.log_tail()))
    return report


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _fresh_ai_toolkit_settings():
    """ai-toolkit's ``MemoryManager`` reads its settings (the socket among them) from the
    environment once per process, as a trainer does; each test has its own daemon, so each test
    starts and ends without settings read by another."""
    yield
    settings = sys.modules.get("weightstream.integrations.ai_toolkit.settings")
    if settings is not None:
        settings.configure(None)
