"""picollama's support code, in layers. A package imports only from the layers below it.

From the bottom up: cli (flags, errors, outputs), components (parts that plug into model.py),
config, and the shared modules here (device, run files, chat templates). Then convert, sampling,
training and serve. The lab (the study and the benchmarks) sits on top."""

import os
from pathlib import Path

# The checkout. configs/, data/ and the caches live here.
REPO_ROOT = Path(__file__).resolve().parent.parent
# Inductor's compiled kernels go in the project's cache, not /tmp. A TORCHINDUCTOR_CACHE_DIR the
# user gives wins. torch fixes the directory at its first use, so it is set at import.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
