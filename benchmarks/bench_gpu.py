"""GPU capture, loader and SAE training against their limits, in one run (issue 24).

Builds a Qwen2-0.5B-shaped model from a config (hidden 896, 24 layers, bf16, random
weights) and a 32k-word tokenizer here (no downloads: the GPU machine has no internet),
writes 1,048,576 tokens of text (contexts of 1024, batch 32, sites resid.6 and resid.12)
and measures, each against a baseline taken in the same run:

1. capture: the forward pass alone (the recorder's hooks, nothing copied); capture into a
   writer that discards batches (synchronous ``.to("cpu")``, the pinned copy ring, the ring
   with the cast to float32 on the GPU); capture to saev, activault, zarr, pickle and
   saelens against the limit ``max(forward-only time, raw write + fsync of the same
   bytes)``; the heavy case (every layer stored) against the raw write;
2. the loader: epochs over the stored site with ``device="cuda"`` against the same
   loader on the CPU, each kept across epochs as a trainer keeps it (in process, with
   persistent DataLoader workers, and through ``actstore serve``: a served consumer);
3. SAE training (topk, 16x, k=32, batch 4096) fed by the loader against the same training
   on batches already on the GPU, fp32 and bf16 autocast, fed in process, by workers and
   by a served consumer (each feed one endless stream: epochs follow each other as in
   training, so the next epoch's read-ahead is part of what is measured).

Prints one table of ratios (``--json`` also writes every number). ``--small`` runs the
same code on the CPU in seconds (a tiny model; CUDA rows use ``device="cpu"``, where a
thread does the copies), so the script is known to work before GPU time is spent.

    python benchmarks/bench_gpu.py                # GPU machine: well under 8 minutes (H200)
    python benchmarks/bench_gpu.py --quick        # GPU machine, under 4 minutes: saev only,
                                                  # no heavy case, fewer repeats
    python benchmarks/bench_gpu.py --small        # anywhere, seconds
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import DiscardWriter, Timer, fmt, table

from actstore.capture import CaptureConfig, capture
from actstore.capture.copyout import Build, CopyOut, Sink
from actstore.formats.registry import get_format, parse_options
from actstore.loader import ActivationDataLoader, ActivationLoader
from actstore.loader.serve import ServedLoader, start_server
from actstore.sae.train import TrainConfig, train_sae


@dataclass(frozen=True)
class Shape:
    """The model and the amounts of data one run uses."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    tokens: int
    batch: int
    sites: tuple[int, ...]
    heavy_tokens: int
    """Tokens of the heavy case (every layer stored)."""
    small_tokens: int
    """Tokens of the slow formats (pickle's gzip, zarr's prompt/response padding)."""
    rows: int
    """Rows per loader and SAE batch."""
    workers: int
    """DataLoader workers of the loader's worker row."""


FULL = Shape(
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    intermediate=4864,
    vocab=32768,
    context=1024,
    tokens=1 << 20,
    batch=32,
    sites=(6, 12),
    heavy_tokens=1 << 18,
    small_tokens=1 << 17,
    rows=4096,
    workers=4,
)
SMALL = Shape(
    hidden=64,
    layers=4,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=1024,
    context=128,
    tokens=1 << 13,
    batch=8,
    sites=(1, 2),
    heavy_tokens=1 << 11,
    small_tokens=1 << 11,
    rows=256,
    workers=2,
)
FORMATS = ("saev", "activault", "zarr", "pickle", "saelens")


# ---------------------------------------------------------------------- inputs


class Language:
    """Text of pseudo-words drawn with Zipf frequencies from a fixed lexicon, and a byte-level
    BPE tokenizer of ``vocab`` ids trained on it here (as Qwen2's is: no download)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        lengths = self.rng.integers(2, 10, 4 * vocab)
        self.lexicon = np.array(["".join(self.rng.choice(letters, n)) for n in lengths])
        weights = 1.0 / np.arange(1, len(self.lexicon) + 1)
        self.p = weights / weights.sum()
        self.vocab = vocab

    def document(self, n_words: int) -> str:
        return " ".join(self.lexicon[self.rng.choice(len(self.lexicon), n_words, p=self.p)])

    def tokenizer(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.vocab,
            show_progress=False,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        sample = [self.document(500) for _ in range(max(20, self.vocab // 40))]
        tok.train_from_iterator(sample, trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
        )


def build_model(root: Path, shape: Shape, device: str, language: Language) -> Any:
    """A Qwen2 model of ``shape`` with random bf16 weights and the trained tokenizer, saved;
    returns the tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2Config(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        max_position_embeddings=max(4096, shape.context),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    with torch.device(device):
        model = tf.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root)
    del model
    tokenizer = language.tokenizer()
    tokenizer.save_pretrained(root)
    return tokenizer


def write_corpus(root: Path, shape: Shape, language: Language, tokenizer: Any) -> tuple[Path, Path]:
    """Documents of at least ``shape.tokens`` tokens, and prompt/response records of about
    ``context`` tokens each (zarr's prompt/response mode)."""
    docs, have = [], 0
    while have < shape.tokens * 1.02 + shape.context:
        batch = [language.document(800) for _ in range(64)]
        have += sum(len(ids) + 1 for ids in tokenizer(batch)["input_ids"])
        docs += batch
    text = root / "corpus.txt"
    text.write_text("\n".join(docs), encoding="utf-8")
    per_word = have / (800 * len(docs))  # tokens per word
    half = int(shape.context / 2 / per_word * 0.95)
    qa = root / "qa.jsonl"
    with qa.open("w", encoding="utf-8") as f:
        for _ in range(shape.small_tokens // shape.context):
            record = {"prompt": language.document(half), "response": language.document(half)}
            f.write(json.dumps(record) + "\n")
    return text, qa


# ---------------------------------------------------------------------- measurements


class ForwardOnly(CopyOut):
    """Drops the activations where they were computed: the forward pass alone (the
    recorder's hooks, nothing copied); ``close`` waits for the device's queued work."""

    def __init__(self, sink: Sink, device: torch.device) -> None:
        self.sink, self.device = sink, device

    def put(self, acts: Any, build: Build) -> None:
        self.sink(build({}))

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class Run:
    """One capture: its forward-loop seconds and where the time went."""

    seconds: float
    tokens: int
    writer_wait_s: float
    copy_wait_s: float
    output: Any = None
    """What the writer returned (a local store's path)."""
    nbytes: int = 0


def store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_capture(
    cfg: CaptureConfig,
    open_writer: Callable[[Any], Any],
    *,
    copy_out: Callable[[Sink], CopyOut] | None = None,
    out: Path | None = None,
    keep: bool = False,
) -> Run:
    gc.collect()
    result = capture(cfg, open_writer, copy_out=copy_out)
    tokens = result.n_examples_run * result.plan.tokens_per_example
    run = Run(
        result.seconds,
        tokens,
        result.writer_wait_s,
        result.extra.get("copy_wait_s", 0.0),
        result.output,
    )
    if out is not None:
        run.nbytes = store_bytes(out)
        if not keep:
            shutil.rmtree(out)
    return run


_CHUNK = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially into one new file and fsync it (the disk's
    limit for a writer of that many bytes)."""
    path = directory / "raw-write.bin"
    view = memoryview(_CHUNK)
    with Timer() as t:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left:
                left -= os.write(fd, view[: min(len(view), left)])
            os.fsync(fd)
        finally:
            os.close(fd)
    path.unlink()
    return t.seconds


def open_format(name: str, out: Path) -> Callable[[Any], Any]:
    spec = get_format(name)
    options = parse_options(spec, [])
    return lambda plan: spec.open_writer(plan, str(out), options)


FEEDS = ("in process", "workers", "serve")


class Feeds:
    """The loader of one stored site as a trainer keeps it, once per feed and device:
    in process, under a persistent ``ActivationDataLoader`` and as a served consumer (one
    server per device, so a consumer that waits never stalls the other's ring). Each is
    one endless stream of batches (epochs follow each other)."""

    def __init__(self, store: Path, site: int, rows: int, workers: int, drop_last: bool) -> None:
        self.store, self.site, self.rows, self.workers = store, site, rows, workers
        self.options = {"site": site, "batch_size": rows, "drop_last": drop_last}
        self._streams: dict[tuple[str, str | None], Iterator[Any]] = {}
        self._servers: list[Any] = []
        self._consumers: list[ServedLoader] = []
        probe = ActivationLoader(str(store), **self.options)
        self.per_epoch, self.d_model = len(probe), probe.d_model

    def stream(self, feed: str, device: str | None) -> Iterator[Any]:
        key = (feed, device)
        if key not in self._streams:
            self._streams[key] = self._make(feed, device)
        return self._streams[key]

    def _make(self, feed: str, device: str | None) -> Iterator[Any]:
        if feed == "serve":
            name = f"bench-gpu-{os.getpid()}-{len(self._servers)}"
            self._servers.append(
                start_server(
                    str(self.store),
                    name=name,
                    consumers=1,
                    epochs=100_000,
                    context="spawn",
                    **self.options,
                )
            )
            consumer = ServedLoader(name, 0, device=device)
            self._consumers.append(consumer)
            return _endless(consumer)
        loader = ActivationLoader(str(self.store), device=device, **self.options)
        if feed == "workers":
            return _endless(
                ActivationDataLoader(loader, num_workers=self.workers, persistent_workers=True)
            )
        return _endless(loader)

    def close(self) -> None:
        self._streams.clear()
        for consumer in self._consumers:
            consumer.close()
        for server in self._servers:
            server.kill()
            server.join(10)


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def epoch_rate(feeds: Feeds, feed: str, device: str | None) -> float:
    """Bytes per second of one epoch's worth of batches from ``feed`` on ``device``."""
    stream = feeds.stream(feed, device)
    n = 0
    with Timer() as t:
        for x in itertools.islice(stream, feeds.per_epoch):
            n += x.shape[0]
            del x
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    return n * feeds.d_model * 4 / t.seconds


def sae_seconds(
    batches: Iterator[torch.Tensor],
    *,
    d_model: int,
    steps: int,
    rows: int,
    device: str,
    autocast: str | None,
) -> float:
    config = TrainConfig(
        kind="topk",
        expansion=16,
        k=32,
        steps=steps,
        batch_size=rows,
        warmup_steps=10,
        device=device,
        normalise=False,
        autocast=autocast,
        log_every=steps,
    )
    return train_sae(config, batches, d_model=d_model, progress=False).metrics["seconds"]


def median(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------------- the run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny model on the CPU, in seconds")
    p.add_argument(
        "--dir", type=Path, default=None, help="scratch directory on the disk to measure"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats (default 3; --small: 1)"
    )
    p.add_argument("--formats", default=",".join(FORMATS), help="writers to measure")
    p.add_argument("--skip-heavy", action="store_true", help="no every-layer capture")
    p.add_argument("--json", type=Path, help="also write every number here")
    p.add_argument(
        "--quick",
        action="store_true",
        help="under 4 minutes on an H100/H200: saev only, no heavy case, 2 repeats",
    )
    p.add_argument("--feeds", default=",".join(FEEDS), help="loader feeds of parts 2 and 3")
    args = p.parse_args()
    if args.quick:
        args.formats, args.skip_heavy = "saev", True
        args.repeats = args.repeats or 2
    cuda = torch.cuda.is_available() and not args.small
    if not cuda and not args.small:
        sys.exit("no CUDA device: run on the GPU machine, or pass --small to try the code here")
    shape = SMALL if args.small else FULL
    args.repeats = args.repeats or (1 if args.small else 3)
    device = "cuda" if cuda else "cpu"
    loader_device = "cuda" if cuda else "cpu"  # on the CPU: the same pipeline, a thread copies
    root = Path(tempfile.mkdtemp(prefix="actstore-bench-gpu-", dir=args.dir))
    started = time.perf_counter()
    rows: list[list[Any]] = []
    record: dict[str, Any] = {"shape": asdict(shape), "device": _device_name(cuda)}
    print(f"# bench_gpu on {record['device']}, scratch {root} ({_filesystem(root)})", flush=True)

    def add(row: list[Any]) -> None:
        """Keep a result row; print it and save what is known so far at once (a run cut
        short still reports every row it finished)."""
        rows.append(row)
        print("# " + " | ".join("-" if v is None else fmt(v) for v in row), flush=True)
        if args.json:
            record.update(rows=rows, seconds=time.perf_counter() - started)
            args.json.write_text(json.dumps(record, indent=1, default=str))

    try:
        language = Language(shape.vocab)
        model = root / "model"
        text, qa = write_corpus(root, shape, language, build_model(model, shape, device, language))
        print(f"# model and corpus ready in {time.perf_counter() - started:.0f} s", flush=True)
        base = CaptureConfig(
            model=str(model),
            dataset=str(text),
            sites=tuple(f"resid.{s}" for s in shape.sites),
            batch_size=shape.batch,
            context_length=shape.context,
            max_tokens=shape.tokens,
            device=device,
            dtype="bfloat16",
            progress=False,
        )
        dev = torch.device(device)
        forward_only = lambda sink: ForwardOnly(sink, dev)
        discard = lambda plan: DiscardWriter()
        run_capture(replace(base, max_tokens=shape.context * shape.batch), discard)  # warm-up

        # 1. forward only and discarding captures, interleaved
        variants = {
            "forward only": ({}, forward_only),
            "discard, synchronous .to('cpu')": ({"copy_slots": 0}, None),
            "discard, pinned ring": ({}, None),
            "discard, pinned ring + cast to float32 on the GPU": ({"copy_dtype": "float32"}, None),
        }
        timings: dict[str, list[Run]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, (options, copy_out) in variants.items():
                timings[name].append(
                    run_capture(replace(base, **options), discard, copy_out=copy_out)
                )
        fwd_s = median([r.seconds for r in timings["forward only"]])
        tokens = timings["forward only"][0].tokens
        fwd_rate = tokens / fwd_s
        add(["forward only", fwd_s, "-", None, None, "-", f"{fwd_rate:,.0f} tokens/s"])
        for name in list(variants)[1:]:
            s = median([r.seconds for r in timings[name]])
            wait = median([r.copy_wait_s for r in timings[name]])
            add(
                [
                    f"capture, {name}",
                    s,
                    "forward only",
                    fwd_s,
                    fwd_s / s,
                    ">= 0.95",
                    f"copy wait {wait:.2f} s",
                ]
            )
        print(f"# capture rows done at {time.perf_counter() - started:.0f} s", flush=True)

        # 2. writers against the raw write of their bytes
        kept: Path | None = None
        formats = [f for f in args.formats.split(",") if f]
        for kind in formats:
            cases = [("writer casts", {})]
            if kind == "saev":
                cases.append(("cast on the GPU", {"copy_dtype": "float32"}))
            for label, options in cases:
                cfg = replace(base, **options)
                fwd = fwd_s * 1.0
                if kind == "pickle":
                    cfg = replace(cfg, max_tokens=shape.small_tokens)
                    fwd = fwd_s * shape.small_tokens / tokens
                if kind == "zarr":
                    cfg = replace(cfg, dataset=str(qa), mode="prompt_response", max_tokens=None)
                    fwd = run_capture(cfg, discard, copy_out=forward_only).seconds
                out = root / f"store-{kind}-{len(rows)}"
                keep = kind == "saev" and kept is None
                try:
                    run = run_capture(cfg, open_format(kind, out), out=out, keep=keep)
                except ImportError as err:  # zarr, saelens (datasets): extras not installed
                    add([f"capture to {kind}", None, "-", None, None, ">= 0.95", f"skipped: {err}"])
                    shutil.rmtree(out, ignore_errors=True)
                    break
                except Exception as err:  # noqa: BLE001 - one failed row must not cost the run
                    add(
                        [f"capture to {kind}", None, "-", None, None, ">= 0.95", f"failed: {err!r}"]
                    )
                    shutil.rmtree(out, ignore_errors=True)
                    continue
                if keep:
                    kept, kept_root = Path(run.output), out
                raw_s = raw_write(root, run.nbytes)
                limit = max(fwd, raw_s)
                bound = "disk" if raw_s > fwd else "forward"
                add(
                    [
                        f"capture to {kind} ({label})",
                        run.seconds,
                        f"max(forward, raw write {run.nbytes / 1e9:.2f} GB + fsync)",
                        limit,
                        limit / run.seconds,
                        ">= 0.95",
                        (
                            f"bound: {bound}; raw {run.nbytes / raw_s / 1e9:.2f} GB/s, writer "
                            f"{run.nbytes / run.seconds / 1e9:.2f} GB/s, writer wait "
                            f"{run.writer_wait_s:.1f} s"
                        ),
                    ]
                )
                print(
                    f"# {kind} ({label}) done at {time.perf_counter() - started:.0f} s", flush=True
                )

        # 3. the loader and SAE training on the kept saev store
        if kept is not None:
            site = shape.sites[0]
            feed_names = [f for f in args.feeds.split(",") if f]
            feeds = Feeds(kept, site, shape.rows, shape.workers, drop_last=True)
            try:
                for feed in feed_names:
                    where = f"{shape.workers} workers" if feed == "workers" else feed
                    cpu_rates, dev_rates = [], []
                    for device_ in (None, loader_device):  # started, warm: pools, page cache
                        epoch_rate(feeds, feed, device_)
                    for _ in range(max(2, args.repeats)):
                        cpu_rates.append(epoch_rate(feeds, feed, None))
                        dev_rates.append(epoch_rate(feeds, feed, loader_device))
                    cpu, dev_rate = median(cpu_rates), median(dev_rates)
                    add(
                        [
                            f"loader epoch, device={loader_device}, {where}",
                            None,
                            "same loader, device=cpu",
                            None,
                            dev_rate / cpu,
                            ">= 0.9",
                            f"{dev_rate / 1e9:.2f} vs {cpu / 1e9:.2f} GB/s",
                        ]
                    )
                resident = list(
                    itertools.islice(feeds.stream(feed_names[0], loader_device), feeds.per_epoch)
                )  # one epoch's batches, already on the device
                resident = [x.clone() for x in resident]
                steps, d_model = len(resident), feeds.d_model
                sae_seconds(
                    iter(resident * 2),
                    d_model=d_model,
                    steps=min(steps, 20),
                    rows=shape.rows,
                    device=device,
                    autocast=None,
                )  # warm-up: kernels, allocator
                for autocast in (None, "bfloat16"):
                    for feed in feed_names:
                        where = f"{shape.workers} workers" if feed == "workers" else feed
                        fed, on_device = [], []
                        for _ in range(max(1, args.repeats - 1)):
                            fed.append(
                                sae_seconds(
                                    feeds.stream(feed, loader_device),
                                    d_model=d_model,
                                    steps=steps,
                                    rows=shape.rows,
                                    device=device,
                                    autocast=autocast,
                                )
                            )
                            on_device.append(
                                sae_seconds(
                                    iter(resident),
                                    d_model=d_model,
                                    steps=steps,
                                    rows=shape.rows,
                                    device=device,
                                    autocast=autocast,
                                )
                            )
                        a, b = median(fed), median(on_device)
                        add(
                            [
                                f"SAE training fed by the loader ({where}), {autocast or 'fp32'}",
                                a,
                                "same training, batches already on the device",
                                b,
                                b / a,
                                ">= 0.95",
                                f"{steps} steps of {shape.rows} rows",
                            ]
                        )
                del resident
            finally:
                feeds.close()
            shutil.rmtree(kept_root)
            print(f"# loader and SAE done at {time.perf_counter() - started:.0f} s", flush=True)

        # 4. every layer stored
        if not args.skip_heavy:
            heavy = replace(
                base,
                sites=tuple(f"resid.{i}" for i in range(shape.layers)),
                max_tokens=shape.heavy_tokens,
            )
            fwd = run_capture(heavy, discard, copy_out=forward_only).seconds
            out = root / "store-heavy"
            run = run_capture(heavy, open_format("saev", out), out=out)
            raw_s = raw_write(root, run.nbytes)
            add(
                [
                    f"every layer to saev ({run.nbytes / 1e9:.1f} GB)",
                    run.seconds,
                    "raw write + fsync of the same bytes",
                    raw_s,
                    raw_s / run.seconds,
                    ">= 0.9",
                    f"forward alone {fwd:.2f} s; writer wait {run.writer_wait_s:.1f} s",
                ]
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - started
    print()
    print(
        table(
            ["what", "s", "baseline", "baseline s", "ratio", "goal", "notes"],
            [[("-" if v is None else v) for v in row] for row in rows],
        )
    )
    print(
        f"\n{record['device']}; {shape.tokens:,} tokens, contexts of {shape.context}, "
        f"batch {shape.batch}, sites {shape.sites}; medians of {args.repeats}; {total:.0f} s in all"
    )
    if args.json:
        record.update(rows=rows, seconds=total)
        args.json.write_text(json.dumps(record, indent=1, default=str))


def _device_name(cuda: bool) -> str:
    if not cuda:
        return f"CPU only ({os.cpu_count()} cores), --small"
    return f"{torch.cuda.get_device_name()} ({os.cpu_count()} cores), torch {torch.__version__}"


def _filesystem(path: Path) -> str:
    """The file system type of ``path`` (from /proc/mounts): the raw-write baseline's disk."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    except OSError:
        pass
    return f"{kind} at {best or '?'}"


if __name__ == "__main__":
    main()
