"""Row-packed projection weights (entmaxkv.model.pack): the packed matrix
holds the modules' weights in order, the modules view it (values, state
dict and forward unchanged; in-place updates reach both), a second pack of
the same modules shares it, and a replaced weight is found and packed again."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from entmaxkv.model.lm import ModelConfig, TransformerLM
from entmaxkv.model.pack import PackedRows


def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=40, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=72)
    return TransformerLM(cfg).eval()


def test_pack_keeps_values_and_shares_memory():
    m = model()
    toks = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        want = m(toks)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    at, mlp = m.blocks[1].attn, m.blocks[1].mlp
    qkv, gu = PackedRows([at.wq, at.wk, at.wv], "model"), PackedRows([mlp.w_gate, mlp.w_up], "model")
    assert qkv.weight().shape == (40 + 2 * 20, 40) and gu.weight().shape == (2 * 72, 40)
    assert torch.equal(qkv.weight(), torch.cat([state[f"blocks.1.attn.{n}.weight"] for n in ("wq", "wk", "wv")]))
    assert torch.equal(gu.weight(), torch.cat([state[f"blocks.1.mlp.{n}.weight"] for n in ("w_gate", "w_up")]))
    after = m.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(m(toks), want)
        at.wk.weight.mul_(2.0)  # an in-place update of the module reaches the packed matrix
    assert torch.equal(qkv.weight()[40:60], 2.0 * state["blocks.1.attn.wk.weight"])
    assert isinstance(at.wk.weight, nn.Parameter) and at.wk.weight.requires_grad
    again = PackedRows([at.wq, at.wk, at.wv], "model")  # packed already: shared, not copied
    assert again.weight().data_ptr() == qkv.weight().data_ptr() and not qkv.stale()


def test_replaced_weight_is_found_and_packed_again():
    m = model()
    at = m.blocks[0].attn
    qkv = PackedRows([at.wq, at.wk, at.wv], "model")
    new = torch.randn(20, 40)
    at.wv.weight = nn.Parameter(new.clone())
    assert qkv.stale()
    assert not torch.equal(qkv.weight()[60:], new)  # (the comparison below can fail)
    qkv.repack()
    assert not qkv.stale() and torch.equal(qkv.weight()[60:], new)
    m.double()  # moves every weight
    assert qkv.stale()
    qkv.repack()
    assert qkv.weight().dtype == torch.float64 and torch.equal(qkv.weight()[60:], new.double())


def test_unpackable_modules_are_refused():
    m = model()
    at = m.blocks[0].attn
    with pytest.raises(ValueError, match="model: expected weights with one in_features, dtype"):
        PackedRows([at.wq, at.wk.double()], "model")
    with pytest.raises(ValueError, match="model: expected bias-free nn.Linear"):
        PackedRows([at.wq, nn.Linear(40, 8)], "model")
    with pytest.raises(ValueError, match="model: expected weights with one in_features"):
        PackedRows([at.wq, nn.Linear(8, 8, bias=False)], "model")


def test_a_replacement_of_another_shape_is_refused():
    """The packed split is fixed: a weight replaced by one of another row
    count is refused at repack, naming the argument, and nothing changes."""
    m = model()
    at = m.blocks[0].attn
    qkv = PackedRows([at.wq, at.wk, at.wv], "model")
    before = qkv.weight().clone()
    at.wk.weight = nn.Parameter(torch.randn(24, 40))
    assert qkv.stale()
    with pytest.raises(ValueError, match="model: expected a weight of 20 rows"):
        qkv.repack()
    assert torch.equal(qkv.weight(), before)
