"""Crash a format's writer at each of its fault points, rerun it, and keep the bytes: what
:meth:`~actstore.testing.ConformanceSuite.test_resume_after_a_crash_at_each_fault_point_is_byte_identical`
runs, for any format a :class:`~actstore.testing.FormatCase` drives.

:func:`crash_and_resume` hands the job to a helper process (``python -m
actstore.testing.crash --serve``, with ``SOURCE_DATE_EPOCH`` set) that imports actstore
once and forks a child per write, so each crash costs a fork, not an interpreter start;
the helper stays up for the next case with the same environment (one import for every
format of a test session):

1. the reference: the store written in one go, with ``ACTSTORE_FAULT_TRACE`` recording
   every fault point (:mod:`actstore.faults`) the writer reaches;
2. for each point reached (at its middle hit when it is reached more than once), and once
   more for a process killed between two batches: a child dies there with
   ``os._exit(137)``, like a ``kill -9``; a second child reruns the same write, resuming
   as capture does (from the batch holding ``writer.resume_from``);
3. a crash while resuming: killed at the most-reached point, then the rerun killed at
   that point's first hit, then a last rerun.

Each run's files are then read back through the store's own files layer (local or
``s3://``) and compared with the reference's, name by name and byte by byte. The case is
sent to the helper pickled, so its class must be importable there (a module on
``sys.path``, which the helper inherits) and its format must be found by name there: a
built-in format, an installed plugin (entry point), or one registered when the module
defining the case is imported.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..faults import CRASH_EXIT, ENV, TRACE_ENV

#: ``SOURCE_DATE_EPOCH`` of every write (a format that stamps a time must take it from there).
EPOCH = "1700000000"
#: Environment variable of a child that dies after writing this many batches.
DIE_AFTER = "ACTSTORE_KIT_DIE_AFTER"


@dataclass
class Run:
    """One crash and its rerun."""

    crash: str
    """``ACTSTORE_CRASH_AT`` (``name:hit``), or ``after batch k`` for a kill between batches."""
    out: str
    crash_code: int
    crash_stderr: str
    rerun_code: int = -1
    rerun_stderr: str = ""
    location: str = ""


@dataclass
class Outcome:
    """What :func:`crash_and_resume` found: the reference store and each run."""

    reference: str
    reference_out: str
    points: list[str]
    runs: list[Run] = field(default_factory=list)


def crash_and_resume(case: Any, root: Path, *, timeout: float = 1100) -> Outcome:
    """Run the crashes of ``case`` (a :class:`~actstore.testing.FormatCase`) under ``root``
    in the helper process; raise ``AssertionError`` with its output if it fails."""
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.pkl"
    with open(job, "wb") as f:
        pickle.dump({"case": case, "root": str(root)}, f)
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in (ENV, TRACE_ENV, DIE_AFTER):
        env.pop(name, None)
    code, output = _Helper.run(env, job, root / "helper.log", timeout)
    result = root / "result.json"
    if code != 0 or not result.exists():
        raise AssertionError(f"the crash helper failed (exit {code}):\n{output}")
    doc = json.loads(result.read_text())
    return Outcome(
        reference=doc["reference"],
        reference_out=doc["reference_out"],
        points=doc["points"],
        runs=[Run(**r) for r in doc["runs"]],
    )


class _Helper:
    """The helper process of this test process (one at a time, for one environment)."""

    proc: ClassVar[subprocess.Popen | None] = None
    env: ClassVar[dict[str, str]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def run(cls, env: dict[str, str], job: Path, log: Path, timeout: float) -> tuple[int, str]:
        """Run ``job`` in the helper (started for ``env`` if need be): (exit code, output).
        Exit code 0: done; else the helper is gone (killed at ``timeout``) or the job failed."""
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None or cls.env != env:
                cls.stop()
                cls.env = env
                cls.proc = subprocess.Popen(
                    [sys.executable, "-m", "actstore.testing.crash", "--serve"],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
                atexit.register(cls.stop)
            proc = cls.proc
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{job}\t{log}\n".encode())
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            reply = proc.stdout.readline() if ready else b""
            output = log.read_text(errors="replace") if log.exists() else ""
            if not reply.strip().isdigit():  # timed out, or the helper died
                proc.kill()
                rest = proc.communicate()[0].decode(errors="replace")
                cls.proc = None
                return proc.returncode or -1, f"{output}{reply.decode(errors='replace')}{rest}"
            return int(reply), output

    @classmethod
    def stop(cls) -> None:
        proc, cls.proc = cls.proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def store_bytes(location: str) -> dict[str, bytes]:
    """Every file of the store at ``location`` (local or ``s3://``): name -> bytes."""
    from ..storage.location import Location

    files = Location.parse(location).files(cache=False)
    try:
        return {name: bytes(files.read_bytes(name)) for name in sorted(files.list())}
    finally:
        files.close()


def differences(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """What differs between two stores' files, one line each."""
    out = [f"{n} only in the resumed store" for n in sorted(set(got) - set(want))]
    out += [f"{n} missing from the resumed store" for n in sorted(set(want) - set(got))]
    out += [f"{n} differs" for n in sorted(set(got) & set(want)) if got[n] != want[n]]
    return out


# ---------------------------------------------------------------------------- the helper


def _child(case: Any, plan: Any, batches: list, out: str, env: dict[str, str], log: Path) -> int:
    """Fork a child that writes ``batches`` to ``out`` (resuming), with ``env`` set;
    return its exit code. The store's location goes to ``<log>.where``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            os.environ.update(env)
            import torch

            torch.set_num_threads(1)  # no OpenMP pool inherited across fork
            die = int(env.get(DIE_AFTER, -1))
            writer, given = case.open_writer(out, plan, batches)
            if not writer.complete:
                start = writer.resume_from
                written = 0
                for batch in given:
                    if batch.example_ids[-1] < start:
                        continue  # as capture does: from the batch holding resume_from
                    if written == die:
                        os._exit(CRASH_EXIT)
                    writer.write(batch)
                    written += 1
            location = str(writer.close())
            Path(f"{log}.where").write_text(location)
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the log, then exit
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _host(job_path: str) -> None:
    from .data import make_acts

    with open(job_path, "rb") as f:
        job = pickle.load(f)
    case, root = job["case"], Path(job["root"])
    plan = case.plan()
    batches = case.batches(plan, make_acts(plan))

    def run(tag: str, env: dict[str, str], log_name: str = "") -> tuple[int, str, str]:
        """Write into ``root/tag/store`` in a child with ``env``: (exit code, its stderr,
        the location it published)."""
        log = root / f"{log_name or tag}.log"
        (root / tag).mkdir(exist_ok=True)
        code = _child(case, plan, batches, str(root / tag / "store"), env, log)
        where = Path(f"{log}.where")
        return code, log.read_text(), where.read_text() if where.exists() else ""

    trace = root / "trace.txt"
    code, err, reference = run("reference", {TRACE_ENV: str(trace)})
    if code != 0:
        raise SystemExit(f"the uninterrupted write failed (exit {code}):\n{err}")
    reached = trace.read_text().split() if trace.exists() else []
    counts: dict[str, int] = {}
    for name in reached:
        counts[name] = counts.get(name, 0) + 1
    crashes = [
        (f"{name}:{(n + 1) // 2}", {ENV: f"{name}:{(n + 1) // 2}"}) for name, n in counts.items()
    ]
    crashes.append((f"after batch {len(batches) // 2}", {DIE_AFTER: str(len(batches) // 2)}))
    runs = []
    for i, (what, env) in enumerate(crashes):
        tag = f"crash-{i}"
        code, err, _ = run(tag, env)
        done = Run(crash=what, out=str(root / tag / "store"), crash_code=code, crash_stderr=err)
        if code == CRASH_EXIT:
            done.rerun_code, done.rerun_stderr, done.location = run(tag, {}, f"{tag}-rerun")
        runs.append(done)
    if counts:  # killed again while resuming: at the first hit of the most-reached point
        busiest = max(counts, key=lambda n: (counts[n], n))
        first = f"{busiest}:{(counts[busiest] + 1) // 2}"
        tag = "crash-resuming"
        code, err, _ = run(tag, {ENV: first})
        done = Run(
            crash=f"{first}, then {busiest}:1 of the rerun",
            out=str(root / tag / "store"),
            crash_code=code,
            crash_stderr=err,
        )
        if code == CRASH_EXIT:
            again, err2, _ = run(tag, {ENV: f"{busiest}:1"}, f"{tag}-second")
            if again not in (0, CRASH_EXIT):  # 0: the rerun never reached it, and finished
                done.rerun_code, done.rerun_stderr = again, err2
            else:
                done.rerun_code, done.rerun_stderr, done.location = run(tag, {}, f"{tag}-rerun")
        runs.append(done)
    (root / "result.json").write_text(
        json.dumps(
            {
                "reference": reference,
                "reference_out": str(root / "reference" / "store"),
                "points": list(counts),
                "runs": [r.__dict__ for r in runs],
            }
        )
    )


def _serve() -> None:
    """Run the jobs named on stdin (``job<TAB>log`` lines) one by one, each with stdout and
    stderr in its log; answer each with its exit code on a line of stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        job_path, log = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        saved = os.dup(1), os.dup(2)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = 0
        try:
            _host(job_path)
        except SystemExit as stop:
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported through the log, as python would
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        replies.write(f"{code}\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        _host(sys.argv[1])
