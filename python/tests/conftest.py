"""Seeds: every test draws fresh random inputs from one seed, printed in the session header and
on failure. Reproduce a run with MJOLNIR_TEST_SEED=<seed> pytest python/tests."""

import os
import random
import zlib

import pytest
import torch

SEED = int(os.environ.get("MJOLNIR_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))


def pytest_report_header(config):
    return f"mjolnir test seed: {SEED} (set MJOLNIR_TEST_SEED={SEED} to reproduce)"


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from SEED and the test's id, so each case differs but reproduces."""
    name = request.node.nodeid
    g = torch.Generator().manual_seed((SEED * 1000003 + zlib.crc32(name.encode())) % 2**63)
    return g


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.when == "call":
        item.add_report_section("call", "seed", f"MJOLNIR_TEST_SEED={SEED}")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"mjolnir test seed: {SEED} (MJOLNIR_TEST_SEED={SEED} repeats it)")
