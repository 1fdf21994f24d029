"""kernels/cpu/greedy_rows.c against torch's argmax and isfinite: the engine's greedy tokens and non-finite check."""
import pytest
import torch

from kernels import cpu_kernels_available, greedy_rows

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C kernels did not build here (a warning "
                                                                     "said why)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 32000])
def test_tokens_and_finiteness_match_torch(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(dtype)
    logits[1] = logits[1].round()  # many ties: the first largest wins, as torch.argmax picks
    logits[2, vocab // 2] = float("nan")
    logits[3, -1] = float("-inf")
    logits[4, 0] = float("inf")
    tokens, finite = greedy_rows(logits)
    assert finite == torch.isfinite(logits).all(dim=-1).tolist()
    expected = logits.argmax(dim=-1).tolist()
    assert [t for t, ok in zip(tokens, finite) if ok] == [t for t, ok in zip(expected, finite) if ok]


def test_a_row_with_equal_values_and_a_strided_batch():
    wide = torch.zeros(3, 64)
    wide[:, 40] = 1.0
    wide[1, 7] = 1.0
    view = wide[:, :48]  # rows 64 apart, 48 long
    assert greedy_rows(view) == ([40, 7, 40], [True] * 3)
    assert greedy_rows(torch.full((2, 33), -3.0)) == ([0, 0], [True, True])


def test_what_the_c_kernel_does_not_read_goes_to_torch():
    column_major = torch.randn(40, 3).T  # rows with a stride of 3
    assert greedy_rows(column_major)[0] == column_major.argmax(dim=-1).tolist()
    doubles = torch.randn(2, 9, dtype=torch.float64)
    assert greedy_rows(doubles)[0] == doubles.argmax(dim=-1).tolist()
