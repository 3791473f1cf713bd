"""The lean one-token decode step built from a trained Transformer at load time (`DecodeStep`:
fused projections, a real-valued RoPE table, compiled ahead of time by AOTInductor on request)."""

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
from picollama.sampling.caches import Int8KVCache, quantize_rows
from picollama.sampling.decode_ops import cpu_isa, decode_ops
from picollama.sampling.quantize import Concatenated, Int4Linear, Int8Linear, Int8RowDot

# Inductor options for the compiled decode step (DecodeStep.compile_step): the weights stay out of
# the package (the step reads the model's own); realize_acc_reads_threshold=1 stores point-wise
# results that read more than one buffer instead of inlining them into their readers: 2.3-2.4
# against 2.5-2.7 ms a step on 2 AVX2 cores (measured with torch.compile). Where the compiled step
# is slower than eager, pick_step keeps eager.
COMPILE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "realize_acc_reads_threshold": 1}


class RowDot(nn.Module):
    """A bias-free linear layer for compiled CPU decode steps: each output is a reduction over its
    contiguous weight row (out, in), so Inductor writes the loop itself, vectorized and split over
    the threads, where F.linear calls MKL's sgemv, which stays on one core (a step's matrix-vector
    products: 1.0-1.2 ms on 2 AVX2 cores, against 2.2-3.3 ms through MKL). Eager it would
    materialize x·w: it is for compiled steps only."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:  # a batch: a matrix product (fixed when the step is compiled)
            return F.linear(x, self.weight)
        return (x.unsqueeze(-2) * self.weight).sum(-1)


def stored_transposed(weight: torch.Tensor) -> torch.Tensor:
    """A dense weight (out, in) as a view of an (in, out) contiguous copy where it lives on the CPU:
    at batch 1, MKL then streams W^T's rows for x @ W^T, 1.3-1.5x faster than reading W's rows (the
    matrix-vector products of a decode step: 2.2 against 3.3 ms on one AVX2 core)."""
    cpu_dense = weight.device.type == "cpu" and weight.is_floating_point()
    return weight.t().contiguous().t() if cpu_dense and not weight.t().is_contiguous() else weight


def dense(weight: torch.Tensor, rows: bool) -> nn.Module:
    """A bias-free linear layer on weight (out, in): a RowDot where `rows` (a compiled step) and on
    the CPU, else an nn.Linear on the weight stored_transposed."""
    if rows and weight.device.type == "cpu":
        return RowDot(weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(stored_transposed(weight.detach()), requires_grad=False)
    return linear


def projection(layers: list[nn.Module], rows: bool) -> tuple[nn.Module, list]:
    """One layer computing the outputs of `layers` (which read the same input) concatenated, on its
    own copy of their weights in the layout its product reads fastest: int8 as it is, dense weights
    as dense(rows) lays them out. And [(layer, name, view)]: each layer's tensors as views of that
    copy, for DecodeStep.share_weights. Int4 layers are kept as they are (Concatenated)."""
    if isinstance(layers[0], Int4Linear):
        return Concatenated(layers), []
    int8 = isinstance(layers[0], Int8Linear)
    names = ("weight", "scale") if int8 else ("weight",)
    tensors = {
        name: torch.cat([getattr(layer, name).detach() for layer in layers]) for name in names
    }
    if int8:
        kind = Int8RowDot if rows and tensors["weight"].device.type == "cpu" else Int8Linear
        fused = kind(tensors["weight"], tensors["scale"])
    else:
        fused = dense(tensors["weight"], rows)
    views = []
    start = 0
    for layer in layers:
        span = slice(start, start + layer.weight.shape[0])
        views += [(layer, name, getattr(fused, name).detach()[span]) for name in names]
        start = span.stop
    return fused, views


class FusedBlock(nn.Module):
    """A TransformerBlock for one token per row, wq/wk/wv one matrix and w1/w3 one (projection): the
    block's own norms, RoPE (model.apply_rotary), attention function and FFN activation, on the
    fused weights."""

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
        # a compiled CPU step attends with decode_ops.cpp where it builds
        ops = decode_ops() if rows and cpu and fits else None
        self.attend = ops.decode_attention if ops is not None else None

    def forward(self, x, pos, rotation, k_cache, v_cache, k_scale=None, v_scale=None):
        """x (B, dim) at position pos (an int, every row's; or a (B,) tensor, each row's own),
        turned by RoPE's rotation of pos ((pairs, 2), or (B, pairs, 2)); k_scale, v_scale: an
        Int8KVCache's (its keys and values int8), else None."""
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
        """Write each row's k, v (B, kv heads, head_dim) into the caches at its position and
        attend its queries q to its keys up to there."""
        batch = q.shape[0]
        shared = not isinstance(pos, torch.Tensor)  # an int (a SymInt when exported)
        if shared:  # a slice, not [pos]: one compiled graph for every pos
            at = (slice(0, batch), slice(None), slice(pos, pos + 1))
            k, v = k.unsqueeze(2), v.unsqueeze(2)
        else:
            at = (torch.arange(batch, device=pos.device), slice(None), pos)
        if k_scale is None:
            k_cache[at], v_cache[at] = k, v
        else:
            k_cache[at], k_scale[at] = quantize_rows(k)
            v_cache[at], v_scale[at] = quantize_rows(v)
        lengths = None if shared else pos + 1
        if self.attend is not None:
            length = pos + 1 if shared else 1  # (unused with lengths)
            return self.attend(q, k_cache, v_cache, length, k_scale, v_scale, lengths)
        end = pos + 1 if shared else None  # rows of their own lengths: every position, masked
        keys, values = k_cache[:batch, :, :end], v_cache[:batch, :, :end]
        if k_scale is not None:
            keys = keys * k_scale[:batch, :, :end, None]
            values = values * v_scale[:batch, :, :end, None]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # another cache dtype (kv_dtype)
        mask = None
        if lengths is not None:
            mask = torch.arange(keys.shape[2], device=q.device) < lengths[:, None, None, None]
        # sdpa_attention reads nothing of its module (None)
        return sdpa_attention(q.unsqueeze(2), keys, values, None, mask)


def cache_tensors(cache: KVCache) -> tuple:
    """What a step reads and writes of a layer's KV cache: keys and values, and an Int8KVCache's
    scales."""
    if isinstance(cache, Int8KVCache):
        return cache.k, cache.v, cache.k_scale, cache.v_scale
    return cache.k, cache.v


class DecodeStep(nn.Module):
    """`model(tokens, start_pos=pos)` for one token per row, tokens (B, 1), built for speed at batch
    1: wq/wk/wv and w1/w3 fused, RoPE from the model's table, reading and writing the model's KV
    cache (set up by the caller). Logits (B, 1, vocab), equal to the model's within float rounding.
    Built for model.args as they are (RoPE scaling included). The model's linear layers are pointed
    at the step's weights, so no weight is stored twice. threads: torch's thread count while it runs
    (None: as set; a compiled step keeps the count it was compiled with). compiled: the step
    compiled ahead of time into one C++ library at its first call with each batch size, its
    matrix-vector products RowDots on the CPU (see compile_step), attending with
    decode_ops.cpp. kv_dtype: the KV cache's dtype for generate() (bf16 halves what a long
    cache reads a step, int8 quarters it; None: the activations')."""

    def __init__(
        self,
        model: Transformer,
        threads: int | None = None,
        compiled: bool = False,
        kv_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.threads = threads
        self.kv_dtype = kv_dtype  # the KV cache generate() sets up for it (None: activations')
        # ("shared" or "rows" positions, batch, cache batch) -> its step compiled (compile_step)
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
        ]  # generation sets their caches
        self.tok_embeddings = model.tok_embeddings
        self.pos_embeddings = model.pos_embeddings
        self.norm = model.norm
        self.layers = nn.ModuleList(FusedBlock(block, compiled) for block in model.layers)
        self.shared = [view for layer in self.layers for view in layer.shared]
        tied = getattr(model.output, "weight", None) is model.tok_embeddings.weight
        if tied:  # kept shared, as laid out
            self.output = dense(model.output.weight, rows=True) if compiled else model.output
        else:
            self.output, views = projection([model.output], compiled)
            self.shared += views
        self.share_weights()
        self.args = model.args
        self.tables(model.args.max_seq_len)

    def tables(self, length: int):
        """RoPE's rotations (the model's table) and the positions as 0-d tensors (for a compiled
        step), for `length` positions."""
        device = self.tok_embeddings.weight.device
        table = self.pos_embeddings.rotations(self.args, length, device)
        self.rotations = torch.view_as_real(table)  # real: what a compiled step takes
        # an inference tensor would be a new kind of input to a compiled step
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
        """Logits (B, vocab) of ids (B,), each row at its own position (B,) within the model's
        context, reading and writing `caches` (each layer's cache_tensors, batch >= B): the step
        of continuous batching, where rows join and leave between steps."""
        rotation = self.rotations[positions]
        if self.compiled is None:
            with self.own_threads():
                return self.step(ids, positions, rotation, caches)
        return self.run_compiled(_RowPositions, [ids, positions, rotation], caches)

    @contextmanager
    def own_threads(self):
        """torch's thread count set to self.threads while the step runs (~0.3 µs a change)."""
        threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def run_compiled(self, wrapper, inputs: list, caches: list[tuple]) -> torch.Tensor:
        """The step compiled (compile_step) for this wrapper, batch and cache batch, on inputs and
        the caches' tensors."""
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
        """self.step in `wrapper` (_PositionAsTensor or _RowPositions) compiled ahead of time by
        AOTInductor (torch.export, then one C++ library) for these inputs' batch and the caches'
        batch, every cache length and position: called from C++ with no guards to check, where a
        torch.compile'd step spent ~0.3 ms a call in dynamo's frame on 2 AVX2 cores. The library
        reads the weights where they are (user-managed constants, not a copy). It takes [*inputs,
        then each layer's cache tensors] and returns [logits]."""
        length = torch.export.Dim("cache_length", min=2, max=1 << 24)
        dims = [tuple({2: length} for _ in cache) for cache in caches]
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # torch's own use of its pytree API
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            # copies to trace with: export cannot write into inference tensors through an index
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
        # The library's own entry on flat inputs: calling the runner re-parses its input spec
        # from JSON and flattens the arguments, ~0.08 ms a call on an AVX2 core (a tenth of an
        # int8 step).
        return runner.loader.boxed_run


def compiled_package(program: torch.export.ExportedProgram, device: torch.device) -> Path:
    """The AOTInductor package of `program` (weights left out), compiled once (~20-30 s on 2 cores)
    and kept in Inductor's cache folder, keyed by the program's printed graph (shapes and
    operations, not weight values), the device, this CPU's ISA class, the thread count (Inductor
    writes no parallel loops for one), torch's version and the options."""
    key = f"{program}|{device}|{cpu_isa()}|{torch.get_num_threads()}|{torch.__version__}"
    key += f"|{COMPILE_OPTIONS}"
    name = f"{hashlib.sha256(key.encode()).hexdigest()}.pt2"
    path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "aoti" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp, open(tmp, "wb") as out:
            options = dict(COMPILE_OPTIONS)  # a copy: it adds its own
            torch._inductor.aoti_compile_and_package(
                program, package_path=out, inductor_configs=options
            )
    return path


class _PositionAsTensor(nn.Module):
    """A DecodeStep's step with the position as a 0-d tensor: what torch.export can keep dynamic."""

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
    """A DecodeStep's step with a position a row (B,), for DecodeStep.rows."""

    positions = "rows"

    @staticmethod
    def example(decode: DecodeStep, inputs: list) -> list:
        return inputs

    def forward(self, ids, positions, rotation, caches):
        return self.decode.step(ids, positions, rotation, caches)
