"""``python -m actstore ...`` and ``python -c CODE ...`` as a real process per run, without
an interpreter start per run.

Starting the command costs seconds before it does anything (torch and transformers
import, and tearing them down at exit); the suite runs it a few hundred times.
:func:`run_python` hands each run to one helper process that imported those once and forks
a child per run. The child is a process of its own, as ``subprocess.run`` would start: its
own environment, working directory, ``sys.argv`` and ``sys.path`` (as ``-m``/``-c`` set
them), stdout and stderr, its own exit code (``os._exit`` at a crash point, a signal such
as ``kill -9``, signal handlers and ``atexit`` are its own). It runs the module or code as
the interpreter does (:func:`runpy.run_module`, ``exec``) and ends as the interpreter ends
it: an uncaught exception printed, ``SystemExit``'s code, non-daemon threads joined,
``atexit`` run, stdio flushed; only the tearing down of every module is skipped. The
helper never runs a torch operation, so no OpenMP pool is forked half-made (as
:mod:`actstore.testing.crash` does for the conformance kit).

What the helper imported saw its own environment: runs whose environments differ in what
is read at import time (:data:`IMPORT_TIME_PREFIXES`) are forked from different helpers
(:data:`MAX_HELPERS` kept). A run gets a fresh interpreter (``subprocess.run``) where no
helper could stand in for one: a ``PYTHONPATH`` entry that would shadow a module the helper
has imported, interpreter options (``-X importtime``: pass them and a fresh interpreter
honours them), or ``ACTSTORE_FORKED=0`` in this process's environment.

A run whose environment sets ``ACTSTORE_FORKED_PRELOAD`` (module names, comma separated)
is forked from a helper that imported those and nothing else: a run that makes installed
packages look absent first thing (``sys.modules[name] = None``) needs a helper that never
imported them, nor anything that asked whether they are there; ``torch`` is such a module.
"""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: Environment variables read when Python starts or when torch, transformers, tqdm or
#: actstore import: a run that sets them differently from the helper gets a fresh
#: interpreter (``PYTHONPATH`` is checked apart: see :func:`_shadowed`).
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS",
    "CUDA",
    "TORCH",
    "PYTORCH",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TQDM",
    "LD_",
    "XDG_CACHE_HOME",
    "HOME",
    "ACTSTORE_FORKED",
)

_lock = threading.Lock()
#: The helpers, by the import-time part of their environment (most recently used last):
#: a run is forked from the helper whose imports saw what a fresh interpreter of the
#: run's environment would see.
_helpers: dict[frozenset[tuple[str, str]], subprocess.Popen] = {}
#: Helpers kept at once (a run with an environment of its own starts one; the least
#: recently used goes).
MAX_HELPERS = 3
_NOT_FORKABLE = -(2**62) + 1
_TIMED_OUT = -(2**62)


def pythonpath() -> str:
    """``os.pathsep.join(sys.path)`` for a run's ``PYTHONPATH`` (the run imports what this
    process would), less the folders a package put on ``sys.path`` when it was imported:
    Ray's ``thirdparty_files`` (its own psutil and colorama), which a run that imports ray
    puts there itself. On ``PYTHONPATH`` that folder would shadow the psutil the helper
    imported, and every such run would need a fresh interpreter."""
    return os.pathsep.join(p for p in sys.path if not _added_on_import(p))


def _added_on_import(folder: str) -> bool:
    parts = Path(folder).parts
    return parts[-2:] == ("ray", "thirdparty_files")


def run_actstore(
    *args: Any,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = 300,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "actstore", *args], capture_output=True,
    text=text, env=env, cwd=cwd, timeout=timeout, check=False)``, forked from the helper."""
    return run_python("-m", "actstore", *args, env=env, cwd=cwd, timeout=timeout, text=text)


def run_python(
    *argv: Any,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=text, env=env,
    cwd=cwd, timeout=timeout, check=False)`` where ``argv`` is ``-m MODULE ARGS`` or
    ``-c CODE ARGS``, forked from the helper (else run as given)."""
    args = [str(a) for a in argv]
    cmd = [sys.executable, *args]
    environ = dict(os.environ if env is None else env)
    directory = os.path.abspath(cwd if cwd is not None else os.getcwd())
    forkable = args[:1] in (["-m"], ["-c"]) and len(args) >= 2 and _forkable(environ)
    if forkable:
        with tempfile.TemporaryDirectory(prefix="actstore-forked-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {
                "argv": args,
                "env": environ,
                "cwd": directory,
                "timeout": 1e9 if timeout is None else timeout,
                "stdout": out,
                "stderr": err,
            }
            with _lock:
                code = _ask(request)
            stdout = Path(out).read_bytes() if os.path.exists(out) else b""
            stderr = Path(err).read_bytes() if os.path.exists(err) else b""
    if not forkable or code == _NOT_FORKABLE:  # a fresh interpreter
        return subprocess.run(
            cmd,
            capture_output=True,
            text=text,
            env=environ,
            cwd=directory,
            timeout=timeout,
            check=False,
        )
    got: tuple[Any, Any] = (stdout, stderr)
    if text:  # as subprocess's text mode reads them (universal newlines)
        got = tuple(
            b.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") for b in got
        )
    if code == _TIMED_OUT:
        raise subprocess.TimeoutExpired(cmd, timeout or 0, output=got[0], stderr=got[1])
    return subprocess.CompletedProcess(cmd, code, *got)


def _forkable(environ: dict[str, str]) -> bool:
    return os.environ.get("ACTSTORE_FORKED") != "0" and hasattr(os, "fork")


def _import_time(environ: dict[str, str]) -> frozenset[tuple[str, str]]:
    """The part of ``environ`` read when Python starts or the helper imports (``PYTHONPATH``
    apart: see :func:`_shadowed`)."""
    return frozenset(
        (k, v)
        for k, v in environ.items()
        if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONPATH"
    )


def _ask(request: dict) -> int:
    key = _import_time(request["env"])
    helper = _helpers.pop(key, None)
    if helper is None or helper.poll() is not None:
        while len(_helpers) >= MAX_HELPERS:
            _stop(_helpers.pop(next(iter(_helpers))))
        env = {k: v for k, v in request["env"].items() if k != "PYTHONPATH"}
        helper = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        atexit.register(_stop, helper)
    _helpers[key] = helper
    assert helper.stdin is not None and helper.stdout is not None
    data = pickle.dumps(request)
    helper.stdin.write(struct.pack("<Q", len(data)) + data)
    helper.stdin.flush()
    reply = helper.stdout.read(8)
    if len(reply) != 8:
        del _helpers[key]
        raise RuntimeError(f"the forking helper died (exit {helper.wait()})")
    (code,) = struct.unpack("<q", reply)
    return code


def _stop(helper: subprocess.Popen) -> None:
    if helper.poll() is None:
        assert helper.stdin is not None
        helper.stdin.close()
        try:
            helper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            helper.kill()


# ---------------------------------------------------------------------------- the helper

#: The helper's ``sys.path`` less its own folder and ``PYTHONPATH``: the interpreter's.
_BASE_PATH: list[str] = []


def _serve() -> None:
    """Read requests on stdin, fork a child for each, answer its exit code on stdout."""
    import select
    import signal
    import time

    global _BASE_PATH
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    _BASE_PATH = [p for p in sys.path[1:] if p not in own]
    _preload()
    import gc

    gc.freeze()  # what the helper imported is never collected: a child's gc skips it
    while True:
        head = _read(requests, 8)
        if len(head) != 8:
            return
        (size,) = struct.unpack("<Q", head)
        request = pickle.loads(_read(requests, size))
        pythonpath = [
            os.path.abspath(e) for e in request["env"].get("PYTHONPATH", "").split(os.pathsep) if e
        ]
        if _shadowed(pythonpath):
            replies.write(struct.pack("<q", _NOT_FORKABLE))
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _exit_as_python_does(_run, request, pythonpath)
        deadline = time.monotonic() + request["timeout"]
        status = None
        pidfd = os.pidfd_open(pid)
        try:
            while status is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                select.select([pidfd], [], [], left)
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(raw)
        finally:
            os.close(pidfd)
        replies.write(struct.pack("<q", _TIMED_OUT if status is None else status))


def _shadowed(pythonpath: list[str]) -> bool:
    """Whether a ``PYTHONPATH`` folder holds a module by the name of one the helper has
    imported from elsewhere (a fresh interpreter would import that one instead)."""
    for folder in pythonpath:
        for name, module in list(sys.modules.items()):
            if "." in name or not getattr(module, "__file__", None):
                continue
            for candidate in (f"{name}.py", os.path.join(name, "__init__.py")):
                path = os.path.join(folder, candidate)
                if os.path.exists(path) and os.path.realpath(path) != os.path.realpath(
                    module.__file__
                ):
                    return True
    return False


def _run(request: dict, pythonpath: list[str]) -> None:
    """In the child: become the process ``python ARGV`` would be, and run it."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    option, target, *rest = request["argv"]
    # as Python sets them: sys.path[0] is the working directory for -m, '' for -c
    first = request["cwd"] if option == "-m" else ""
    sys.path[:] = [first, *pythonpath, *_BASE_PATH]
    if option == "-m":
        sys.argv = ["-m", *rest]  # run_module puts the module's path in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        import types

        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c


def _exit_as_python_does(main: Any, *args: Any) -> None:
    """Run ``main`` and end the process as the interpreter would end it: an uncaught
    exception printed (exit 1), ``SystemExit``'s code, non-daemon threads joined, ``atexit``
    run, what is left unreachable finalized, stdout and stderr flushed. Only the tearing
    down of every module is skipped (seconds with torch loaded)."""
    import atexit
    import contextlib
    import gc

    code = 1
    try:
        try:
            main(*args)
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - printed, as the interpreter prints it
            sys.excepthook(*sys.exc_info())
            code = 1
        for step in (threading._shutdown, atexit._run_exitfuncs, gc.collect):  # type: ignore[attr-defined]
            try:
                step()
            except BaseException:  # noqa: BLE001 - printed, as the interpreter prints it
                print(f"Exception ignored in {step.__qualname__}:", file=sys.stderr)
                sys.excepthook(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _read(stream: Any, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _preload() -> None:
    """What runs import before they do anything: the commands, torch, transformers' model
    machinery and the families the tests use, and the formats (imports only: no torch
    operation runs here); or only the modules ``ACTSTORE_FORKED_PRELOAD`` names."""
    import importlib

    only = os.environ.get("ACTSTORE_FORKED_PRELOAD")
    if only is not None:
        for name in filter(None, only.split(",")):
            importlib.import_module(name)
        return

    from actstore.cli import load_app

    load_app()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # transformers builds its table of checkpoint conversions (some thousand regular
    # expressions compiled: most of a second) the first time a process loads a model, and
    # keeps it: built here once (plain Python, no torch operation), each run finds it built
    # as it finds the modules imported, and what it holds is what the run would build
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return
    get_checkpoint_conversion_mapping("gpt2")


#: Imported by the helper (a run imports the rest itself).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "transformers.image_processing_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.image_processing_auto",
    *(
        f"transformers.models.{family}.modeling_{family}"
        for family in ("gpt2", "llama", "qwen2", "bert", "clip", "siglip", "dinov2")
    ),
    "tokenizers",
    "safetensors.torch",
    "PIL.Image",
    # what the saelens and zarr formats import when used, and a capture's checks
    "datasets",
    "zarr",
    "numcodecs",
    "pydantic.main",
    "pydantic.type_adapter",
    "pydantic.json_schema",
    "actstore.capture",
    "actstore.capture.preflight",
    "actstore.cli.capture_memo",
    "actstore.dist.run",
    "actstore.formats.identity",
    "actstore.capture.runner",
    "actstore.capture.models",
    "actstore.formats",
    *(f"actstore.formats.{name}" for name in ("saev", "pickle", "activault", "saelens", "zarr")),
)


if __name__ == "__main__":
    _serve()
