"""Pictures of SAE latents: top examples per latent as PNGs and one static HTML page.

Example:
    >>> from actstore.runs import Run
    >>> from actstore.visuals import VisualsConfig, render_run
    >>> render_run(Run("runs/k3x9q2ab"), "val", VisualsConfig(n_latents=16))  # doctest: +SKIP
"""

from .render import VisualsConfig, render_run

__all__ = ["VisualsConfig", "render_run"]
