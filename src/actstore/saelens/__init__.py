"""Train with SAELens's own runner from an actstore saelens store, with no workarounds.

``sae_lens``'s ``LanguageModelSAETrainingRunner`` reads a saelens-format store as its
activation cache, but on its own it also loads ``model_name`` and wraps it with hook points
named after Hugging Face modules (which refuses ``blocks.L.hook_resid_post``), and it opens
``dataset_path`` with ``load_dataset``, which refuses the store's ``save_to_disk`` layout.
:func:`training_runner` builds the runner from the store alone:

- the config pieces the store already knows (:meth:`SaelensCache.config`):
  ``cached_activations_path``, ``hook_name`` (the store's column), ``context_size``,
  ``model_name`` (the captured checkpoint), ``dataset_path``, and W&B logging off unless
  asked for; ``d_in`` goes to the SAE's config;
- the dataset, the store's own ``token_ids`` as the ``input_ids`` column SAELens reads
  (:meth:`SaelensCache.dataset`);
- a model whose hook points carry the store's TransformerLens hook names
  (:class:`actstore.saelens.proxy.StoreModel`); it loads no weights unless it is run
  (SAELens runs it only for its evaluations, which it does only when logging to W&B).

Example:
    >>> from actstore.saelens import training_runner  # doctest: +SKIP
    >>> runner = training_runner("acts-gpt2", d_sae=16384, training_tokens=50_000_000,
    ...                          output_path="sae-out")  # doctest: +SKIP
    >>> sae = runner.run()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, MissingDependencyError
from ..sites import Site

__all__ = ["SaelensCache", "open_cache", "training_runner"]

#: The start of SAELens's warning that compares samples with tokens (see ``runner``).
_FEWER_SAMPLES = r"The training dataset contains fewer samples"


def _sae_lens() -> Any:
    try:
        import sae_lens
    except ImportError as err:
        raise MissingDependencyError(
            "'sae_lens' is not installed; install it with `pip install sae-lens` to train with "
            "SAELens's runner"
        ) from err
    return sae_lens


@dataclass(frozen=True)
class SaelensCache:
    """What SAELens's runner needs to know of one saelens-format store (see
    :func:`open_cache`)."""

    path: str
    """The store directory (``cached_activations_path``)."""
    hook_name: str
    """The column trained on: a TransformerLens hook name (``blocks.6.hook_resid_post``)."""
    site: Site
    """The actstore site that column holds."""
    d_in: int
    context_size: int
    n_examples: int
    model_name: str | None
    """The checkpoint captured (None for a cache SAELens wrote itself)."""
    family: str
    hooks: Mapping[str, Site]
    """Every column of the store and its site (the proxy model's hook points)."""
    n_model_layers: int

    def config(self, **changes: Any) -> dict[str, Any]:
        """Keyword arguments of ``LanguageModelSAERunnerConfig`` that describe this store,
        updated with ``changes`` (which win). Logging to W&B is off unless ``logger=`` says
        otherwise."""
        sae_lens = _sae_lens()
        values: dict[str, Any] = {
            "model_name": self.model_name,
            "model_class_name": "AutoModelForCausalLM",
            "hook_name": self.hook_name,
            "dataset_path": self.path,
            "is_dataset_tokenized": True,
            "streaming": False,
            "context_size": self.context_size,
            "use_cached_activations": True,
            "cached_activations_path": self.path,
            "logger": sae_lens.LoggingConfig(log_to_wandb=False),
        }
        values.update(changes)
        if values["model_name"] is None:
            raise ConfigError(
                f"{self.path} records no model (a cache SAELens wrote); pass model_name="
            )
        fixed = {
            "hook_name": self.hook_name,
            "context_size": self.context_size,
            "cached_activations_path": self.path,
        }
        for key, value in fixed.items():
            if values[key] != value:
                raise ConfigError(
                    f"{key}={values[key]!r} does not describe {self.path} (its {key} is "
                    f"{value!r}); choose the column with hook= instead"
                )
        return values

    def dataset(self) -> Any:
        """The store's own token ids as a ``datasets.Dataset`` with the ``input_ids`` column
        SAELens reads: exactly the captured contexts, in order."""
        import datasets

        table = datasets.load_from_disk(self.path)
        if "token_ids" not in table.column_names:
            raise ConfigError(f"{self.path} keeps no token_ids; SAELens's runner needs them")
        return table.select_columns(["token_ids"]).rename_column("token_ids", "input_ids")

    def model(
        self, device: str = "cpu", model_name: str | None = None, **from_pretrained_kwargs: Any
    ) -> Any:
        """A ``HookedRootModule`` whose hook points are the store's column names; the
        checkpoint (``model_name``, else the one captured) is loaded with
        ``AutoModelForCausalLM`` only when the model is first run."""
        from .proxy import StoreModel

        model_name = model_name or self.model_name
        if model_name is None:
            raise ConfigError(
                f"{self.path} records no model (a cache SAELens wrote); pass model_name="
            )
        return StoreModel(
            model_name,
            self.hooks,
            family=self.family,
            n_layers=self.n_model_layers,
            device=device,
            from_pretrained_kwargs=from_pretrained_kwargs,
        )

    def runner_config(self, sae: Any = None, *, d_sae: int | None = None, **changes: Any) -> Any:
        """A ``LanguageModelSAERunnerConfig`` for this store: ``sae`` (a training SAE
        config, ``d_in`` this store's) or, with ``d_sae``, a standard (ReLU) SAE of that
        width; ``changes`` as for :meth:`config`."""
        if sae is None:
            if d_sae is None:
                raise ConfigError("give sae= (a training SAE config) or d_sae= (its width)")
            from sae_lens.saes.standard_sae import StandardTrainingSAEConfig

            sae = StandardTrainingSAEConfig(d_in=self.d_in, d_sae=d_sae)
        elif d_sae is not None:
            raise ConfigError("give sae= or d_sae=, not both")
        if sae.d_in != self.d_in:
            raise ConfigError(f"the SAE's d_in is {sae.d_in}, but {self.path} has d_in {self.d_in}")
        return _sae_lens().LanguageModelSAERunnerConfig(sae=sae, **self.config(**changes))

    def runner(self, sae: Any = None, *, d_sae: int | None = None, **changes: Any) -> Any:
        """SAELens's ``LanguageModelSAETrainingRunner`` over this store, ready to ``run()``."""
        cfg = self.runner_config(sae, d_sae=d_sae, **changes)
        model = self.model(
            cfg.llm_device, cfg.model_name, **(cfg.model_from_pretrained_kwargs or {})
        )
        with warnings.catch_warnings():
            # SAELens compares the dataset's samples (contexts) with the training tokens,
            # so it warns of too few samples whenever training_tokens exceeds the number of
            # contexts; the comparison in tokens is made below instead
            warnings.filterwarnings("ignore", message=_FEWER_SAMPLES)
            runner = _sae_lens().LanguageModelSAETrainingRunner(
                cfg, override_dataset=self.dataset(), override_model=model
            )
        held = self.n_examples * self.context_size
        if held < cfg.training_tokens:
            warnings.warn(
                f"{self.path} holds {held:,} tokens ({self.n_examples:,} contexts of "
                f"{self.context_size}), fewer than training_tokens={cfg.training_tokens:,}: "
                "training goes over them more than once",
                stacklevel=2,
            )
        return runner


def open_cache(path: str | os.PathLike, hook: Any = None) -> SaelensCache:
    """Open the saelens-format store at ``path`` (a local directory, as SAELens reads it) for
    training on column ``hook`` (any site spelling; None: its only column)."""
    from ..formats.saelens import SaelensReader

    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(
            f"SAELens reads local caches only; copy {path} first (actstore cp {path} DIR)"
        )
    reader = SaelensReader(path)
    try:
        hooks = {c: reader.native_site(c) for c in reader.columns}
        if hook is None:
            if len(reader.columns) != 1:
                raise ConfigError(
                    f"{path} holds {len(reader.columns)} columns ({', '.join(reader.columns)}); "
                    "choose one with hook="
                )
            column = reader.columns[0]
        elif str(hook) in reader.columns:  # the column's own name, whatever it parses to
            column = str(hook)
        else:
            column = reader.column(hook)
        record = reader.record
        plan = reader.capture_plan() if record is not None else None
        return SaelensCache(
            path=path,
            hook_name=column,
            site=reader.native_site(column) or reader.site(column),
            d_in=reader.d_model,
            context_size=reader.context_size,
            n_examples=reader.n_examples,
            model_name=None if plan is None else plan.ckpt,
            family=reader.family,
            hooks={c: s for c, s in hooks.items() if s is not None},
            n_model_layers=0 if plan is None else plan.n_model_layers,
        )
    finally:
        reader.close()


def training_runner(
    store: str | os.PathLike,
    sae: Any = None,
    *,
    hook: Any = None,
    d_sae: int | None = None,
    **changes: Any,
) -> Any:
    """SAELens's ``LanguageModelSAETrainingRunner`` training on ``store`` (a saelens-format
    store; ``hook``: which of its columns, any site spelling), ready to ``run()``.

    ``sae``: a training SAE config of SAELens (any architecture; its ``d_in`` must be the
    store's), or ``d_sae``: the width of a standard SAE. ``changes``: any other field of
    ``LanguageModelSAERunnerConfig`` (``training_tokens``, ``train_batch_size_tokens``,
    ``output_path``, ``device``, ``logger``...). Nothing is downloaded and no model weights
    are loaded unless SAELens runs its evaluations (only when logging to W&B)."""
    return open_cache(store, hook).runner(sae, d_sae=d_sae, **changes)
