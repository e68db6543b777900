"""One disk pass, many trainers: one server reads a store once per epoch and feeds K
consumer processes on the same machine through a shared-memory ring of batches.

- **broadcast**: every consumer sees the same shuffled stream (K SAEs with different
  hyperparameters trained on the same data);
- **partition**: consumer ``c`` of ``K`` gets stream batches ``c, c + K, c + 2K, ...`` of
  each epoch: disjoint parts, together every row once (data parallel).

The stream is exactly :class:`~actstore.loader.ActivationLoader`'s (same options, same
seed: same batches), numbered globally ``g = epoch * M + k`` (``M`` batches per epoch).
Batch ``g`` lives in ring slot ``g % slots`` until every live consumer that needs it has
moved past it, so a slow consumer stalls the others only once it is ``slots`` batches
behind. Each consumer publishes its cursor (the oldest batch it still uses) and its pid;
the server skips consumers whose process has gone, so a dead consumer does not stop the
others, and a new process can take its place from its ``state_dict``.

Two files under ``directory`` (``/dev/shm``: memory, not disk) make up a server:
``actstore-serve-<name>.ctl`` (counters, one row per consumer and per slot, the server's
settings as JSON) and ``actstore-serve-<name>.ring`` (the batch slots). The server removes
them when it ends; consumers that still map them keep working until they are done.

Example:
    >>> # one process (or `actstore serve STORE --name sae --consumers 2`):
    >>> serve("acts/3f1c...", name="sae", consumers=2, epochs=3, batch_size=4096)  # doctest: +SKIP
    >>> # each trainer process:
    >>> stream = ServedLoader("sae", consumer=0)  # doctest: +SKIP
    >>> for epoch in range(3):  # doctest: +SKIP
    ...     for acts in stream: sae.step(acts)
"""

from __future__ import annotations

from .ring import MODES, STATE_VERSION, ServeConfig, ring_bytes
from .served import ServedLoader
from .server import Server, serve, start_server

__all__ = [
    "MODES",
    "STATE_VERSION",
    "ServeConfig",
    "ServedLoader",
    "Server",
    "ring_bytes",
    "serve",
    "start_server",
]
