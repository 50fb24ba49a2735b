"""The byte-mask dropout of attnlab.nn: its statistics, gradient and modes."""

import pytest
import torch

from attnlab.nn import Dropout, byte_dropout
from conftest import spec_refusal


def test_keeps_the_expected_fraction_and_preserves_the_mean():
    torch.manual_seed(0)
    x = torch.ones(1 << 20)
    y = byte_dropout(x, 0.2)
    keep = 1 - 51 / 256  # 0.2 rounds to 51/256
    assert y.unique().tolist() == pytest.approx([0.0, 1 / keep])
    assert (y != 0).float().mean().item() == pytest.approx(keep, abs=3e-3)
    assert y.mean().item() == pytest.approx(1.0, abs=5e-3)
    # every byte of each random word is uniform: a sampler that leaves the top byte short
    # (e.g. int64 random_(), which draws from [0, 2^63)) keeps too much in one column in 8
    by_byte = (y != 0).view(-1, 8).float().mean(0)
    assert torch.allclose(by_byte, torch.full((8,), keep), atol=8e-3)


def test_gradient_flows_through_the_kept_elements_only():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 7, requires_grad=True)  # numel not a multiple of 8
    y = byte_dropout(x, 0.5)
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.equal(x.grad, kept.float() * 2.0)
    assert torch.allclose(y[kept], 2.0 * x.detach()[kept])


def test_mask_follows_the_seed_and_bf16_keeps_its_dtype():
    x = torch.randn(64, 33, dtype=torch.bfloat16)
    torch.manual_seed(3)
    a = byte_dropout(x, 0.1)
    torch.manual_seed(3)
    b = byte_dropout(x, 0.1)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_eval_mode_and_zero_probability_are_the_identity():
    x = torch.randn(4, 8)
    drop = Dropout(0.3)
    assert drop(x) is not x
    drop.eval()
    assert drop(x) is x
    assert Dropout(0.0)(x) is x


@pytest.mark.parametrize("p,message", [(-0.1, "greater than or equal to 0"), (1.0, "less than 1")])
def test_probability_outside_zero_one_is_refused(p, message):
    assert spec_refusal("attnlab.nn.Dropout", p=p).startswith(f"model.net.p={p}: must be {message}")


def test_probabilities_near_one_keep_one_element_in_256():
    torch.manual_seed(2)
    y = byte_dropout(torch.ones(1 << 16), 0.999)
    assert (y != 0).float().mean().item() == pytest.approx(1 / 256, abs=2e-3)
    assert y.max().item() == pytest.approx(256.0)
