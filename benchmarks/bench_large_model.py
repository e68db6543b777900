"""Capture throughput on a Llama-3.3-70B-shaped model, blocks 0..40 in bf16 on one GPU.

The Activault headline workload, per GPU: 6 residual sites spread over layers 0-40 of a
Llama 3.3 70B (hidden 8192, 80 layers, 64 heads / 8 KV heads, intermediate 28672, vocab
128256), context 2048. The model is built from its config with random weights directly on
the GPU, truncated by actstore's own planner (:func:`actstore.capture.models.plan_model`)
to blocks 0..40 (~72 GB in bf16: one H200, or one H100 with little to spare); nothing is
downloaded. A WordLevel tokenizer over the model's vocabulary is written next to the
config, so the text goes through the real tokenise-and-pack path.

Measured, in this order (each against baselines of the same run):

1. forward alone: the truncated model over the same contexts, no hooks, no copies
   (first half of ``--tokens``);
2. raw disk: sequential write + fsync of ``--disk-gib`` (three times, between the passes;
   the median is the disk's rate);
3. ``actstore.capture.capture`` into activault (bf16) and saev (float32), the model handed in
   already built (``capture(..., model=...)``), in chunks that fit the disk (each chunk's
   store is deleted after it is timed);
4. forward alone again (second half).

Printed per path: tokens/s per GPU, the ratio to min(forward rate, disk rate for the bytes
that format stores per token) (goal >= 0.95), the ratio to Activault's published ~4.1k
tokens/s per GPU (33k tokens/s on an 8-GPU H100 node), and the model FLOPs utilisation:
(2 x block parameters + 2 x blocks x context x d_model) FLOPs per token (causal attention)
over the card's dense bf16 peak. ``--budget-s`` (default 420) bounds the run: a capture
pass stops starting chunks (and says so) once the next would end after its share of
the time left.

    python benchmarks/bench_large_model.py            # H100/H200, ~6 minutes
    python benchmarks/bench_large_model.py --small    # the same code path on CPU, seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from actstore.capture import CaptureConfig, LoadedModel, capture
from actstore.capture.models import plan_model
from actstore.capture.runner import packed_source
from actstore.formats import get_format
from actstore.formats.registry import parse_options

#: Activault's published rate: 10B tokens in 3.5 days on one 8-GPU H100 node.
ACTIVAULT_PER_GPU = 10e9 / (3.5 * 86400) / 8

LLAMA_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 224,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}

#: Dense bf16 tensor-core peaks (TFLOP/s) by device name.
PEAKS = (
    ("H200 NVL", 835.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H200", 989.4),
    ("H100", 989.4),
)


@dataclass
class Pass:
    name: str
    tokens: int
    seconds: float
    stored_per_token: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def write_model_dir(root: Path, shape: dict, context: int) -> Path:
    """config.json and a WordLevel tokenizer (``<eos>`` = 0, ``t1`` ... ``tV-1``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = root / "model"
    transformers.LlamaConfig(**shape, bos_token_id=0, eos_token_id=0).save_pretrained(path)
    vocab = {"<eos>": 0} | {f"t{i}": i for i in range(1, shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", model_max_length=context
    )
    fast.save_pretrained(path)
    return path


def write_dataset(root: Path, vocab: int, context: int, n_contexts: int) -> Path:
    """``n_contexts + 1`` lines of ``context - 1`` random words (+ the <eos> separator)."""
    rng = np.random.default_rng(0)
    path = root / "tokens.txt"
    with path.open("w") as f:
        for _ in range(n_contexts + 1):
            ids = rng.integers(1, vocab, size=context - 1)
            f.write(" ".join(f"t{i}" for i in ids) + "\n")
    return path


def build_model(model_dir: Path, sites: tuple[str, ...], device: str, dtype: str) -> LoadedModel:
    """The truncated model built in place on ``device`` (random weights, no checkpoint)."""
    import transformers

    plan = plan_model(str(model_dir), dtype=dtype, sites=sites)
    with torch.device(device):
        module = transformers.AutoModel.from_config(plan.config, dtype=plan.dtype)
    module.eval().requires_grad_(False)
    return LoadedModel(
        module=module,
        ckpt=f"{plan.label} (Llama-3.3-70B-shaped, random weights)",
        family=plan.family,
        modality="text",
        blocks=module.get_submodule(plan.blocks_path),
        n_layers=plan.n_layers,
        d_model=plan.d_model,
        has_cls=False,
        device=torch.device(device),
        dtype=plan.dtype,
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_alone(model: LoadedModel, cfg: CaptureConfig, n_batches: int, device: str) -> Pass:
    """``n_batches`` forwards of the truncated model over the capture's contexts (cycled)."""
    source = packed_source(cfg, model)
    batches = [b.inputs for b in source.batches(0, cfg.batch_size)]
    tokens = 0
    with torch.inference_mode():
        model.module(**batches[0], use_cache=False)  # warm-up (kernels, allocator)
        sync(device)
        start = time.perf_counter()
        for i in range(n_batches):
            inputs = batches[i % len(batches)]
            model.module(**inputs, use_cache=False)
            tokens += int(inputs["input_ids"].numel())
        sync(device)
    return Pass("forward alone", tokens, time.perf_counter() - start)


def raw_disk(out: Path, gib: float) -> float:
    """Bytes/s of a sequential write + fsync of ``gib`` GiB."""
    block = np.random.default_rng(1).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    n = max(1, int(gib * 2**30) // len(block))
    path = out / "raw.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.writelines(block for _ in range(n))
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return n * len(block) / seconds


def capture_pass(
    model: LoadedModel,
    cfg: CaptureConfig,
    fmt: str,
    opts: list[str],
    chunks: int,
    out: Path,
    deadline: float,
) -> Pass:
    """``chunks`` captures of the dataset into ``fmt`` (each store deleted once timed),
    stopping early when the next chunk would end after ``deadline`` (perf_counter)."""
    spec = get_format(fmt)
    options = parse_options(spec, opts)
    tokens, seconds, stored = 0, 0.0, 0
    for i in range(chunks):
        start = time.perf_counter()
        where = out / f"{fmt}-{i}"
        result = capture(
            cfg, lambda plan, w=where: spec.open_writer(plan, str(w), options), model=model
        )
        tokens += result.n_examples_run * result.plan.tokens_per_example
        seconds += result.seconds
        stored += sum(p.stat().st_size for p in where.rglob("*") if p.is_file())
        shutil.rmtree(where)
        took = time.perf_counter() - start
        if i + 1 < chunks and time.perf_counter() + took > deadline:
            print(f"note: {fmt} stopped after {i + 1} of {chunks} chunks to fit --budget-s")
            break
    return Pass(f"capture -> {fmt}", tokens, seconds, stored // max(tokens, 1))


def peak_tflops(device: str, given: float | None) -> tuple[float | None, str]:
    if given:
        return given, "given"
    if not device.startswith("cuda"):
        return None, "CPU"
    name = torch.cuda.get_device_name()
    for key, peak in PEAKS:
        if key in name:
            return peak, name
    return None, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model on CPU (seconds)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per path (1,048,576)")
    ap.add_argument("--context", type=int, default=None, help="context length (2048)")
    ap.add_argument("--batch-size", type=int, default=None, help="contexts per forward (4)")
    ap.add_argument("--deepest", type=int, default=40, help="deepest site's block (40)")
    ap.add_argument("--disk-gib", type=float, default=None, help="raw write size (4 GiB)")
    ap.add_argument("--out", default=None, help="directory for the stores (default: cwd)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="tokens per store")
    ap.add_argument("--budget-s", type=float, default=420.0, help="trim to finish in this")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak")
    args = ap.parse_args()
    t_start = time.perf_counter()
    small = args.small
    shape = TINY if small else LLAMA_70B
    device = "cpu" if small else "cuda"
    dtype = "float32" if small else "bfloat16"
    context = args.context or (128 if small else 2048)
    batch = args.batch_size or (8 if small else 4)
    tokens = args.tokens or (32768 if small else 1 << 20)
    if small:
        torch.set_num_threads(1)  # tiny ops: a shared CPU's thread barriers would dominate
    disk_gib = args.disk_gib or (0.05 if small else 4.0)
    deepest = min(args.deepest, shape["num_hidden_layers"] // 2) if small else args.deepest
    layers = sorted({round(x) for x in np.linspace(0, deepest, 6)})
    sites = tuple(f"resid.{x}" for x in layers)
    root = Path(tempfile.mkdtemp(prefix="bench-large-", dir=args.out or os.getcwd()))
    try:
        model_dir = write_model_dir(root, shape, context)
        t0 = time.perf_counter()
        model = build_model(model_dir, sites, device, dtype)
        sync(device)
        n_params = sum(p.numel() for p in model.blocks.parameters())
        print(
            f"model: {shape['num_hidden_layers']} blocks x hidden {shape['hidden_size']}, "
            f"built with blocks 0..{len(model.blocks) - 1} only ({n_params / 1e6:,.1f}M block "
            f"parameters, {dtype}) on {device} in {time.perf_counter() - t0:.1f}s; sites "
            f"{', '.join(sites)}; context {context}, batch {batch}"
        )
        if device == "cuda":
            print(f"GPU memory after the build: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        fit = _chunk_contexts(root, shape, context)
        if args.chunk_tokens:
            fit = min(fit, args.chunk_tokens // context)
        chunk_contexts = max(batch, min(tokens // context, fit))
        chunk_contexts -= chunk_contexts % batch
        dataset = write_dataset(root, shape["vocab_size"], context, chunk_contexts)
        cfg = CaptureConfig(
            model=str(model_dir),
            dataset=str(dataset),
            sites=sites,
            batch_size=batch,
            context_length=context,
            max_examples=chunk_contexts,
            device=device,
            dtype=dtype,
            progress=False,
        )
        n_chunks = max(1, round(tokens / (chunk_contexts * context)))
        half = max(1, n_chunks * chunk_contexts // batch // 2)

        disk = [raw_disk(root, disk_gib)]
        fwd = [forward_alone(model, cfg, half, device)]
        passes: list[Pass] = []
        # time left for the two captures: the budget less what is spent, the second
        # forward half (as long as the first) and a margin; activault gets half of it
        left = args.budget_s - (time.perf_counter() - t_start) - fwd[0].seconds - 20
        for fmt, opts, share in (("activault", ["dtype=bfloat16"], 0.5), ("saev", [], 1.0)):
            deadline = time.perf_counter() + max(left, 0) * share
            passes.append(capture_pass(model, cfg, fmt, opts, n_chunks, root, deadline))
            disk.append(raw_disk(root, disk_gib))
            left = args.budget_s - (time.perf_counter() - t_start) - fwd[0].seconds - 20
        fwd.append(forward_alone(model, cfg, half, device))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fwd_rate = statistics.median(p.rate for p in fwd)
    disk_rate = statistics.median(disk)
    peak, card = peak_tflops(device, args.peak_tflops)
    flops = 2 * n_params + 2 * len(model.blocks) * context * shape["hidden_size"]
    print(
        f"\ncard: {card}; forward alone {fwd[0].rate:,.0f} and {fwd[1].rate:,.0f} tokens/s "
        f"(before / after the captures); raw write + fsync {disk_rate / 1e9:.2f} GB/s "
        f"(median of {', '.join(f'{d / 1e9:.2f}' for d in disk)})"
    )
    header = (
        f"{'path':<20} {'tokens':>10} {'s':>7} {'tokens/s/GPU':>13} {'x forward':>10} "
        f"{'x min(fwd,disk)':>16} {'x Activault':>12} {'MFU':>6}"
    )
    print(header)
    print("-" * len(header))
    for p in [*fwd, *passes]:
        bound = fwd_rate
        if p.stored_per_token:
            bound = min(fwd_rate, disk_rate / p.stored_per_token)
        mfu = f"{p.rate * flops / (peak * 1e12):.2f}" if peak else "n/a"
        print(
            f"{p.name:<20} {p.tokens:>10,} {p.seconds:>7.1f} {p.rate:>13,.0f} "
            f"{p.rate / fwd_rate:>10.3f} {p.rate / bound:>16.3f} "
            f"{p.rate / ACTIVAULT_PER_GPU:>12.2f} {mfu:>6}"
        )
    print(
        f"\nActivault's published rate: {ACTIVAULT_PER_GPU:,.0f} tokens/s per GPU "
        "(10B tokens, 3.5 days, 8 x H100). Goal: capture >= 0.95 x min(forward, disk)."
    )
    for p in passes:
        print(
            f"{p.name}: stores {p.stored_per_token:,} bytes per token; the disk takes "
            f"{disk_rate / p.stored_per_token:,.0f} tokens/s of it"
        )
    print(f"MFU: {flops / 1e9:.4g} GFLOP per token over {peak or 'n/a'} TFLOP/s ({card})")
    chunk = cfg.max_examples * context
    print(f"chunks of {chunk:,} tokens per store (--chunk-tokens, or what the disk holds)")
    print(f"total {time.perf_counter() - t_start:.0f}s")


def _chunk_contexts(root: Path, shape: dict, context: int) -> int:
    """Contexts per chunk: a float32 store of 6 sites fills at most 40% of the free disk."""
    per_context = 6 * shape["hidden_size"] * 4 * context
    return max(1, int(shutil.disk_usage(root).free * 0.4 // per_context))


if __name__ == "__main__":
    main()
