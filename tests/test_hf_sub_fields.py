"""A part of a family's configuration given what its code reads off it
(``backends/torch/zoo/hf_sub_fields.py``; docs/soundness.md, "Plans traced
from PyTorch", 117): DBRX builds and runs; no other family's small
configuration changes (MPT's guarded ``clip_qkv`` stays None)."""

from __future__ import annotations

from backends.torch.zoo import hf
from backends.torch.zoo.hf_sub_fields import declared_names, needed_fields, read_fields, rotary_fields

SIZES = {"layers": 1, "hidden": 16, "heads": 4, "ffn": 32, "vocab": 64, "seqlen": 16}


def test_read_fields() -> None:
    assert read_fields("a = attn_config.rope_theta\nb = x.attn_config.kv_n_heads", "attn_config") \
        == {"rope_theta", "kv_n_heads"}


def test_rotary_fields_only_what_the_part_lacks() -> None:
    class Part:
        kv_n_heads = 1
    rope = {"rope_theta": 500.0, "rope_type": "default"}
    source = "attn_config.rope_theta; attn_config.kv_n_heads; attn_config.other"
    assert rotary_fields(source, "attn_config", Part(), rope) == {"rope_theta": 500.0}
    assert rotary_fields(source, "attn_config", Part(), None) == {}


def test_needed_fields_skip_a_guarded_field() -> None:
    class Part:
        clip_qkv = None
    assert needed_fields("x.clamp(min=m, max=self.clip_qkv)", Part()) == {"clip_qkv": 8.0}
    assert needed_fields("        if self.clip_qkv:\n            x.clamp()", Part()) == {}


def test_declared_names() -> None:
    class Cfg:
        attribute_map = {"hidden_size": "d_model", "n_layers_alias": "n_layers"}
        __annotations__ = {"d_model": int}
    assert declared_names(Cfg, {"hidden_size": 16, "vocab_size": 8}) == {"d_model": 16, "vocab_size": 8}


def test_dbrx_builds_at_the_small_sizes() -> None:
    cfg = hf.config("dbrx", **SIZES)
    assert cfg.d_model == cfg.ffn_config.hidden_size == 16
    assert cfg.attn_config.clip_qkv == 8.0 and cfg.attn_config.rope_theta == cfg.rope_parameters["rope_theta"]
    hf.build("dbrx", **SIZES)


def test_mpt_keeps_its_guarded_clip() -> None:
    assert hf.config("mpt", **SIZES).attn_config.clip_qkv is None
