"""An import's weights in block_ops.cpp's tiles, kept beside the import so a load skips rounding.

Rounding SmolLM2-135M's float32 weights into Q4_1 tiles again took 0.6 s of a 2.5 s chat
start-up on a Zen 5 core. The first load of an imported run saves the tiles in its cache folder.
Later loads read them back. Only imports (convert/cache.py's folder, ours to write) keep tiles.
A run trained here is the user's folder, and its loads round as before. This module knows the
tiles as tensors only: block_linear.py makes and reads them."""

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from model import Transformer
from picollama.cli.outputs import atomic_output
from picollama.kernels.block_linear import BlockLinear
from picollama.kernels.quantize import quantize

LAYOUT = 1  # block_ops.cpp's tile layout. A change to it makes older saved tiles stale.


def quantize_kept(model: Transformer, mode: str, output: str | None, run: Path) -> Transformer:
    """quantize(model, mode, output), the block layers read from `run`'s saved tiles where an
    import has them, and saved there after rounding where it has none."""
    from picollama.convert.cache import folder

    if not Path(run).resolve().is_relative_to(folder().resolve()):
        return quantize(model, mode, output)
    path = Path(run) / f"tiles-{mode}-{output or 'default'}.safetensors"
    try:
        kept = read_tiles(path, model)
    except Exception:  # noqa: BLE001 - a damaged cache file: round again and replace it
        kept = False
    model = quantize(model, mode, output)  # Rounds only the layers still nn.Linear.
    if not kept:
        save_tiles(path, model)
    return model


def read_tiles(path: Path, model: Transformer) -> bool:
    """Put the saved tiles at `path` in place of model's linear layers: whether there were any."""
    if not path.is_file():
        return False
    with safe_open(path, "pt") as tiles:
        shapes = json.loads(tiles.metadata().get("out_features", "{}"))
        if tiles.metadata().get("layout") != str(LAYOUT) or not shapes:
            return False
        for name, out_features in shapes.items():
            parent, _, child = name.rpartition(".")
            levels, scales = (tiles.get_tensor(f"{name}.{part}") for part in ("levels", "scales"))
            setattr(model.get_submodule(parent), child, BlockLinear(levels, scales, out_features))
    return True


def save_tiles(path: Path, model: Transformer):
    """Save every BlockLinear's tiles of model at `path`, written whole or not at all."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
    if not layers:
        return
    tensors = {
        f"{n}.{part}": getattr(m, part) for n, m in layers.items() for part in ("levels", "scales")
    }
    shapes = {name: layer.out_features for name, layer in layers.items()}
    metadata = {"layout": str(LAYOUT), "out_features": json.dumps(shapes)}
    try:
        with atomic_output(path) as tmp:
            save_file(tensors, tmp, metadata=metadata)
    except Exception:  # noqa: BLE001 - a cache: a load that cannot save still runs
        pass
