"""Inference-only speed-ups built from a trained Transformer at load time: weight-only int8
(`quantize`) and a lean one-token decode step (`DecodeStep`: fused projections, a real-valued RoPE
table, compiled ahead of time by AOTInductor on request)."""

import copy
import functools
import hashlib
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model import Int8KVCache, KVCache, ModelArgs, Transformer, quantize_rows, rope_frequencies
from picollama import REPO_ROOT
from picollama.cli import atomic_output
from picollama.device import cpu_flags, cpu_has_bf16

QUANTIZATIONS = ("none", "int8", "int4")
# Inductor options for the compiled decode step (DecodeStep.compile_step): the weights stay out of
# the package (the step reads the model's own); realize_acc_reads_threshold=1 stores point-wise
# results that read more than one buffer instead of inlining them into their readers: 2.3-2.4
# against 2.5-2.7 ms a step on 2 AVX2 cores (measured with torch.compile). Where the compiled step
# is slower than eager, pick_step keeps eager.
COMPILE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "realize_acc_reads_threshold": 1}
# What step_seconds may spend timing, beyond its warm-up: blocks of 16 calls for small models (a
# batch-1 step of 8M parameters takes ~2 ms), of 2 for a 135M one (15-30 ms a step: 5 rounds of
# 16 took 4.4 s before generate.py printed its first token, against 0.4 s for 20 tokens).
TIMING_SECONDS = 0.5
ISA_FLAGS = (
    ("amx", "amx_tile"),
    ("avx512_bf16", "avx512_bf16"),
    ("avx512", "avx512f"),
    ("avx2", "avx2"),
)


class Int8Linear(nn.Module):
    """A bias-free linear layer whose weight is int8, one scale (absmax / 127) per output row."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        # the CPU kernel's
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # the kernel's dtype, whatever .to(dtype) cast it to
        self.scale_bf16 = self.scale_bf16.to(torch.bfloat16)
        return self

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int8Linear":
        """weight (out, in) rounded to int8 per row (float32 scales: .to(dtype) casts them)."""
        return cls(*quantize_rows(weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's int8 kernel (gpt-fast's on CPU) reads a quarter of fp32's bytes. With bf16
        # inputs it is fast on every CPU, AVX2 too (bf16 → fp32 is a shift): the matrix-vector
        # products of a decode step took 0.87 ms against 2.2-3.3 ms in fp32 on one AVX2 core; with
        # fp32 inputs it is 4-6x slower than F.linear. So CPU inputs go in as bf16 (coarser than
        # fp32, finer than llama.cpp's q8_0, which rounds them to 8 bits). It returns garbage unless
        # in_features is a multiple of 16 (torch 2.13): those, and other devices, dequantize.
        if x.device.type == "cpu" and self.weight.shape[1] % 16 == 0:
            rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale_bf16)
            return out.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype)) * self.scale


class Int8RowDot(Int8Linear):
    """An Int8Linear for compiled CPU decode steps (see RowDot): Inductor writes one loop that reads
    each int8 weight row, widens it to fp32 and reduces it, where _weight_int8pack_mm is an extern
    call on bf16 inputs. The matrix-vector products of SmolLM2-135M: 5.7 ms against 9.2 ms on one
    Zen 5 core (llama.cpp's whole q8_0 step: 5.5 ms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = x.float().unsqueeze(-2) * self.weight.float()
        return (products.sum(-1) * self.scale).to(x.dtype)


class Int4Linear(nn.Module):
    """A bias-free CPU linear layer whose weight is 4-bit: groups of 32 inputs with a scale and a
    minimum each (llama.cpp's Q4_1), packed for PyTorch's CPU kernel (_weight_int4pack_mm_for_cpu,
    bf16 inputs and outputs). Its packing interleaves rows, so layers are not fused (Concatenated).
    """

    GROUP = 32

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # (in / GROUP, out, 2) bf16

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16)  # the kernel's, whatever .to()
        return self

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        """Whether the kernel takes the layer's shape: inputs a multiple of 32, outputs of 16."""
        return linear.in_features % cls.GROUP == 0 and linear.out_features % 16 == 0

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int4Linear":
        """weight (out, in), in a multiple of GROUP, rounded to 16 levels between each group's
        minimum and maximum."""
        out, inputs = weight.shape
        groups = weight.detach().float().view(out, inputs // cls.GROUP, cls.GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        levels = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.to(torch.int32).view(out, inputs), 1
        )
        # the kernel reads a weight as (level - 8)·scale + zero
        scales_zeros = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1)
        return cls(packed, scales_zeros.contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        # exported for a compiled step: the kernel under our own op's name (decode_ops.cpp)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        if torch.compiler.is_exporting() and decode_ops() is not None:
            mm = torch.ops.picollama.int4_linear
        out = mm(rows, self.packed, self.GROUP, self.scales_zeros)
        return out.view(*x.shape[:-1], -1).to(x.dtype)


class Concatenated(nn.Module):
    """Layers reading one input, their outputs concatenated: Int4Linears, which cannot be joined."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.parts], -1)


@functools.cache
def decode_ops():
    """torch.ops.picollama (decode_ops.cpp: decode_attention, int4_linear), built at the first call
    (~20 s) into the project's cache for this CPU and torch, or None where it cannot be built (no
    C++ compiler), with a warning: the compiled step then attends with SDPA."""
    from torch.utils.cpp_extension import load_inline

    source = (Path(__file__).parent / "decode_ops.cpp").read_text()
    key = hashlib.sha256(f"{source}|{cpu_isa()}|{torch.__version__}".encode()).hexdigest()[:16]
    folder = REPO_ROOT / ".cache" / "extensions" / key
    folder.mkdir(parents=True, exist_ok=True)
    try:
        load_inline(
            "picollama_decode_ops",
            cpp_sources=source,
            is_python_module=False,
            build_directory=str(folder),
            # -fopenmp: at::parallel_for is inlined here, and without it runs on one thread
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # a missing or failing compiler: SDPA still works
        warnings.warn(f"decode_ops.cpp not built ({e}); attending with SDPA", stacklevel=2)
        return None
    torch.library.register_fake("picollama::decode_attention")(_attention_shape)
    torch.library.register_fake("picollama::int4_linear")(_int4_shape)
    return torch.ops.picollama


def _attention_shape(q, k, v, length, k_scale=None, v_scale=None):
    return q.new_empty(q.shape, dtype=torch.float32)


def _int4_shape(x, packed, group, scales_zeros):
    return x.new_empty(x.shape[0], packed.shape[0])


def isa_class(flags: set[str]) -> str:
    """The vector ISA class of /proc/cpuinfo flags: amx, avx512_bf16, avx512, avx2 or other."""
    return next((isa for isa, flag in ISA_FLAGS if flag in flags), "other")


def cpu_isa() -> str:
    """This machine's isa_class ("other" where /proc/cpuinfo has no flags line)."""
    return isa_class(cpu_flags())


def int8_dtype(device: torch.device, compiled: bool = False) -> torch.dtype:
    """The activation dtype for int8 weights: bf16 where the hardware has it, else float32 (norms
    and attention in emulated bf16 are slow; Int8Linear feeds its kernel bf16 on any CPU). A
    compiled CPU step (Int8RowDot) runs fastest on float32: SmolLM2-135M 5.3 against 6.5 ms a step
    on one Zen 5 core."""
    if compiled and device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32


def quantize(model: Transformer, mode: str) -> Transformer:
    """The model for inference with its weights as `mode` says, changed in place: "none" leaves them
    as they are, "int8" replaces every linear layer (not the embedding or the norms) by an
    Int8Linear, "int4" (CPU only) by an Int4Linear where its shape fits the kernel (the output layer
    by an Int8Linear). Quantize before casting the model to its activation dtype
    (.to(torch.bfloat16)): the weights are rounded from the given ones."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {mode!r}")
    if mode == "int4" and model.tok_embeddings.weight.device.type != "cpu":
        raise ValueError("int4 weights run on the CPU only (PyTorch's CPU int4 kernel)")
    for module in list(model.modules()):
        for name, child in module.named_children():
            if not isinstance(child, nn.Linear):
                continue
            # int4 keeps the output layer in int8, as llama.cpp's Q4 files keep it in 8 bits or more
            if mode == "int8" or (mode == "int4" and child is model.output):
                setattr(module, name, Int8Linear.quantized(child.weight))
            elif mode == "int4" and Int4Linear.fits(child):
                setattr(module, name, Int4Linear.quantized(child.weight))
    return model.requires_grad_(False)


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


def rope_table(args: ModelArgs, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE as real arithmetic on interleaved pairs, x·cos + swap_pairs(x)·sin, for positions
    0..length-1: cos and sin (length, head_dim) in float32, sin signed (−, +) per pair; the same
    rotation as model.apply_rotary."""
    inv_freq, scale = rope_frequencies(args, length)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    cos, sin = scale * angles.cos(), scale * angles.sin()
    return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)


class FusedBlock(nn.Module):
    """A TransformerBlock for one token per row, wq/wk/wv one matrix and w1/w3 one (projection)."""

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
        cpu = block.attention_norm.weight.device.type == "cpu"
        fits = self.head_dim % 16 == 0 and self.head_dim <= 128 and self.heads // self.kv_heads <= 8
        # a compiled CPU step attends with decode_ops.cpp where it builds
        ops = decode_ops() if rows and cpu and fits else None
        self.attend = ops.decode_attention if ops is not None else None

    def forward(self, x, pos, cos, sin, k_cache, v_cache, k_scale=None, v_scale=None):
        """k_scale, v_scale: an Int8KVCache's (its keys and values int8), else None."""
        batch = x.shape[0]
        heads = self.heads
        kv_heads = self.kv_heads
        qkv = self.wqkv(self.attention_norm(x)).view(batch, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split((heads + kv_heads, kv_heads), 1)
        qk = qk.float()
        qk = (qk * cos + qk.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).type_as(v)
        q, k = qk.split((heads, kv_heads), 1)
        # a slice, not [pos]: one compiled graph for every pos
        new = slice(pos, pos + 1)
        if k_scale is None:
            k_cache[:batch, :, new], v_cache[:batch, :, new] = k.unsqueeze(2), v.unsqueeze(2)
        else:
            k_cache[:batch, :, new], k_scale[:batch, :, new] = quantize_rows(k.unsqueeze(2))
            v_cache[:batch, :, new], v_scale[:batch, :, new] = quantize_rows(v.unsqueeze(2))
        if self.attend is not None:
            out = self.attend(q, k_cache, v_cache, pos + 1, k_scale, v_scale).type_as(x)
        else:
            keys, values = k_cache[:batch, :, : pos + 1], v_cache[:batch, :, : pos + 1]
            if k_scale is not None:
                keys = keys * k_scale[:batch, :, : pos + 1, None]
                values = values * v_scale[:batch, :, : pos + 1, None]
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # another cache dtype (kv_dtype)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, enable_gqa=heads != kv_heads
            )
        x = x + self.wo(out.view(batch, -1))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(gate) * up)


def cache_tensors(cache: KVCache) -> tuple:
    """What a step reads and writes of a layer's KV cache: keys and values, and an Int8KVCache's
    scales."""
    if isinstance(cache, Int8KVCache):
        return cache.k, cache.v, cache.k_scale, cache.v_scale
    return cache.k, cache.v


class DecodeStep(nn.Module):
    """`model(tokens, start_pos=pos)` for one token per row, tokens (B, 1), built for speed at batch
    1: wq/wk/wv and w1/w3 fused, RoPE from a table computed once, reading and writing the model's KV
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
        # (batch, cache batch) -> its step compiled (compile_step)
        self.compiled = {} if compiled else None
        if model.args.length_dependent:
            raise ValueError(
                "dynamic NTK rescales every cached position as the sequence grows: "
                "no fused decode step"
            )
        if not model.is_llama():
            raise ValueError(
                "the fused decode step is LLaMA's: "
                "a model with other switches decodes with its forward"
            )
        self.attentions = [
            block.attention for block in model.layers
        ]  # generation sets their caches
        self.tok_embeddings = model.tok_embeddings
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
        """RoPE's cos and sin (rope_table) and the positions as 0-d tensors (for a compiled step),
        for `length` positions."""
        # an inference tensor would be a new kind of input to a compiled step
        with torch.inference_mode(False):
            self.cos, self.sin = rope_table(self.args, length)
            self.positions = torch.arange(length, device=self.cos.device)

    def share_weights(self):
        """Point the model's linear layers at this step's copies of their weights (views)."""
        for layer, name, view in self.shared:
            setattr(
                layer,
                name,
                nn.Parameter(view, requires_grad=False) if name in layer._parameters else view,
            )

    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        if start_pos >= self.cos.shape[0]:
            self.tables(2 * start_pos)
        caches = [cache_tensors(attention.cache) for attention in self.attentions]
        threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # ~0.3 µs a change
        try:
            ids, cos, sin = tokens[:, 0].contiguous(), self.cos[start_pos], self.sin[start_pos]
            if self.compiled is None:
                return self.step(ids, start_pos, cos, sin, caches)[:, None]
            kind = (ids.shape[0], caches[0][0].shape[0])
            if kind not in self.compiled:
                self.compiled[kind] = self.compile_step(ids, cos, sin, caches)
            inputs = [
                ids,
                self.positions[start_pos],
                cos,
                sin,
                *(tensor for cache in caches for tensor in cache),
            ]
            return self.compiled[kind](inputs)[0][:, None]
        finally:
            torch.set_num_threads(threads)

    def step(self, ids, pos, cos, sin, caches):
        x = self.tok_embeddings(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, pos, cos, sin, *cache)
        return self.output(self.norm(x))

    def compile_step(self, ids, cos, sin, caches):
        """self.step compiled ahead of time by AOTInductor (torch.export, then one C++ library) for
        this batch and cache batch, every cache length and position: called from C++ with no guards
        to check, where a torch.compile'd step spent ~0.3 ms a call in dynamo's frame on 2 AVX2
        cores. The library reads the weights where they are (user-managed constants, not a copy). It
        takes [ids, position (a 0-d tensor from self.positions), cos, sin, then each layer's keys
        and values] and returns [logits]."""
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
        length = torch.export.Dim("cache_length", min=2, max=1 << 24)
        dims = [tuple({2: length} for _ in cache) for cache in caches]
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # torch's own use of its pytree API
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            program = torch.export.export(
                _PositionAsTensor(self),
                (ids, self.positions[1], cos, sin, caches),
                strict=False,
                dynamic_shapes=(None, None, None, None, dims),
            )
            runner = torch._inductor.aoti_load_package(str(compiled_package(program, ids.device)))
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

    def __init__(self, decode: DecodeStep):
        super().__init__()
        self.decode = decode

    def forward(self, ids, pos, cos, sin, caches):
        pos = pos.item()
        torch._check(pos >= 0)
        torch._check(pos < caches[0][0].shape[2])
        return self.decode.step(ids, pos, cos, sin, caches)


@torch.inference_mode()
def step_seconds(
    model: Transformer,
    steps: dict,
    batch: int = 1,
    calls: int = 16,
    repeats: int = 5,
    budget: float = TIMING_SECONDS,
) -> dict:
    """Median seconds of one decode step of `batch` rows through each of `steps` ({name: step of
    model}), timed interleaved after a warm-up call (where a compiled step compiles), on a cache of
    model's set up here and reset after: up to `repeats` rounds, the first of one call of each step,
    the others of up to `calls` calls, as many as the first says fit in `budget` seconds; no new
    round once the rounds took `budget` (on a busy CPU one step can take 20x longer on two threads
    than on one: one round then decides)."""
    # the steps timed together share one cache
    kv_dtype = getattr(next(iter(steps.values())), "kv_dtype", None)
    model.setup_cache(batch, calls + 1, dtype=kv_dtype)
    device = model.tok_embeddings.weight.device
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = {name: [] for name in steps}
    try:
        for step in steps.values():
            step(token, start_pos=0)
        block = 1
        spent = 0.0
        for _ in range(repeats):
            for name, step in steps.items():
                times[name].append(per_call_seconds(step, token, block))
                spent += times[name][-1] * block
            if spent >= budget:
                break
            if block == 1:
                first_round = sum(t[0] for t in times.values())
                block = max(1, min(calls, int(budget / (repeats * first_round))))
    finally:
        model.reset_cache()
    return {name: statistics.median(t) for name, t in times.items()}


def per_call_seconds(step, token: torch.Tensor, calls: int) -> float:
    """Seconds per call of `calls` decode steps at positions 0..calls-1, the device synchronized."""
    start = time.perf_counter()
    for pos in range(calls):
        step(token, start_pos=pos)
    if token.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def pick_step(model: Transformer, eager: DecodeStep, compiled: DecodeStep, batch: int = 1) -> tuple:
    """(step, note): the compiled step, or the eager one where a short interleaved timing at `batch`
    rows (step_seconds) finds the compiled one slower on this machine, with a one-line note saying
    so (else None)."""
    seconds = step_seconds(model, {"eager": eager, "compiled": compiled}, batch)
    if seconds["compiled"] <= seconds["eager"]:
        return compiled, None
    times = f"{seconds['compiled'] * 1e3:.2f} vs {seconds['eager'] * 1e3:.2f} ms a token"
    return eager, (
        f"--compile: the compiled decode step ran slower than eager here ({times}, {cpu_isa()} "
        "CPU): decoding eager"
    )


def compiled_unless_slower(
    model: Transformer, step: DecodeStep, batch: int = 1
) -> tuple[DecodeStep, str | None]:
    """pick_step between `step` (eager) and a compiled step of the model on the same threads, at the
    batch size it will decode (which it is compiled for). The model's layers then share the chosen
    step's weights: the other's copy goes with it."""
    compiled = DecodeStep(model, step.threads, compiled=True, kv_dtype=step.kv_dtype)
    chosen, note = pick_step(model, step, compiled, batch)
    chosen.share_weights()
    return chosen, note


def tune_threads(model: Transformer, step: DecodeStep, batch: int = 1) -> str | None:
    """Set step.threads to 1 where a short interleaved timing at `batch` rows finds one thread
    faster than torch's count (a batch-1 step is ~100 small kernels: on a busy 2-core CPU every
    parallel region waits for a descheduled thread); a one-line note when it does, else None."""
    threads = torch.get_num_threads()
    if threads == 1 or model.tok_embeddings.weight.device.type != "cpu":
        return None
    one = copy.copy(step)
    one.threads = 1
    seconds = step_seconds(model, {"all": step, "one": one}, batch)
    if seconds["one"] >= seconds["all"]:
        return None
    step.threads = 1
    one_ms, all_ms = seconds["one"] * 1e3, seconds["all"] * 1e3
    return f"decoding on 1 thread: {one_ms:.2f} ms a token against {all_ms:.2f} on {threads} here"
