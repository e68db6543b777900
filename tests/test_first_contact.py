"""First contact (issue 38, items 9 and 10): a corpus line that is not UTF-8, and a capture
onto a disk that fills up, each end in one ``error:`` line (exit 2), never a traceback.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import assert_one_line_error, run_cli, snapshot

pytestmark = pytest.mark.slow  # the real command, a process of its own

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize(
    ("name", "line", "says"),
    [
        ("corpus.jsonl", b'{"text": "caf\xe9 au lait"}\n', "corpus.jsonl:2 is not UTF-8 text"),
        ("corpus.txt", b"caf\xe9 au lait\n", "corpus.txt:2 is not UTF-8 text"),
        ("corpus.jsonl", b'{"text": ' + b"[" * 50_000 + b"\n", "corpus.jsonl:2 is not valid JSON"),
        ("corpus.jsonl", b'{"text": 1' + b"0" * 5000 + b"}\n", "corpus.jsonl:2 is not valid JSON"),
    ],
    ids=["jsonl-latin-1", "txt-latin-1", "jsonl-deep", "jsonl-5000-digits"],
)
def test_a_corpus_line_actstore_cannot_read_is_one_line(tmp_path, model_dir, name, line, says):
    """A JSONL corpus with a line that is not UTF-8 (was: a UnicodeDecodeError traceback;
    the same bytes in a .txt gave one line), or nested or numbered past the parser's
    bounds: one error line naming the file and line, exit 2, nothing written."""
    corpus = tmp_path / name
    first = b'{"text": "Lists are sequences."}\n' if name.endswith(".jsonl") else b"Lists.\n"
    corpus.write_bytes(first + line + first)
    before = snapshot(tmp_path)
    proc = run_cli(
        "capture",
        "--model",
        str(model_dir("gpt2")),
        "--dataset",
        str(corpus),
        "--out",
        str(tmp_path / "out"),
        "--context-length",
        "8",
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert_one_line_error(proc, says)
    assert snapshot(tmp_path) == before


def pickle_capture(model_dir, text_file, out: Path, *extra: str) -> list[str]:
    """The command line of a 400-example pkl.gz capture of layers 1 and 3 into ``out``."""
    return [
        *(sys.executable, "-m", "actstore", "capture", "--model", str(model_dir("gpt2"))),
        *("--dataset", str(text_file), "--layers", "1,3", "--format", "pickle", *extra),
        *("--max-examples", "400", "--context-length", "64", "--no-space-check"),
        *("--no-progress", "--out", str(out)),
    ]


#: Inside a mount namespace of its own: a 3 MiB tmpfs as the output; a pkl.gz capture of
#: about 6 MB fills it; the store is then listed, the tmpfs grown, and the same command
#: rerun. Prints one JSON line of what happened.
_FULL_DISK = r"""
set -u
disk="$1"; shift
mount -t tmpfs -o size=3m tmpfs "$disk" || exit 77
"$@" > "$disk.first.out" 2> "$disk.first.err"; first=$?
kept=$(ls "$disk"/.acts.partial 2>/dev/null | grep -c '^shard_')
published=$(ls "$disk"/acts/actstore-manifest.json 2>/dev/null | wc -l)
mount -o remount,size=64m "$disk"
"$@" > "$disk.again.out" 2> "$disk.again.err"; again=$?
python -m actstore verify "$disk/acts" --no-progress > /dev/null 2> "$disk.verify.err"; verify=$?
printf '{"first": %s, "kept": %s, "published": %s, "again": %s, "verify": %s}\n' \
    "$first" "$kept" "$published" "$again" "$verify"
"""


def test_pickle_onto_a_full_disk_is_one_line_and_keeps_what_was_stored(
    tmp_path, model_dir, text_file
):
    """``--format pickle`` onto a disk that fills up mid capture (was: an ``OSError:
    [Errno 28]`` traceback; saev gave one line): one line saying what failed and what to
    do, exit 2; the finished shards stay in the unfinished store; with room again, the
    same command resumes and publishes a store that verifies. The disk is a small tmpfs in
    a mount namespace of this test's own (``unshare``); where the system allows none, the
    test is skipped (tests/test_direct_writes.py checks a refused write under a file-size
    limit)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = pickle_capture(model_dir, text_file, disk / "acts", "--opt", "samples_per_shard=50")
    env = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            "unshare",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            _FULL_DISK,
            "sh",
            str(disk),
            *command,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if proc.returncode == 77 or "unshare:" in proc.stderr:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()[-200:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    err = Path(f"{disk}.first.err").read_text()
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert result["first"] == 2 and len(errors) == 1, err
    assert "No space left on device" in errors[0] and "rerun the same command" in errors[0]
    assert result["kept"] >= 1 and result["published"] == 0, result
    assert result["again"] == 0, Path(f"{disk}.again.err").read_text()[-2000:]
    assert result["verify"] == 0, Path(f"{disk}.verify.err").read_text()[-2000:]


def test_a_file_size_limit_while_finishing_is_one_line(tmp_path, model_dir, text_file):
    """The same where no mount namespace can be made: a file-size limit (the kernel's own
    ``EFBIG``) refuses the pkl.gz shard written as the capture finishes: one line, exit 2,
    nothing published."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))

    out = tmp_path / "acts"
    proc = subprocess.run(
        pickle_capture(model_dir, text_file, out),
        preexec_fn=limit,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"},
        timeout=600,
        check=False,
    )
    assert_one_line_error(proc, "the writer failed: [Errno 27] File too large")
    assert not list(tmp_path.rglob("actstore-manifest.json"))
