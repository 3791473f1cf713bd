"""The lean one-token decode step, built from a trained Transformer at load time.

DecodeStep fuses the projections and uses a real-valued RoPE table. On request, AOTInductor
compiles it ahead of time. It only computes logits. Callers set up the caches and pick tokens."""

import hashlib
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from model import KVCache, Transformer, apply_rotary, sdpa_attention
from picollama.cli.outputs import atomic_output
from picollama.components.length import length_dependent
from picollama.components.variants import non_llama
from picollama.kernels.block_linear import BlockLinear
from picollama.kernels.caches import Int8KVCache, quantize_rows
from picollama.kernels.decode_ops import cpu_isa, decode_ops
from picollama.kernels.float_linear import FloatLinear
from picollama.kernels.quantize import Concatenated, Int4Linear, Int8Linear, Int8RowDot

# Inductor options for the compiled decode step (DecodeStep.compile_step). The weights stay out
# of the package, since the step reads the model's own. Setting realize_acc_reads_threshold=1
# stores point-wise results that read more than one buffer, rather than inline them in readers.
# That took 2.3-2.4 ms a step, against 2.5-2.7 ms, on 2 AVX2 cores (measured with torch.compile).
# Where the compiled step is slower than eager, pick_step keeps eager.
COMPILE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "realize_acc_reads_threshold": 1}
# The KV-cache dtypes decode_ops.cpp reads. A cache of another dtype attends with SDPA, so a new
# --kv-cache dtype (caches.py's KV_CACHES) needs no C++.
OPS_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


class RowDot(nn.Module):
    """A bias-free linear layer for compiled CPU decode steps.

    Each output is a reduction over its contiguous weight row (out, in). So Inductor writes the
    loop itself, vectorized and split over the threads. F.linear would call MKL's sgemv, which
    stays on one core. A step's matrix-vector products took 1.0-1.2 ms on 2 AVX2 cores, against
    2.2-3.3 ms through MKL. Run eagerly it would materialize x·w, so it is for compiled steps."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:  # A batch is a matrix product. Compiling fixes the branch.
            return F.linear(x, self.weight)
        return (x.unsqueeze(-2) * self.weight).sum(-1)


def stored_transposed(weight: torch.Tensor) -> torch.Tensor:
    """A dense CPU weight (out, in) as a view of an (in, out) contiguous copy.

    At batch 1, MKL then streams W^T's rows for x @ W^T. That is 1.3-1.5x faster than reading W's
    rows. A decode step's matrix-vector products took 2.2 against 3.3 ms on one AVX2 core."""
    cpu_dense = weight.device.type == "cpu" and weight.is_floating_point()
    return weight.t().contiguous().t() if cpu_dense and not weight.t().is_contiguous() else weight


def dense(weight: torch.Tensor, rows: bool) -> nn.Module:
    """A bias-free linear layer on weight (out, in).

    On the CPU with `rows` (a compiled step) it is a RowDot. Otherwise it is an nn.Linear on the
    weight stored_transposed."""
    if rows and weight.device.type == "cpu":
        return RowDot(weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(stored_transposed(weight.detach()), requires_grad=False)
    return linear


def projection(layers: list[nn.Module], rows: bool) -> tuple[nn.Module, list]:
    """One layer computing the concatenated outputs of `layers`, which read the same input.

    It holds its own copy of their weights, laid out as its product reads fastest. Int8, block
    and FloatLinear weights keep their layout (BlockLinear.joined, FloatLinear.joined), and dense
    ones take dense(rows)'s. Int4 layers, and block ones that cannot join, stay as they are
    (Concatenated). Also returns [(layer, name, view)] for DecodeStep.share_weights. These are
    each layer's tensors as views of the copy."""
    block = isinstance(layers[0], BlockLinear)
    own = block or isinstance(layers[0], FloatLinear)  # Our kernels, which join their layers.
    fused = type(layers[0]).joined(layers) if own else None
    if isinstance(layers[0], Int4Linear) or (own and fused is None):
        return Concatenated(layers), []
    int8 = isinstance(layers[0], Int8Linear)
    names = ("levels", "scales") if block else ("weight", "scale") if int8 else ("weight",)
    if not own:
        tensors = {
            name: torch.cat([getattr(layer, name).detach() for layer in layers]) for name in names
        }
        weight = tensors["weight"]
        kind = Int8RowDot if rows and weight.device.type == "cpu" else Int8Linear
        fused = kind(weight, tensors["scale"]) if int8 else dense(weight, rows)
    views = []
    start = 0
    for layer in layers:
        span = slice(start, start + getattr(layer, names[0]).shape[0])
        views += [(layer, name, getattr(fused, name).detach()[span]) for name in names]
        start = span.stop
    return fused, views


class FusedBlock(nn.Module):
    """A TransformerBlock for one token per row, on fused weights.

    wq/wk/wv become one matrix and w1/w3 another (see projection). The block keeps its own norms,
    RoPE (model.apply_rotary), attention function and FFN activation."""

    def __init__(self, block, rows: bool):
        super().__init__()
        attention = block.attention
        self.heads = attention.n_heads
        self.kv_heads = attention.n_kv_heads
        self.head_dim = attention.head_dim
        self.wqkv, qkv = projection([attention.wq, attention.wk, attention.wv], rows)
        self.wo, o = projection([attention.wo], rows)
        self.w13, w13 = projection([block.feed_forward.w1, block.feed_forward.w3], rows)
        self.w2, w2 = projection([block.feed_forward.w2], rows)
        self.shared = qkv + o + w13 + w2
        self.attention_norm = block.attention_norm
        self.ffn_norm = block.ffn_norm
        self.act = block.feed_forward.act
        cpu = block.attention_norm.weight.device.type == "cpu"
        fits = self.head_dim % 16 == 0 and self.head_dim <= 128 and self.heads // self.kv_heads <= 8
        # A CPU step attends with decode_ops.cpp, where that builds: 5-12 us a call against
        # SDPA's 11-32 us over 16-500 positions (SmolLM2's heads, 2 Zen 5 cores). An eager step
        # does so in float32 only. In bf16 SDPA rounds as the model's own attention does.
        ops = decode_ops() if cpu and fits else None
        self.attend = ops.decode_attention if ops is not None else None
        self.any_dtype = rows  # A compiled step attends with decode_ops.cpp in bf16 too.

    def forward(self, x, pos, rotation, k_cache, v_cache, k_scale=None, v_scale=None):
        """x (B, dim) at position pos, turned by RoPE's rotation of pos.

        The position is an int for every row, or a (B,) tensor of each row's own. The rotation is
        (pairs, 2) or (B, pairs, 2). With an Int8KVCache, k_scale and v_scale are its scales."""
        batch = x.shape[0]
        heads = self.heads
        kv_heads = self.kv_heads
        qkv = self.wqkv(self.attention_norm(x)).view(batch, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split((heads + kv_heads, kv_heads), 1)
        q, k = apply_rotary(qk, rotation).split((heads, kv_heads), 1)
        out = self.cached_attention(q, k, v, pos, k_cache, v_cache, k_scale, v_scale)
        x = x + self.wo(out.type_as(x).view(batch, -1))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, -1)
        return x + self.w2(self.act(gate) * up)

    def cached_attention(self, q, k, v, pos, k_cache, v_cache, k_scale, v_scale):
        """Write each row's k, v (B, kv heads, head_dim) into the caches at its position.

        Then attend its queries q to its keys up to there."""
        batch = q.shape[0]
        shared = not isinstance(pos, torch.Tensor)  # An int, or a SymInt when exported.
        if shared:  # A slice, not [pos], so one compiled graph serves every pos.
            at = (slice(0, batch), slice(None), slice(pos, pos + 1))
            k, v = k.unsqueeze(2), v.unsqueeze(2)
        else:
            at = (torch.arange(batch, device=pos.device), slice(None), pos)
        if k_scale is None:  # Cast: a row's index_put takes only the cache's own dtype.
            k_cache[at], v_cache[at] = k.to(k_cache.dtype), v.to(v_cache.dtype)
        else:
            k_cache[at], k_scale[at] = quantize_rows(k)
            v_cache[at], v_scale[at] = quantize_rows(v)
        lengths = None if shared else pos + 1
        ours = self.any_dtype or q.dtype == torch.float32
        if self.attend is not None and k_cache.dtype in OPS_CACHE_DTYPES and ours:
            length = pos + 1 if shared else 1  # Unused when lengths is given.
            return self.attend(q, k_cache, v_cache, length, k_scale, v_scale, lengths)
        end = pos + 1 if shared else None  # Rows of their own lengths read every position, masked.
        keys, values = k_cache[:batch, :, :end], v_cache[:batch, :, :end]
        if k_scale is not None:
            keys = keys * k_scale[:batch, :, :end, None]
            values = values * v_scale[:batch, :, :end, None]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # The cache may differ (kv_dtype).
        mask = None
        if lengths is not None:
            mask = torch.arange(keys.shape[2], device=q.device) < lengths[:, None, None, None]
        # sdpa_attention does not read its module argument, so None will do.
        return sdpa_attention(q.unsqueeze(2), keys, values, None, mask)


CACHE_NAMES = ("k", "v", "k_scale", "v_scale")  # cache_tensors' order


def cache_tensors(cache: KVCache) -> tuple:
    """What a step reads and writes of a layer's KV cache: keys and values, and an Int8KVCache's
    scales."""
    names = CACHE_NAMES if isinstance(cache, Int8KVCache) else CACHE_NAMES[:2]
    return tuple(getattr(cache, name) for name in names)


class DecodeStep(nn.Module):
    """`model(tokens, start_pos=pos)` for one token per row, built for speed at batch 1.

    Tokens are (B, 1). It fuses wq/wk/wv and w1/w3 and takes RoPE from the model's table. It reads
    and writes the model's KV cache, which the caller sets up. Its logits (B, 1, vocab) equal the
    model's within float rounding. It follows model.args as they are, RoPE scaling included. The
    model's linear layers point at the step's weights, so no weight is stored twice.

    threads: torch's thread count while it runs. None keeps the count as set. A compiled step
    keeps the count it was compiled with.
    compiled: compile the step into one C++ library at its first call with each batch size.
    On the CPU its products are then RowDots. A CPU step attends with decode_ops.cpp either way.
    kv_dtype: the KV cache's dtype for generate(). None means the activations'. bf16 halves
    what a long cache reads a step, and int8 quarters it."""

    def __init__(
        self,
        model: Transformer,
        threads: int | None = None,
        compiled: bool = False,
        kv_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.threads = threads
        self.kv_dtype = kv_dtype  # For the cache generate() sets up. None: the activations'.
        # Maps ("shared" or "rows", batch, cache batch) to the step compiled for it.
        self.compiled = {} if compiled else None
        if length_dependent(model.args):
            raise ValueError(
                "dynamic NTK rescales every cached position as the sequence grows: "
                "no fused decode step"
            )
        if non_llama(model.args):
            raise ValueError(
                "the fused decode step is LLaMA's: "
                "a model with other switches decodes with its forward"
            )
        self.attentions = [
            block.attention for block in model.layers
        ]  # Generation sets their caches.
        self.tok_embeddings = model.tok_embeddings
        self.pos_embeddings = model.pos_embeddings
        self.norm = model.norm
        self.layers = nn.ModuleList(FusedBlock(block, compiled) for block in model.layers)
        self.shared = [view for layer in self.layers for view in layer.shared]
        tied = getattr(model.output, "weight", None) is model.tok_embeddings.weight
        if tied:  # Kept shared, in its own layout.
            self.output = dense(model.output.weight, rows=True) if compiled else model.output
        else:
            self.output, views = projection([model.output], compiled)
            self.shared += views
        self.share_weights()
        self.args = model.args
        self.tables(model.args.max_seq_len)

    def tables(self, length: int):
        """RoPE's rotations from the model's table, and positions as 0-d tensors, for `length`.

        A compiled step takes its position as a tensor."""
        device = self.tok_embeddings.weight.device
        table = self.pos_embeddings.rotations(self.args, length, device)
        self.rotations = torch.view_as_real(table)  # Real-valued, as a compiled step takes it.
        # An inference tensor would be a new kind of input to a compiled step.
        with torch.inference_mode(False):
            self.positions = torch.arange(length, device=device)

    def share_weights(self):
        """Point the model's linear layers at this step's copies of their weights (views)."""
        for layer, name, view in self.shared:
            setattr(
                layer,
                name,
                nn.Parameter(view, requires_grad=False) if name in layer._parameters else view,
            )

    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        if start_pos >= len(self.rotations):
            self.tables(2 * start_pos)
        caches = [cache_tensors(attention.cache) for attention in self.attentions]
        ids, rotation = tokens[:, 0].contiguous(), self.rotations[start_pos]
        if self.compiled is None:
            with self.own_threads():
                return self.step(ids, start_pos, rotation, caches)[:, None]
        position = self.positions[start_pos]
        return self.run_compiled(_PositionAsTensor, [ids, position, rotation], caches)[:, None]

    def rows(self, ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple]):
        """Logits (B, vocab) of ids (B,), each row at its own position (B,) in the context.

        This is the step of continuous batching, where rows join and leave between steps. It
        reads and writes `caches`, each layer's cache_tensors with batch >= B."""
        rotation = self.rotations[positions]
        if self.compiled is None:
            with self.own_threads():
                return self.step(ids, positions, rotation, caches)
        return self.run_compiled(_RowPositions, [ids, positions, rotation], caches)

    @contextmanager
    def own_threads(self):
        """Set torch's thread count to self.threads while the step runs. A change costs ~0.3 µs."""
        threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def run_compiled(self, wrapper, inputs: list, caches: list[tuple]) -> torch.Tensor:
        """Run the step compiled for this wrapper, batch and cache batch (see compile_step)."""
        kind = (wrapper.positions, inputs[0].shape[0], caches[0][0].shape[0])
        if kind not in self.compiled:
            self.compiled[kind] = self.compile_step(wrapper, inputs, caches)
        with self.own_threads():
            return self.compiled[kind]([*inputs, *(t for cache in caches for t in cache)])[0]

    def step(self, ids, pos, rotation, caches):
        x = self.tok_embeddings(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, pos, rotation, *cache)
        return self.output(self.norm(x))

    def compile_step(self, wrapper, inputs: list, caches: list[tuple]):
        """Compile self.step in `wrapper` ahead of time with AOTInductor.

        The wrapper is _PositionAsTensor or _RowPositions. torch.export traces it and Inductor
        builds one C++ library. It fits these inputs' batch and cache batch, at every cache length
        and position. C++ calls it with no guards to check. A torch.compile'd step spent ~0.3 ms a
        call in dynamo's frame on 2 AVX2 cores. The library reads the weights in place, as
        user-managed constants. It takes [*inputs, then each layer's cache tensors] and returns
        [logits]."""
        length = torch.export.Dim("cache_length", min=2, max=1 << 24)
        dims = [tuple({2: length} for _ in cache) for cache in caches]
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # Torch warns about its own use of its pytree API.
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            # Trace with copies. Export cannot write into inference tensors through an index.
            examples = [t.clone() for t in wrapper.example(self, inputs)]
            caches = [tuple(t.clone() for t in cache) for cache in caches]
            program = torch.export.export(
                wrapper(self),
                (*examples, caches),
                strict=False,
                dynamic_shapes=(None, None, None, dims),
            )
            package = compiled_package(program, inputs[0].device)
            runner = torch._inductor.aoti_load_package(str(package))
        constants = program.state_dict | program.constants
        weights = {name: constants[name] for name in runner.get_constant_fqns()}
        runner.load_constants(weights, check_full_update=True, user_managed=True)
        # Use the library's own entry on flat inputs. Calling the runner re-parses its input spec
        # from JSON and flattens the arguments. That costs ~0.08 ms a call on an AVX2 core, a
        # tenth of an int8 step.
        return runner.loader.boxed_run


def compiled_package(program: torch.export.ExportedProgram, device: torch.device) -> Path:
    """The AOTInductor package of `program`, without weights, compiled once and cached.

    Compiling takes ~20-30 s on 2 cores. The package lives in Inductor's cache folder. Its key is
    the printed graph (shapes and operations, not weight values), the device and the CPU's ISA
    class. Torch's version, the options and the thread count are in it too. Inductor writes no
    parallel loops for one thread."""
    key = f"{program}|{device}|{cpu_isa()}|{torch.get_num_threads()}|{torch.__version__}"
    key += f"|{COMPILE_OPTIONS}"
    name = f"{hashlib.sha256(key.encode()).hexdigest()}.pt2"
    path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "aoti" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp, open(tmp, "wb") as out:
            options = dict(COMPILE_OPTIONS)  # A copy, since Inductor adds its own.
            torch._inductor.aoti_compile_and_package(
                program, package_path=out, inductor_configs=options
            )
    return path


class _PositionAsTensor(nn.Module):
    """A DecodeStep's step with the position as a 0-d tensor, which torch.export keeps dynamic."""

    positions = "shared"

    def __init__(self, decode: DecodeStep):
        super().__init__()
        self.decode = decode

    @staticmethod
    def example(decode: DecodeStep, inputs: list) -> list:
        """Inputs to export with: position 1, not 0 or 1 (which export would take as constants)."""
        ids, _, rotation = inputs
        return [ids, decode.positions[1], rotation]

    def forward(self, ids, pos, rotation, caches):
        pos = pos.item()
        torch._check(pos >= 0)
        torch._check(pos < caches[0][0].shape[2])
        return self.decode.step(ids, pos, rotation, caches)


class _RowPositions(_PositionAsTensor):
    """A DecodeStep's step with one position per row (B,), for DecodeStep.rows."""

    positions = "rows"

    @staticmethod
    def example(decode: DecodeStep, inputs: list) -> list:
        return inputs

    def forward(self, ids, positions, rotation, caches):
        return self.decode.step(ids, positions, rotation, caches)
