"""picollama's support code (config, runs, device, cli, optim, metrics, budget, fast inference,
conversion) and, in `picollama.lab`, the length-extrapolation study and the benchmarks."""

import os
from pathlib import Path

# the checkout: configs/, data/ and the caches live here
REPO_ROOT = Path(__file__).resolve().parent.parent
# Inductor's compiled kernels in the project's cache, not /tmp (a TORCHINDUCTOR_CACHE_DIR given
# wins): torch fixes the directory at its first use, which a model built on the meta device can be
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
