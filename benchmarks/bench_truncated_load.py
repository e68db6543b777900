"""Truncated loading against today's full load: bytes read from disk, peak RSS, load time.

A Llama-shaped checkpoint (built from a config, random weights, saved sharded in float32
like a hub checkpoint) is loaded in fresh processes, each starting with the checkpoint
evicted from the page cache (``POSIX_FADV_DONTNEED``), in turn:

- ``full``: capture's load before truncation, ``AutoModel.from_pretrained(dir, dtype)`` then
  ``.to("cpu")`` (the baseline);
- ``L=k``: :func:`actstore.capture.models.load_weights` of the model planned for a site in
  block ``k`` (blocks ``0..k`` only; ``k = n_layers - 1`` is every block, through the new
  route).

Two load dtypes: ``bfloat16`` converts every loaded tensor, so each is read and copied into
memory of the process (as a load onto a GPU copies it); ``float32``, the checkpoint's own
dtype, lets transformers map the file's pages into the model without a copy, so neither
path reads every byte at load time nor grows its RSS with the weights.

Per load: bytes the process read from the block device (``/proc/self/io`` read_bytes,
readahead included: 8 MiB windows on the machine measured), its peak RSS above what it held
before the load (VmHWM - VmRSS), and the wall time of the load. Each (dtype, mode) runs
``--repeats`` times, interleaved (the order rotates each round); medians are reported with
ratios to ``full`` of the same dtype and run, beside the goal: embeddings + (k+1)/n of the
block weights.

    python benchmarks/bench_truncated_load.py --layers 16 --hidden 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import evict, table


def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def _status(field: str) -> int:
    """Bytes of ``field`` (VmRSS, VmHWM) of /proc/self/status: this process's own memory
    (``ru_maxrss`` would also count the parent's, inherited through fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def child(ckpt: str, mode: str, dtype_name: str) -> None:
    """One load in this (fresh) process; prints a JSON line."""
    import torch
    import transformers

    # what both loads import or initialise lazily, before the baseline RSS is taken
    from transformers.models.llama import modeling_llama  # noqa: F401

    from actstore.capture.models import load_weights, plan_model

    transformers.AutoConfig.from_pretrained(ckpt)
    files = sorted(Path(ckpt).glob("*.safetensors"))
    evict(files)
    rss0, read0 = _status("VmRSS"), _io_read_bytes()
    start = time.perf_counter()
    if mode == "full":
        dtype = getattr(torch, dtype_name)
        module = transformers.AutoModel.from_pretrained(ckpt, dtype=dtype)
        module.eval().to("cpu")
    else:
        plan = plan_model(ckpt, sites=[f"resid.{int(mode[2:])}"], dtype=dtype_name)
        module = load_weights(plan)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    n_params = sum(p.numel() for p in module.parameters())
    print(
        json.dumps(
            {
                "mode": mode,
                "read": _io_read_bytes() - read0,
                "peak_rss": peak - rss0,
                "seconds": seconds,
                "params": n_params,
            }
        )
    )


def build(root: Path, args) -> tuple[Path, int, int]:
    """Save the checkpoint; (path, bytes of the embeddings, bytes of one block)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=args.vocab,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = root / "llama"
    model.save_pretrained(path, max_shard_size=args.shard)
    for file in path.glob("*.safetensors"):  # clean pages, so that eviction drops them
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    embed = model.model.embed_tokens.weight.numel() * 4
    block = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    return path, embed, block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard", default="50MB", help="max_shard_size of the saved checkpoint")
    ap.add_argument(
        "--deepest", default=None, help="comma-separated k (default: n/8, n/4, n/2, n-1)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dtypes", default="bfloat16,float32", help="load dtypes (the checkpoint is float32)"
    )
    ap.add_argument("--child", nargs=3, metavar=("CKPT", "MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    n = args.layers
    ks = (
        [int(k) for k in args.deepest.split(",")]
        if args.deepest
        else sorted({n // 8 - 1, n // 4 - 1, n // 2 - 1, n - 1})
    )
    modes = ["full"] + [f"L={k}" for k in ks]
    with tempfile.TemporaryDirectory(prefix="bench-trunc-", dir=os.environ.get("BENCH_DIR")) as tmp:
        ckpt, embed, block = build(Path(tmp), args)
        n_files = len(list(ckpt.glob("*.safetensors")))
        print(
            f"checkpoint: Llama-shaped, {n} blocks, hidden {args.hidden}, float32, "
            f"{n_files} shards; embeddings {embed / 2**20:.1f} MiB, one block "
            f"{block / 2**20:.2f} MiB"
        )
        results: dict[tuple[str, str], list[dict]] = {}
        env = {**os.environ, "TQDM_DISABLE": "1"}
        runs = [(d, m) for d in args.dtypes.split(",") for m in modes]
        for r in range(args.repeats):
            order = runs[r % len(runs) :] + runs[: r % len(runs)]
            for dtype, mode in order:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(ckpt), mode, dtype],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=True,
                )
                line = out.stdout.strip().splitlines()[-1]
                results.setdefault((dtype, mode), []).append(json.loads(line))
    print(f"medians of {args.repeats} interleaved runs, each in a fresh process, cold cache")
    for dtype in args.dtypes.split(","):
        print(f"\nload dtype {dtype} (float32 checkpoint)")
        report(results, dtype, modes, embed, block, n)
    print(
        "goal = (embeddings + (k+1) blocks) / (embeddings + n blocks): the bytes it needs\n"
        "peak RSS = the process's high-water mark (VmHWM) minus its RSS before the load"
    )


def report(results, dtype: str, modes: list[str], embed: int, block: int, n: int) -> None:
    med = {
        m: {
            k: statistics.median(x[k] for x in results[(dtype, m)])
            for k in ("read", "peak_rss", "seconds")
        }
        for m in modes
    }
    base = med["full"]
    rows = []
    for mode in modes:
        m = med[mode]
        goal = ""
        if mode != "full":
            goal = f"{(embed + (int(mode[2:]) + 1) * block) / (embed + n * block):.3f}"
        rows.append(
            [
                mode,
                f"{m['read'] / 2**20:.1f}",
                f"{m['read'] / max(base['read'], 1):.3f}",
                f"{m['peak_rss'] / 2**20:.1f}",
                f"{m['peak_rss'] / max(base['peak_rss'], 1):.3f}",
                f"{m['seconds']:.3f}",
                f"{m['seconds'] / base['seconds']:.3f}",
                goal,
            ]
        )
    header = ["load", "read MiB", "x full", "peak RSS MiB", "x full", "s", "x full", "goal"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
