"""Do two checkouts write the same stores? Each writes one store per format from the same
synthetic capture (the conformance kit's, ``SOURCE_DATE_EPOCH`` fixed), in a process of
its own, and the files are compared byte for byte.

    python benchmarks/same_bytes.py --other /path/to/older/checkout/src

Prints, per format, "identical" or the files that differ. zarr's ``.zattrs`` records the
checkout's ``git_commit`` (the prompt/response spec asks for it), so it and the files
that digest it (``.zmetadata``, the root manifest) differ between two commits by design;
``--show`` prints the differing JSON lines.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = ("saev", "pickle", "saelens", "zarr", "activault")

CHILD = """
import hashlib, json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from actstore.testing import FormatCase, make_acts
from test_zarr_conformance import ZarrCase
out = Path(sys.argv[1])
digests = {{}}
for fmt in {formats!r}:
    case = ZarrCase(t_chunk=2) if fmt == "zarr" else FormatCase(fmt)
    plan = case.plan()
    case.write(str(out / fmt), plan, case.batches(plan, make_acts(plan)))
    digests[fmt] = {{
        p.relative_to(out / fmt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((out / fmt).rglob("*")) if p.is_file()
    }}
(out / "digests.json").write_text(json.dumps(digests))
"""


def write_all(src: Path, out: Path, formats: list[str]) -> dict[str, dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(src), "SOURCE_DATE_EPOCH": "1700000000"}
    code = CHILD.format(tests=str(HERE.parent / "tests"), formats=formats)
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True)
    return json.loads((out / "digests.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--other", type=Path, required=True, help="the other checkout's src/")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--show", action="store_true", help="print differing JSON files' lines")
    args = p.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        mine = write_all(HERE.parent / "src", Path(tmp) / "this", formats)
        other = write_all(args.other, Path(tmp) / "other", formats)
        for fmt in formats:
            names = sorted(set(mine[fmt]) | set(other[fmt]))
            diff = [n for n in names if mine[fmt].get(n) != other[fmt].get(n)]
            print(f"{fmt:10} {len(names):4} files: {'identical' if not diff else diff}")
            for name in diff if args.show else ():
                a, b = (Path(tmp) / w / fmt / name for w in ("this", "other"))
                if name.endswith((".json", ".zattrs", ".zmetadata")) and a.exists() and b.exists():
                    lines = difflib.unified_diff(
                        b.read_text().splitlines(), a.read_text().splitlines(), lineterm="", n=0
                    )
                    print("\n".join(f"    {x}" for x in list(lines)[2:12]))
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:16]
    print(f"this checkout's stores: {digest}")


if __name__ == "__main__":
    main()
