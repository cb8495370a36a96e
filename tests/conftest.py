import os

os.environ.setdefault("ONDECK_PROGRESS", "0")

import tempfile  # noqa: E402

# Activation profiles and the embedded default go to a throwaway cache, not the user's.
os.environ.setdefault("ONDECK_CACHE", tempfile.mkdtemp(prefix="ondeck-test-cache-"))
