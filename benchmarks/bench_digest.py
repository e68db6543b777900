"""What a store's data identity costs (issue 30): the digest of the examples consumed,
each against a baseline measured in the same run.

1. packed text: ``token_digest`` of the packed contexts vs packing the embedded corpus
   (read, batched fast tokenizer, pack: what ``open_source`` does, the digest included);
2. image folders: ``files_digest`` of N JPEG files vs decoding and resizing the same files
   with PIL (the least a capture does with each image), both from the page cache.

Each pair is measured ``--repeats`` times interleaved and the median is reported.

    python benchmarks/bench_digest.py --images 300
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    from PIL import Image
    from transformers import AutoTokenizer

    from actstore.capture import CaptureConfig
    from actstore.capture.data.digest import files_digest, token_digest
    from actstore.capture.preflight import _stand_in, read_model_config
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
