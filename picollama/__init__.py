"""picollama's package. The sub-packages, lowest layer first: cli (flags, errors, outputs),
components (what plugs into model.py), config, then the shared leaves here (device, run files,
chat templates), convert, sampling, training, serve, and the lab (the study and the benchmarks).
A package imports only from the layers below it."""

import os
from pathlib import Path

# the checkout: configs/, data/ and the caches live here
REPO_ROOT = Path(__file__).resolve().parent.parent
# Inductor's compiled kernels go in the project's cache, not /tmp. A TORCHINDUCTOR_CACHE_DIR the
# user gives wins. torch fixes the directory at its first use, so it is set at import.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
