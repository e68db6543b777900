"""``actstore serve``: one server process streams a store into shared memory and real
consumer processes read it: the same stream as ActivationLoader (broadcast), disjoint
parts (partition), exact resume after a restart, and a dead consumer not stopping the rest."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_loader import T, expected, write_store

from actstore.errors import ConfigError, ServeError
from actstore.loader import ActivationLoader
from actstore.loader.serve import ServedLoader, start_server

FORK = multiprocessing.get_context("fork")
OPTIONS = {"site": 5, "batch_size": 7, "pool_blocks": 3, "seed": 4}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("serve"), n=23)


def stream(reader, epochs, **options):
    loader = ActivationLoader(reader, return_index=True, **{**OPTIONS, **options})
    return [b.rows.tolist() for _ in range(epochs) for b in loader]


def consume(name, consumer, directory, out, epochs=1, state=None, stop=None, die=None):
    """A trainer process: read ``epochs`` epochs (or ``stop`` batches), save what it got."""
    loader = ServedLoader(name, consumer, directory=directory, return_index=True)
    if state is not None:
        loader.load_state_dict(state)
    rows, acts = [], []
    for _ in range(epochs):
        for batch in loader:
            if die is not None and len(rows) == die:
                os.kill(os.getpid(), signal.SIGKILL)  # dies holding a batch
            rows.append(batch.rows.tolist())
            acts.append(batch.acts.numpy().copy())
            if stop is not None and len(rows) == stop:
                break
        if stop is not None and len(rows) == stop:
            break
    with open(out, "wb") as f:
        pickle.dump({"rows": rows, "acts": acts, "state": loader.state_dict()}, f)
    loader.close()


def run_consumers(name, directory, tmp_path, jobs):
    procs, outs = [], []
    for c, kwargs in jobs:
        out = tmp_path / f"{name}-{c}-{len(outs)}.pkl"
        procs.append(FORK.Process(target=consume, args=(name, c, directory, out), kwargs=kwargs))
        outs.append(out)
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return procs, [pickle.loads(o.read_bytes()) if o.exists() else None for o in outs]


def check_values(acts, got):
    for x, r in zip(got["acts"], got["rows"]):
        np.testing.assert_array_equal(x, expected(acts, r, 1))


def test_broadcast_gives_every_consumer_the_loaders_stream(store, tmp_path):
    reader, acts = store
    server = start_server(
        reader,
        name="bc",
        consumers=2,
        slots=3,
        epochs=2,
        directory=tmp_path,
        context="fork",
        **OPTIONS,
    )
    _, got = run_consumers("bc", tmp_path, tmp_path, [(0, {"epochs": 2}), (1, {"epochs": 2})])
    server.join(30)
    assert server.exitcode == 0
    want = stream(reader, 2)
    for g in got:
        assert g["rows"] == want
        check_values(acts, g)
        assert (g["state"]["epoch"], g["state"]["batches"]) == (2, 0)
    assert not list(tmp_path.glob("actstore-serve-*"))  # the server cleaned up


def test_partition_gives_disjoint_parts_that_cover_the_epoch(store, tmp_path):
    reader, acts = store
    server = start_server(
        reader,
        name="pt",
        consumers=3,
        mode="partition",
        slots=4,
        directory=tmp_path,
        context="fork",
        **OPTIONS,
    )
    _, got = run_consumers("pt", tmp_path, tmp_path, [(c, {}) for c in range(3)])
    server.join(30)
    want = stream(reader, 1)
    for c, g in enumerate(got):
        assert g["rows"] == want[c::3]
        check_values(acts, g)
    rows = sorted(r for g in got for b in g["rows"] for r in b)
    assert rows == list(range(23 * T))


def test_partition_with_mix_serves_the_loaders_slab_stream(store, tmp_path):
    """``mix`` reaches the server like any loader option: consumers get its stream."""
    reader, acts = store
    options = {**OPTIONS, "mix": 3}
    server = start_server(
        reader,
        name="mx",
        consumers=2,
        mode="partition",
        slots=4,
        directory=tmp_path,
        context="fork",
        **options,
    )
    _, got = run_consumers("mx", tmp_path, tmp_path, [(c, {}) for c in range(2)])
    server.join(30)
    want = stream(reader, 1, mix=3)
    assert want != stream(reader, 1)
    for c, g in enumerate(got):
        assert g["rows"] == want[c::2] and g["state"]["mix"] == 3
        check_values(acts, g)


def test_each_consumer_resumes_from_its_own_state(store, tmp_path):
    reader, _ = store
    options = {**OPTIONS, "epochs": 2, "directory": tmp_path, "context": "fork", "slots": 2}
    server = start_server(reader, name="rs", consumers=2, **options)
    _, head = run_consumers(
        "rs", tmp_path, tmp_path, [(0, {"epochs": 2, "stop": 4}), (1, {"epochs": 2, "stop": 6})]
    )
    server.kill()  # the whole job stops (its files stay behind)
    server.join(30)
    server = start_server(reader, name="rs", consumers=2, **options)
    _, tail = run_consumers(
        "rs",
        tmp_path,
        tmp_path,
        [(c, {"epochs": 2, "state": head[c]["state"]}) for c in range(2)],
    )
    server.join(30)
    want = stream(reader, 2)
    for c in range(2):
        assert head[c]["rows"] + tail[c]["rows"] == want


def test_a_dead_consumer_does_not_stop_the_others(store, tmp_path):
    reader, acts = store
    server = start_server(
        reader, name="dd", consumers=2, slots=2, directory=tmp_path, context="fork", **OPTIONS
    )
    procs, got = run_consumers("dd", tmp_path, tmp_path, [(0, {}), (1, {"die": 2})])
    server.join(30)
    assert procs[1].exitcode == -signal.SIGKILL and got[1] is None
    assert got[0]["rows"] == stream(reader, 1)
    check_values(acts, got[0])
    assert server.exitcode == 0


def test_cli_serves_a_store(store, tmp_path):
    reader, _ = store
    env = {**os.environ, "ACTSTORE_LOG": "WARNING"}
    cmd = [sys.executable, "-m", "actstore", "serve", str(reader.path), "--name", "cli"]
    cmd += ["--consumers", "1", "--directory", str(tmp_path), "--site", "5"]
    cmd += ["--batch-size", "7", "--pool-blocks", "3", "--seed", "4"]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        loader = ServedLoader("cli", 0, directory=tmp_path, return_index=True, timeout_s=60)
        assert [b.rows.tolist() for b in loader] == stream(reader, 1)
        loader.close()
        assert server.wait(60) == 0
    finally:
        server.kill()
    bad = subprocess.run(
        [*cmd[:5], "--name", "x/y", "--consumers", "1"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "name" in bad.stderr and "Traceback" not in bad.stderr


def test_consumer_errors(store, tmp_path):
    with pytest.raises(ServeError, match="no server named 'none'"):
        ServedLoader("none", 0, directory=tmp_path, timeout_s=0.05)
    reader, _ = store
    server = start_server(
        reader, name="er", consumers=1, directory=tmp_path, context="fork", **OPTIONS
    )
    try:
        with pytest.raises(ConfigError, match=r"0\.\.0"):
            ServedLoader("er", 1, directory=tmp_path)
        loader = ServedLoader("er", 0, directory=tmp_path)
        with pytest.raises(ConfigError, match="not a ServedLoader state"):
            loader.load_state_dict({"epoch": 0})
        held = list(loader)  # keeps every batch: the ring stalls
        pytest.fail(f"held {len(held)} batches without an error")
    except ServeError as err:
        assert "clone()" in str(err)
    finally:
        server.kill()
        server.join(30)


def test_batches_are_ring_slots_and_held_ones_stay_intact(store, tmp_path):
    """The server gathers each batch straight into its ring slot and consumers get views
    of the slot (no copy on either side); a slot is rewritten only once every consumer has
    let go of its batch."""
    reader, acts = store
    server = start_server(
        reader, name="zc", consumers=1, epochs=3, directory=tmp_path, context="fork", **OPTIONS
    )
    loader = ServedLoader("zc", 0, directory=tmp_path, return_index=True)
    ring = (
        loader.shared.ring.ctypes.data,
        loader.shared.ring.ctypes.data + loader.shared.ring.nbytes,
    )
    held, in_ring, rows = [], 0, []
    try:
        for _ in range(3):
            for batch in loader:
                in_ring += ring[0] <= batch.acts.data_ptr() < ring[1]
                held = [*held[-2:], batch]  # the last three batches stay referenced
                for x, r in held:  # ... and unchanged while the server moves on
                    np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 1))
                rows.append(batch.rows.tolist())
    finally:
        loader.close()
        server.join(30)
    assert server.exitcode == 0
    assert rows == stream(reader, 3)
    assert in_ring == len(rows)  # every batch a view of the ring


def test_a_directory_too_small_for_the_ring_is_one_clear_error(store, tmp_path, monkeypatch):
    """The ring's files are sparse: a server refuses to start, in one line, where they could
    not be filled (the file system's free space is what the OS reports: faked here)."""
    from actstore.loader.serve import ServeConfig, Server

    reader, _ = store
    statvfs = os.statvfs

    def tiny(path):
        got = statvfs(path)
        return os.statvfs_result((*got[:4], 1, *got[5:])) if str(path) == str(tmp_path) else got

    monkeypatch.setattr(os, "statvfs", tiny)
    server = Server(
        reader, ServeConfig(name="full", consumers=1, directory=str(tmp_path)), **OPTIONS
    )
    with pytest.raises(ServeError, match=r"the ring needs \d+ MiB under .* but 0 MiB is free"):
        server.run()
    assert not list(tmp_path.glob("actstore-serve-*"))


def consume_and_leave(name, directory, out):
    """A trainer that takes every batch and exits without close(), its last batch still
    referenced (as after ``for acts in loader: ...``)."""
    loader = ServedLoader(name, 0, directory=directory, return_index=True)
    rows = []
    for batch in loader:
        rows.append(batch.rows.tolist())
    with open(out, "wb") as f:
        pickle.dump(rows, f)
    os._exit(0)  # no close(), no cleanup: the server sees the process gone


def test_a_normal_end_is_quiet(store, tmp_path):
    """A consumer that took its last batch and exited is a normal end: the server finishes
    without a word (a consumer gone before its last batch is warned about: the test above)."""
    reader, _ = store
    env = {**os.environ, "ACTSTORE_LOG": "INFO"}
    cmd = [sys.executable, "-m", "actstore", "serve", str(reader.path), "--name", "quiet"]
    cmd += ["--consumers", "1", "--directory", str(tmp_path), "--site", "5"]
    cmd += ["--batch-size", "7", "--pool-blocks", "3", "--seed", "4"]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        out = tmp_path / "rows.pkl"
        trainer = FORK.Process(target=consume_and_leave, args=("quiet", tmp_path, out))
        trainer.start()
        trainer.join(60)
        assert trainer.exitcode == 0
        assert pickle.loads(out.read_bytes()) == stream(reader, 1)
        _, log = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 0, log
    assert "gone" not in log and "WARNING" not in log, log


def test_consumers_move_batches_to_a_device_exactly_once(store, tmp_path):
    """``device=``: batches arrive copied (the next one's copy started before this one is
    handed out), the stream and the position stay exact (device="cpu" runs the same
    pipeline as "cuda", with a thread doing the copies)."""
    reader, acts = store
    server = start_server(
        reader, name="dv", consumers=1, epochs=2, directory=tmp_path, context="fork", **OPTIONS
    )
    try:
        loader = ServedLoader("dv", 0, directory=tmp_path, return_index=True, device="cpu")
        ring = (
            loader.shared.ring.ctypes.data,
            loader.shared.ring.ctypes.data + loader.shared.ring.nbytes,
        )
        rows = []
        for batch in loader:
            assert not ring[0] <= batch.acts.data_ptr() < ring[1]  # a copy, not the ring
            np.testing.assert_array_equal(batch.acts.numpy(), expected(acts, batch.rows, 1))
            rows.append(batch.rows.tolist())
            if len(rows) == 3:
                assert loader.state_dict()["batches"] == 3  # the batch fetched ahead is not counted
                break
        state = loader.state_dict()
        loader.close()
        again = ServedLoader("dv", 0, directory=tmp_path, return_index=True, device="cpu")
        again.load_state_dict(state)
        for _ in range(2):
            rows += [b.rows.tolist() for b in again]
        again.close()
        server.join(30)
    finally:
        server.kill()
    assert rows == stream(reader, 2)


def test_a_consumer_that_cannot_pin_the_ring_stages_every_batch_exactly(store, tmp_path):
    """The fallback of a CUDA consumer whose ring cannot be pinned (a ring on a disk file
    system, ``ulimit -l``), forced here with ``staging=True``: every batch is copied out of
    the ring into a reused staging buffer, then to the device; the stream stays exact."""
    reader, acts = store
    server = start_server(
        reader, name="st", consumers=1, epochs=2, directory=tmp_path, context="fork", **OPTIONS
    )
    try:
        loader = ServedLoader(
            "st", 0, directory=tmp_path, return_index=True, device="cpu", staging=True
        )
        assert loader.staging
        rows = []
        for _ in range(2):
            for batch in loader:
                np.testing.assert_array_equal(batch.acts.numpy(), expected(acts, batch.rows, 1))
                rows.append(batch.rows.tolist())
        assert loader.staged_batches == len(rows)
        loader.close()
        server.join(30)
    finally:
        server.kill()
    assert rows == stream(reader, 2)
    with pytest.raises(ConfigError, match="staging=True copies batches on their way to a device"):
        ServedLoader("st2", 0, directory=tmp_path, staging=True, timeout_s=0)


def paced(name, consumer, directory, allow, counts):
    """A trainer that takes batch ``b`` only once ``b < allow.value`` (the test sets how far
    it may run ahead), counting what it received in ``counts[consumer]``."""
    loader = ServedLoader(name, consumer, directory=directory)
    while True:
        try:
            for _ in loader:
                counts[consumer] += 1
                while counts[consumer] >= allow.value:
                    time.sleep(0.001)
        except ServeError:
            break  # the server finished its epochs
    loader.close()


def rejoiner(name, directory, saved, out, die_after):
    """Consumer 2, restarted from its saved state each time: saves each batch's rows and
    values and its state after every batch, and dies (kill -9) after ``die_after``."""
    loader = ServedLoader(name, 2, directory=directory, return_index=True)
    if saved.exists():
        loader.load_state_dict(pickle.loads(saved.read_bytes()))
    got = []
    try:
        while True:
            for batch in loader:
                got.append((batch.rows.numpy().copy(), batch.acts.numpy().copy()))
                out.write_bytes(pickle.dumps(got))
                saved.write_bytes(pickle.dumps(loader.state_dict()))
                if len(got) == die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
    except ServeError as err:
        out.write_bytes(pickle.dumps([*got, str(err)]))


def test_a_consumer_killed_and_rejoined_at_many_points_gets_exactly_its_rows(store, tmp_path):
    """Broadcast: consumer 2 is killed (kill -9) at many points and restarted from its saved
    state while the other two run ahead of it by 0 to 20 batches. Every batch it gets after
    a rejoin holds exactly the values of its rows; a position the server no longer holds is
    refused in one line (the trial that found this got other batches' values)."""
    reader, acts = store
    options = {**OPTIONS, "batch_size": 3, "pool_blocks": 2}
    server = start_server(
        reader,
        name="rj",
        consumers=3,
        slots=40,
        epochs=3,
        directory=tmp_path,
        context="fork",
        **options,
    )
    allow, counts = FORK.Value("q", 2, lock=False), FORK.Array("q", 2, lock=False)
    others = [FORK.Process(target=paced, args=("rj", c, tmp_path, allow, counts)) for c in (0, 1)]
    for p in others:
        p.start()
    saved, position, results = tmp_path / "state.pkl", 0, []
    try:
        for i, (die_after, lead) in enumerate(
            [(2, 0), (3, 0), (4, 0), (2, 0), (3, 1), (2, 3), (5, 6), (3, 9), (4, 14), (3, 20)]
        ):
            # the others run to `lead` batches past where consumer 2 resumes, and hold
            # there while it rejoins (at first the server waits for all three to attach)
            allow.value = position + lead + 1
            deadline = time.monotonic() + 30
            while position and min(counts) < allow.value and time.monotonic() < deadline:
                time.sleep(0.001)
            out = tmp_path / f"rejoin-{i}.pkl"
            proc = FORK.Process(target=rejoiner, args=("rj", tmp_path, saved, out, die_after))
            proc.start()
            proc.join(60)
            got = pickle.loads(out.read_bytes())
            results += [g for g in got if not isinstance(g, str)]
            if isinstance(got[-1], str):  # refused: the position left the ring
                assert "no longer held" in got[-1] and "restart the server" in got[-1], got[-1]
                # the others hold their cursors, and the server `slots` batches past
                # them: 0 behind them, consumer 2's batch is always held; further
                # behind, only if it is back before the server finds it gone
                assert lead > 0, f"a rejoin {lead} batches behind was refused: {got[-1]}"
                break
            assert proc.exitcode == -signal.SIGKILL
            position += die_after
        assert len(results) >= 2 + 3 + 4 + 2  # the rejoins 0 batches behind worked
        rows = [r.tolist() for r, _ in results]
        assert rows == stream(reader, 3, **options)[: len(rows)]
        for r, x in results:  # every value is its row's
            np.testing.assert_array_equal(x, expected(acts, r, 1))
    finally:
        allow.value = 1 << 40
        server.kill()
        for p in others:
            p.kill()
        server.join(30)


def test_a_server_waiting_for_room_in_its_ring_stops_on_ctrl_c(store, tmp_path):
    """The server gathers batches one ahead on a thread, waiting there for a ring slot
    while its consumer holds every one: Ctrl-C (SIGINT) still ends it, files removed."""
    reader, _ = store
    server = start_server(
        reader, name="ci", consumers=1, slots=2, directory=tmp_path, context="fork", **OPTIONS
    )
    try:
        loader = ServedLoader("ci", 0, directory=tmp_path)
        next(iter(loader))  # then holds its place: the ring stays full
        ring = tmp_path / "actstore-serve-ci.ring"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ring.exists():
            time.sleep(0.01)
        time.sleep(0.5)  # the server is now waiting for room
        os.kill(server.pid, signal.SIGINT)
        server.join(20)
        assert server.exitcode is not None, "the server did not stop on SIGINT"
        assert not ring.exists()
        loader.close()
    finally:
        server.kill()
