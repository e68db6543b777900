"""Activault layout pieces, pinned: hook names, file names, megabatch bytes, JSON documents,
token cleaning and the stream-position bookkeeping behind exact resume."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch

from actstore.capture.cleaning import TokenCleaner, template_prefix_ids
from actstore.errors import ConfigError, CorruptStoreError
from actstore.formats.activault.layout import (
    check_hook_prefixes,
    data_file_name,
    group_uuid,
    hook_name,
    hook_site,
    load_megabatch,
    parse_data_file,
    parse_dtype,
    serialize_megabatch,
)
from actstore.formats.activault.metadata import (
    HookMetadata,
    statistics_from_dict,
    statistics_to_dict,
)
from actstore.formats.activault.upload import Position
from actstore.sites import SITE_KINDS, Site
from actstore.stats import RunningStats

NAMED_KINDS = [k for k in SITE_KINDS if k != "resid_mid"]  # Activault names no resid_mid


def test_hook_names_follow_activault_and_round_trip():
    assert hook_name("mlp_out.24") == "models.layers.24.mlp.post"
    assert hook_name("mlp_in.24") == "models.layers.24.mlp.pre"
    assert hook_name("attn_out.24") == "models.layers.24.self_attn.post"
    assert hook_name("attn_in.24") == "models.layers.24.self_attn.pre"
    assert hook_name("resid.24") == "models.layers.24.post"
    assert hook_name("resid_pre.24") == "models.layers.24.pre"
    with pytest.raises(ConfigError, match="Activault has no hook name for resid_mid.2"):
        hook_name("resid_mid.2")
    for kind in NAMED_KINDS:
        for layer in (0, 1, 10, 79):
            assert hook_site(hook_name(Site(kind, layer))) == Site(kind, layer)
    assert hook_site("blocks.7.hook_resid_post") == Site("resid", 7)  # Activault's old naming
    assert hook_site("something.else") is None
    with pytest.raises(ConfigError, match="negative"):
        hook_name("resid.-1")


def test_no_generated_hook_name_is_a_prefix_of_another():
    check_hook_prefixes(hook_name(Site(k, layer)) for k in NAMED_KINDS for layer in range(120))


def test_prefix_collisions_are_refused():
    with pytest.raises(ConfigError, match="prefix of 'models.layers.1.mlp.pre_ln'"):
        check_hook_prefixes(["models.layers.1.mlp.pre", "models.layers.1.mlp.pre_ln"])
    with pytest.raises(ConfigError, match="invalid hook folder"):
        check_hook_prefixes(["a/b"])


def test_file_names_ours_and_activaults():
    u = "0f909221-ff28-4a94-a43f-cfe973e835cf"
    assert data_file_name(u, 1) == f"{u}--1.pt"
    assert parse_data_file(f"{u}--12.pt").n == 12
    native = parse_data_file(f"{u}--5_0.saved.pt")
    assert (native.uuid, native.n, native.job) == (u, 5, "0")
    assert parse_data_file(f"{u}--5_123456.saved.pt").job == "123456"
    for bad in ("metadata.json", f"{u}--x.pt", f"{u}.pt", "README", f".{u}--1.pt.tmp"):
        assert parse_data_file(bad) is None
    with pytest.raises(ConfigError):
        data_file_name(u, 0)
    # group uuids: canonical form, shared by construction, different per group and run
    run = "6f1c0d3e-1111-4222-8333-444455556666"
    assert parse_data_file(data_file_name(group_uuid(run, 3), 4)).uuid == group_uuid(run, 3)
    assert len({group_uuid(run, g) for g in range(100)}) == 100
    assert group_uuid(run, 0) != group_uuid("6f1c0d3e-1111-4222-8333-444455556667", 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_megabatch_size_depends_only_on_shape_and_dtype(dtype):
    """Activault's reader downloads exactly bytes_per_file of every file: torch.save output
    for equal shapes must be equal in size whatever the values (NaN/inf included)."""
    rng = torch.Generator().manual_seed(0)
    sizes = set()
    for i in range(12):
        states = (torch.randn(3, 5, 7, generator=rng) * 10 ** (i % 5)).to(dtype)
        if i == 3:
            states[0, 0, 0] = float("nan")
            states[1, 1, 1] = float("inf")
        ids = torch.randint(0, 2**40 if i % 2 else 10, (3, 5), generator=rng)
        sizes.add(len(serialize_megabatch(states, ids).getbuffer()))
    assert len(sizes) == 1


def test_megabatch_bytes_are_a_torch_archive_activault_loads():
    states = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    ids = torch.arange(6).reshape(2, 3)
    # a view of a bigger tensor must not drag its whole storage into the file
    big = torch.zeros(10, 3, 4, dtype=torch.bfloat16)
    big[:2] = states
    data = serialize_megabatch(big[:2], ids).getvalue()
    assert len(data) == len(serialize_megabatch(states, ids).getvalue())
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "archive/data.pkl" in names and "archive/data/0" in names
    loaded = torch.load(io.BytesIO(data), weights_only=True)  # what S3RCache.compile does
    assert list(loaded) == ["states", "input_ids", "tensor_bytes"]
    assert torch.equal(loaded["states"], states) and loaded["states"].dtype == torch.bfloat16
    assert torch.equal(loaded["input_ids"], ids) and loaded["input_ids"].dtype == torch.int64
    assert loaded["tensor_bytes"] == 24 * 2 + 6 * 8
    mb = load_megabatch(data, source="x")
    assert torch.equal(mb["states"], states)


def test_load_megabatch_refuses_damage_and_code():
    with pytest.raises(CorruptStoreError, match="not a loadable megabatch"):
        load_megabatch(b"garbage" * 10, source="f.pt")
    data = serialize_megabatch(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)).getvalue()
    with pytest.raises(CorruptStoreError):
        load_megabatch(data[:-40], source="f.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buffer = io.BytesIO()
    torch.save({"states": torch.zeros(1), "x": Evil()}, buffer)
    with pytest.raises(CorruptStoreError, match="weights_only|Unsupported|global"):
        load_megabatch(buffer.getvalue(), source="evil.pt")
    bare = io.BytesIO()
    torch.save(torch.ones(1, 2, 3), bare)  # Activault's oldest files: a bare tensor
    assert load_megabatch(bare.getvalue(), source="old.pt")["input_ids"] is None


def test_metadata_json_matches_activaults_keys_and_order():
    md = HookMetadata.for_shape(
        rows=128, seq=2048, d=8192, dtype="torch.float16", batches_per_file=32
    ).with_bytes(4_297_000_000)
    doc = md.to_dict()
    assert list(doc) == [
        "batch_size",
        "sequence_length",
        "dtype",
        "d_in",
        "batches_per_file",
        "shape",
        "input_ids_shape",
        "bytes_per_file",
    ]
    assert doc["shape"] == [128, 2048, 8192] and doc["input_ids_shape"] == [128, 2048]
    assert HookMetadata.from_dict(json.loads(json.dumps(doc)), source="m") == md
    no_bytes = {k: v for k, v in doc.items() if k != "bytes_per_file"}
    with pytest.raises(CorruptStoreError, match="bytes_per_file"):
        HookMetadata.from_dict(no_bytes, source="m")
    with pytest.raises(CorruptStoreError, match="input_ids_shape"):
        HookMetadata.from_dict({**doc, "input_ids_shape": [1, 2]}, source="m")
    with pytest.raises(CorruptStoreError, match="dtype"):
        HookMetadata.from_dict({**doc, "dtype": "__import__('os')"}, source="m")
    assert parse_dtype("torch.bfloat16") == torch.bfloat16


def test_statistics_json_is_activaults_plus_count_and_exact():
    rows = np.random.default_rng(0).standard_normal((50, 4)) * [1, 2, 3, 4]
    stats = RunningStats.of(rows)
    doc = json.loads(json.dumps(statistics_to_dict(stats)))
    assert list(doc) == ["mean", "std", "norm", "M2", "count"]
    np.testing.assert_allclose(doc["std"], rows.std(0), rtol=1e-12)
    back = statistics_from_dict(doc, source="s")
    assert back.count == 50 and np.array_equal(back.mean, stats.mean)
    assert np.array_equal(back.m2, stats.m2)
    # Activault's own file (no count) is not trusted
    assert (
        statistics_from_dict({k: doc[k] for k in ("mean", "std", "norm", "M2")}, source="s") is None
    )


def test_position_tracks_partial_examples():
    pos = Position(example=10, skip=0)
    pos.add(np.array([10, 11, 12]), np.array([5, 0, 4]))
    assert pos.advance(3) == (10, 3)
    assert pos.advance(2) == (12, 0)  # example 11 kept nothing: skipped over
    assert pos.advance(4) == (13, 0)
    resumed = Position(example=20, skip=3)  # 3 kept tokens of example 20 stored already
    resumed.add(np.array([20, 21]), np.array([2, 6]))  # the 2 kept tokens after those 3
    assert resumed.advance(1) == (20, 4)
    assert resumed.advance(3) == (21, 2)


def test_cleaner_drops_special_tokens_and_template_prefix():
    from tiny_models import make_tokenizer

    tok = make_tokenizer(bos=True)
    tok.chat_template = (
        "{{ bos_token }}system: be brief. Today is Monday.\n"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}"
        "{% endfor %}"
    )
    prefix = template_prefix_ids(tok)
    assert prefix[0] == tok.bos_token_id and len(prefix) > 4
    cleaner = TokenCleaner.from_tokenizer(tok)
    assert {
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
        tok.unk_token_id,
    } <= cleaner.drop_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "print the list"}], tokenize=False)
    ids = tok(chat + " and more text " + chat, add_special_tokens=False)["input_ids"]
    ids = np.asarray([ids + [tok.pad_token_id] * 3])
    keep = cleaner.mask(ids)
    kept = ids[keep].tolist()
    assert not set(kept) & cleaner.drop_ids
    assert tok.decode(kept).count("be brief") == 0
    assert tok.decode(kept).count("print the list") == 2
    # without a chat template only the special ids go
    plain = TokenCleaner.from_tokenizer(make_tokenizer(bos=False))
    assert plain.sequences == ()
    assert plain.mask(np.array([[-100, 5, 1]])).tolist() == [[False, True, False]]
