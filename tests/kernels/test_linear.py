"""kernels.Linear: the W x^T form it takes for decode-sized fp32 batches equals F.linear."""
import pytest
import torch
import torch.nn.functional as F

from kernels import Linear


@pytest.mark.parametrize("shape", [(1, 1, 48), (5, 48), (4, 1, 48), (2, 32, 48), (65, 48), (3, 0, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, layer.weight, layer.bias)
    actual = layer(x)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_state_dict_is_nn_linear():
    """Same parameters and names: weights saved from (or copied into) an nn.Linear load unchanged."""
    plain = torch.nn.Linear(8, 4)
    layer = Linear(8, 4)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), plain(x))
