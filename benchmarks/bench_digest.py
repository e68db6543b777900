"""What a store's data identity costs (issue 30): the digest of the examples consumed,
each against a baseline measured in the same run.

1. packed text: ``token_digest`` of the packed contexts vs packing the embedded corpus
   (read, batched fast tokenizer, pack: what ``open_source`` does, the digest included);
2. image folders: ``files_digest`` of N JPEG files vs decoding and resizing the same files
   with PIL (the least a capture does with each image), both from the page cache.

Each pair is measured ``--repeats`` times interleaved and the median is reported.

    python benchmarks/bench_digest.py --images 300

With ``--weights`` (issue 38), the identity of a model's weights instead
(``actstore.capture.identity.weights_identity``: the bytes of the files loading reads),
from the page cache and from the disk (each file's pages dropped first with
``posix_fadvise(DONTNEED)``), for the embedded model and for a GPT-2-size checkpoint
(548 MB, as ``gpt2``'s ``model.safetensors``), against loading the embedded model:

    python benchmarks/bench_digest.py --weights
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _drop_pages(folder: str) -> None:
    """Evict ``folder``'s files from the page cache (their next read comes from the disk)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def weights(repeats: int) -> None:
    """The weights identity of the embedded model and of a GPT-2-size checkpoint, warm and
    cold, against loading the embedded model (blocks 0..5, float32, CPU)."""
    import json
    import shutil

    from actstore.capture import identity
    from actstore.capture.models import load_model
    from actstore.hub import resolve_checkpoint

    def timed(folder: str, cold: bool) -> float:
        def run() -> None:
            identity._DONE.clear()  # the per-process memo: every run reads the bytes
            if cold:
                _drop_pages(folder)
            identity.weights_identity(folder)

        return _median(run, repeats)

    load = _median(lambda: load_model("embedded", sites=["resid.5"]), repeats)
    with tempfile.TemporaryDirectory() as scratch:
        embedded = shutil.copytree(resolve_checkpoint("embedded"), os.path.join(scratch, "e"))
        gpt2 = os.path.join(scratch, "gpt2")
        os.mkdir(gpt2)
        with open(os.path.join(gpt2, "config.json"), "w") as f:
            json.dump({"model_type": "gpt2", "n_layer": 12, "n_embd": 768}, f)
        rng = np.random.default_rng(0)
        with open(os.path.join(gpt2, "model.safetensors"), "wb") as f:
            # 548 MB of incompressible bytes, as gpt2's file
            f.writelines(rng.bytes(1_000_000) for _ in range(548))
        for name, folder in (("embedded (90.9 MB)", embedded), ("GPT-2 size (548 MB)", gpt2)):
            size = sum(
                os.path.getsize(os.path.join(folder, n))
                for n in identity.weight_files(Path(folder))
            )
            warm, cold = timed(folder, False), timed(folder, True)
            print(
                f"weights {name}: {size / 1e6:.1f} MB digested; page cache {warm * 1e3:.0f} ms "
                f"({size / warm / 1e9:.2f} GB/s), disk {cold * 1e3:.0f} ms "
                f"({size / cold / 1e9:.2f} GB/s); loading the embedded model {load * 1e3:.0f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", action="store_true", help="the weights identity instead")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.weights:
        weights(args.repeats)
        return
    from PIL import Image
    from transformers import AutoTokenizer

    from actstore.capture import CaptureConfig
    from actstore.capture.data.digest import files_digest, token_digest
    from actstore.capture.modelfacts import read_model_config
    from actstore.capture.preflight import _stand_in
    from actstore.capture.runner import packed_source

    facts = read_model_config("embedded")
    model = _stand_in(facts, AutoTokenizer.from_pretrained(facts.path))
    config = CaptureConfig(model="embedded", dataset="embedded", sites=("resid.3",), progress=False)
    holder: dict = {}

    def pack() -> None:
        holder["ids"] = packed_source(config, model, facts.vocab_size).token_ids

    packing = _median(pack, args.repeats)
    ids = holder["ids"]
    digest = _median(lambda: token_digest(ids), args.repeats * 5)
    print(
        f"text: {ids.size:,} packed tokens; packing {packing * 1e3:.1f} ms (digest included), "
        f"digest {digest * 1e3:.3f} ms = {digest / packing:.3%} of it "
        f"({ids.nbytes / digest / 1e9:.1f} GB/s)"
    )
    with tempfile.TemporaryDirectory() as root:
        rng = np.random.default_rng(0)
        paths = []
        for i in range(args.images):
            noise = rng.random((375, 500, 3)) * 40
            pixels = (noise + np.linspace(0, 200, 500)[None, :, None]).astype(np.uint8)
            path = os.path.join(root, f"{i:05d}.jpg")
            Image.fromarray(pixels).save(path, quality=90)
            paths.append(path)
        size = sum(os.path.getsize(p) for p in paths)

        def decode() -> None:
            for p in paths:
                Image.open(p).convert("RGB").resize((224, 224))

        digests, decodes = [], []
        for _ in range(args.repeats):
            digests.append(_median(lambda: files_digest(paths, root), 1))
            decodes.append(_median(decode, 1))
        d, e = statistics.median(digests), statistics.median(decodes)
        print(
            f"images: {args.images} JPEGs 500x375 ({size / args.images / 1e3:.0f} KB each): "
            f"digest {d * 1e3:.0f} ms ({size / d / 1e9:.2f} GB/s), decode+resize "
            f"{e * 1e3:.0f} ms; digest = {d / e:.1%} of decoding"
        )


if __name__ == "__main__":
    main()
