import os
from collections.abc import Iterator

import pytest
import torch

# Two cores on CI: keep torch from oversubscribing when pytest runs alongside other work.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("MPLBACKEND", "Agg")
# With the compiled kernels built (the README's install), `auto` would time them against SDPA once
# per process and choose by the clock; the suite pins that choice to SDPA's side so that tests of
# auto's policy do not depend on the machine's load (tests/functional/backends/test_native_window.py
# runs the measured mode itself). Requests only tiled serves still run the kernels.
os.environ.setdefault("ATTNZOO_NATIVE_AUTO", "sdpa")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For modules of tiny models: one thread avoids OpenMP spin-waiting on a busy machine.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``; the setting is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
