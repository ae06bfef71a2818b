"""RoPE scaling (linear, dynamic NTK, llama3, yarn): the frequencies and cos/sin tables against
transformers' own rotary code, the config spellings of transformers 4.x and 5.x, and what is
refused."""

import json
import math
import re

import pytest
import torch

from longctx import ops
from longctx.config import ModelArgs
from longctx.rope import RopeScaling, attention_factor, inv_freq
from tests.checkpoint_utils import YARN_AS_IN_TRANSFORMERS_5

transformers = pytest.importorskip("transformers", reason="the reference (test extra)")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

D, THETA = 16, 5e5
# Parameters of each case; "llama3" puts one frequency in each of its three bands at D=16 (the
# test checks that), "yarn-options" exercises every optional YaRN key.
CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-options": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 20,
                     "mscale": 0.9, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                     "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 40},
}
# cos/sin of the same float32 angles, from torch's vectorised or scalar cos depending on the
# shape of the call: ulp-level differences (a wrong frequency is off by orders more).
TABLE_TOL = dict(rtol=0, atol=2e-6)


def _hf_config(rope, max_position_embeddings=128):
    # rope_theta / rope_scaling: transformers 4.x's keywords, which 5.x takes too (and fills
    # in: a copy).
    return transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=D,
        max_position_embeddings=max_position_embeddings, rope_theta=THETA,
        rope_scaling=dict(rope) if rope else None)


def _cases():
    return [pytest.param(c, marks=YARN_AS_IN_TRANSFORMERS_5 if c.startswith("yarn") else ())
            for c in CASES]


@pytest.mark.parametrize("case", _cases())
def test_tables_match_transformers(case):
    rope = CASES[case]
    hf_cfg = _hf_config(rope)
    scaling = RopeScaling.from_dict(rope, 128)
    assert (scaling is None) == (case == "default")
    default = ROPE_INIT_FUNCTIONS.get("default")  # 4.x; 5.x has it on the rotary class
    default = default or LlamaRotaryEmbedding.compute_default_rope_parameters
    want_inv, want_factor = (default(hf_cfg) if rope is None
                             else ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg))
    got_inv = inv_freq(D, THETA, scaling)
    assert torch.equal(got_inv, want_inv)  # the same float32 operations: the same bits
    assert attention_factor(scaling) == want_factor
    if case.startswith("yarn"):
        assert want_factor != 1.0
    if case == "llama3":  # every band: kept (short wavelengths), scaled by 1/8, blended
        ratio = (got_inv / inv_freq(D, THETA)).tolist()
        assert ratio[0] == 1.0 and ratio[-1] == 1 / 8 and any(1 / 8 < r < 1 for r in ratio)
    S = 300  # past max_position_embeddings and the original lengths
    cos, sin = ops.rope_tables(S, D, THETA, torch.device("cpu"), scaling)
    want_cos, want_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.arange(S)[None])
    assert cos.shape == sin.shape == (S, D) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, want_cos[0], **TABLE_TOL)
    torch.testing.assert_close(sin, want_sin[0], **TABLE_TOL)


@pytest.mark.parametrize("factor", [2.0, 1.3])
@pytest.mark.parametrize("prompt_len", [5, 16, 23])  # below, at and beyond max_position_embeddings
def test_dynamic_tables_follow_transformers_generation(prompt_len, factor):
    """Dynamic NTK: transformers rotates a prompt of P positions (one forward call) with the
    frequencies of length max(P, 16), and each token decoded after it at position p with those
    of length max(p + 1, 16); the tables made for prompt_len P hold exactly these rows."""
    orig, S = 16, 60
    rope = {"rope_type": "dynamic", "factor": factor}
    hf_cfg = _hf_config(rope, max_position_embeddings=orig)
    emb = LlamaRotaryEmbedding(hf_cfg)
    calls = [torch.arange(prompt_len)] + [torch.tensor([p]) for p in range(prompt_len, S)]
    rows = [emb(torch.zeros(1), pos[None]) for pos in calls]
    want_cos = torch.cat([c[0] for c, _ in rows])
    want_sin = torch.cat([s[0] for _, s in rows])
    scaling = RopeScaling.from_dict(rope, orig)
    cos, sin = ops.rope_tables(S, D, THETA, torch.device("cpu"), scaling, prompt_len=prompt_len)
    torch.testing.assert_close(cos, want_cos, **TABLE_TOL)
    torch.testing.assert_close(sin, want_sin, **TABLE_TOL)
    # Frequencies bit for bit, at the lengths transformers computes them for.
    dynamic = ROPE_INIT_FUNCTIONS["dynamic"]
    for n in (prompt_len, orig + 1, S):
        if n > orig:
            got = inv_freq(D, THETA, scaling, torch.tensor([n]))[0]
            assert torch.equal(got, dynamic(hf_cfg, None, seq_len=torch.tensor(n))[0]), n
    # A prompt within the original length rotates unscaled up to it; the scaling shows beyond.
    plain_cos, _ = ops.rope_tables(S, D, THETA, torch.device("cpu"))
    unscaled = orig if prompt_len <= orig else 1  # a longer prompt is scaled from position 1
    assert torch.equal(cos[:unscaled], plain_cos[:unscaled])
    assert (cos[unscaled:unscaled + 4] - plain_cos[unscaled:unscaled + 4]).abs().max() > 1e-4
    assert (cos[orig + 1:] - plain_cos[orig + 1:]).abs().max() > 1e-2


def _write(tmp_path, **config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 128, "max_position_embeddings": 128, **config}))
    return path


@pytest.mark.parametrize("case", CASES)
def test_transformers_4_and_5_spellings_read_alike(tmp_path, case):
    rope = CASES[case]
    new = ModelArgs.from_hf_config(_write(tmp_path, rope_parameters={
        "rope_type": "default", **(rope or {}), "rope_theta": THETA}))
    old_rope = None
    if rope is not None:  # 4.x: "type", and rope_theta outside
        old_rope = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
    old = ModelArgs.from_hf_config(_write(tmp_path, rope_theta=THETA, rope_scaling=old_rope))
    assert old == new and new.rope_theta == THETA and new.max_position_embeddings == 128
    assert new.rope_scaling == RopeScaling.from_dict(rope, 128)
    if rope is not None:
        assert new.rope_scaling.rope_type == rope["rope_type"]
        assert new.rope_scaling.factor == rope["factor"]


def test_resolved_parameters():
    """Defaults filled in as transformers fills them."""
    y = RopeScaling.from_dict({"rope_type": "yarn", "factor": 4.0}, 32768)  # Qwen2.5 128k
    assert (y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.truncate) == (
        32768, 32.0, 1.0, True)
    assert y.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    # transformers 5: a yarn factor left out is max_position_embeddings / original.
    y = RopeScaling.from_dict({"rope_type": "yarn", "original_max_position_embeddings": 4096},
                              16384)
    assert y.factor == 4.0
    d = RopeScaling.from_dict({"type": "dynamic", "factor": 2}, 4096)
    assert (d.rope_type, d.factor, d.original_max_position_embeddings) == ("dynamic", 2.0, 4096)
    l3 = RopeScaling.from_dict({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0}, 8192)
    assert l3.original_max_position_embeddings == 8192
    assert RopeScaling.from_dict({"rope_type": "default"}) is None
    assert RopeScaling.from_dict(None) is None
    # A preset's model node spells it the same way.
    args = ModelArgs(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, intermediate_size=96,
                     vocab_size=64, max_position_embeddings=4096,
                     rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert args.rope_scaling == d


@pytest.mark.parametrize("rope,max_pos,match", [
    ({"rope_type": "longrope", "factor": 4.0}, 128,
     r"rope_type 'longrope' is not supported \(supported: default, linear, dynamic, llama3, "
     r"yarn\)"),
    ({"type": "su", "factor": 4.0}, 128, r"rope_type 'su' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, 128,
     r"rope_scaling.low_freq_factor of 'llama3' must be a positive number, got None"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     128, r"high_freq_factor \(1.0\) must exceed low_freq_factor \(4.0\)"),
    ({"rope_type": "linear"}, 128, r"rope_scaling.factor of 'linear' must be a positive number"),
    ({"rope_type": "linear", "factor": -2}, 128, r"factor of 'linear' must be a positive number"),
    ({"rope_type": "dynamic", "factor": 2.0}, None, r"max_position_embeddings must be a positive "
                                                    r"integer for rope_type 'dynamic', got None"),
    ({"rope_type": "yarn", "factor": 4.0, "short_factor": [1.0]}, 128,
     r"'yarn' does not take short_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, 128, r"truncate of 'yarn' must be"),
    ({"rope_type": "yarn", "factor": 4.0}, None,
     r"original_max_position_embeddings \(or max_position_embeddings\) must be a positive"),
    ({"rope_type": "default", "factor": 2.0}, 128, r"takes no parameters, got \['factor'\]"),
])
def test_bad_rope_scaling_is_refused_by_name(rope, max_pos, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling.from_dict(rope, max_pos)
    with pytest.raises(ValueError, match=r"^model\.(rope_scaling|max_position)") as e:  # a node
        ModelArgs(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, intermediate_size=96,
                  vocab_size=64, max_position_embeddings=max_pos, rope_scaling=rope)
    assert re.search(match, str(e.value))


def test_checkpoint_configs_refused_with_the_file_and_field(tmp_path):
    path = _write(tmp_path, rope_scaling={"type": "longrope", "long_factor": [1.0] * 8})
    with pytest.raises(ValueError, match=r"config.json: model.rope_scaling: rope_type 'longrope'"):
        ModelArgs.from_hf_config(path)
    path = _write(tmp_path, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.5 .* is not supported"):
        ModelArgs.from_hf_config(path)
    path = _write(tmp_path, attention_bias=True)
    with pytest.raises(ValueError, match=r"attention_bias \(biases on q, k, v and o_proj\)"):
        ModelArgs.from_hf_config(path)
    path = _write(tmp_path, mlp_bias=True)
    with pytest.raises(ValueError, match=r"MLP biases and activations other than silu"):
        ModelArgs.from_hf_config(path)


@pytest.mark.parametrize("fields,refused", [
    ({}, False),  # transformers' defaults: use_sliding_window false
    ({"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 1}, False),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, False),  # none
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, True),
    ({"use_sliding_window": True, "sliding_window": 64}, False),  # default max_window_layers 28
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, False),
    ({"use_sliding_window": True, "sliding_window": 64,
      "layer_types": ["sliding_attention", "full_attention"]}, True),
    ({"use_sliding_window": False, "sliding_window": None,
      "layer_types": ["sliding_attention", "full_attention"]}, False),  # window off
])
def test_qwen2_sliding_window_refused_where_transformers_slides(tmp_path, fields, refused):
    path = _write(tmp_path, model_type="qwen2", **fields)
    if refused:
        with pytest.raises(ValueError, match=r"sliding-window attention \(use_sliding_window with "
                                             r"sliding_window=64, in 1 of 2 layers"):
            ModelArgs.from_hf_config(path)
    else:
        args = ModelArgs.from_hf_config(path)
        assert args.qkv_bias and args.head_dim == 16 and args.rope_scaling is None
