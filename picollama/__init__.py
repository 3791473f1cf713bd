"""picollama's support code (config, runs, device, cli, optim, metrics, budget, fast inference,
conversion) and, in `picollama.lab`, the length-extrapolation study and the benchmarks."""

from pathlib import Path

# the checkout: configs/, data/ and the caches live here
REPO_ROOT = Path(__file__).resolve().parent.parent
