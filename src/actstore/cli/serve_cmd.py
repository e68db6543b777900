"""``actstore serve``: one process reads a store once per epoch and feeds K trainer
processes on this machine through shared memory (see ``actstore.loader.serve``)."""

from __future__ import annotations

import typer

from .application import app


@app.command(
    epilog="""\b
Example (3 SAEs trained on the same stream, one disk pass per epoch):
  actstore serve actstore-data/<hash> --name sae --consumers 3 --epochs 4 --site 6
  # in each trainer process c = 0, 1, 2:
  #   for acts in ServedLoader("sae", consumer=c): ...
"""
)
def serve(
    store: str = typer.Argument(..., help="The store to serve: directory or URL."),
    name: str = typer.Option(..., help="Name consumers connect with: ServedLoader(NAME, c)."),
    consumers: int = typer.Option(1, help="K consumer processes; serving starts when all attach."),
    mode: str = typer.Option(
        "broadcast",
        help="broadcast: every consumer gets every batch; partition: consumer c gets "
        "batches c, c+K, ... of each epoch.",
    ),
    epochs: int = typer.Option(1, help="Serve epochs 0..EPOCHS-1 (0: until stopped)."),
    slots: int = typer.Option(
        None,
        help="Batches the shared ring holds: how far consumers may drift apart "
        "(default 8; partition: K + 8).",
    ),
    directory: str = typer.Option("/dev/shm", help="Where the shared ring files live."),
    site: str = typer.Option(None, help="Site to serve (default: the store's only site)."),
    batch_size: int = typer.Option(4096, help="Rows per batch."),
    seed: int = typer.Option(0, help="Shuffle seed."),
    pool_blocks: int = typer.Option(None, help="Blocks per shuffle window (default: 256 MiB)."),
    mix: int = typer.Option(
        1,
        help="Slabs per block: a window holds a slice of MIX times as many examples "
        "(same memory, smaller reads; see docs/loader.md).",
    ),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    normalize: str = typer.Option(None, help="standardize or mean_norm (stored statistics)."),
    drop_cls: bool = typer.Option(False, help="Leave out CLS-token rows."),
    io_threads: int = typer.Option(4, help="Threads reading blocks."),
) -> None:
    """Serve a store's shuffled stream to several trainer processes from one disk pass."""
    from ..formats import open_store
    from ..loader.serve import ServeConfig
    from ..loader.serve import serve as run_server

    # the sharing options are checked before the store is opened
    ServeConfig(
        name=name,
        consumers=consumers,
        mode=mode,
        slots=slots,
        epochs=epochs or None,
        directory=directory,
    )
    reader = open_store(store)
    # any spelling (5, resid.5, blocks.5.hook_resid_post); the loader resolves it
    chosen = site
    run_server(
        reader,
        name=name,
        consumers=consumers,
        mode=mode,
        epochs=epochs or None,
        slots=slots,
        directory=directory,
        site=chosen,
        batch_size=batch_size,
        seed=seed,
        pool_blocks=pool_blocks,
        mix=mix,
        dtype=dtype,
        normalize=normalize,
        drop_cls=drop_cls,
        io_threads=io_threads,
    )
