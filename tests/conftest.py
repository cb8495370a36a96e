import os

os.environ.setdefault("ONDECK_PROGRESS", "0")
# One thread per torch op: the tests' tensors are tiny, and torch's default of a thread
# per core spins waiting for busy cores (on a 2-core machine running other jobs, the
# suite ran several times slower). Set before torch is imported; reading processes and
# torchrun workers inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Activation profiles and the embedded default go to a throwaway cache, not the user's,
# removed when the run ends.
if "ONDECK_CACHE" not in os.environ:
    os.environ["ONDECK_CACHE"] = tempfile.mkdtemp(prefix="ondeck-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ONDECK_CACHE"], ignore_errors=True)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def collector_unfrozen():
    """A command run in the test process (`ondeck generate --runs 2`, `ondeck serve`)
    freezes what lives out of garbage collection, as it does in a process of its own: the
    next test finds the collector as the test process had it."""
    yield
    gc.unfreeze()
