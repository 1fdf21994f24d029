"""kernels/cpu/read_bandwidth.c reads every line it is given once: the XOR it returns equals numpy's XOR of the same
64-bit words (a line skipped, or read twice, changes it)."""
import numpy as np
import pytest
import torch

from kernels import cpu_decode, cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels did not build")


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def xor_of(buffer: torch.Tensor, nbytes: int) -> int:
    return int(np.bitwise_xor.reduce(buffer[:nbytes].numpy().view(np.uint64)))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_buffer_every_line_once(threads):
    buffer = random_bytes(64 * 1000 + 40, seed=threads)  # not a whole number of each thread's lines
    usable = buffer.nbytes // (64 * threads) * (64 * threads)  # what read_bandwidth promises to read
    assert cpu_decode.read_bandwidth(buffer, threads) == xor_of(buffer, usable)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_list_of_tensors_every_whole_line_once(threads):
    """Weights of several shapes and dtypes, as a model holds them: each tensor's whole lines, its tail left out."""
    tensors = [random_bytes(64 * 7, seed=1), random_bytes(64 * 301 + 17, seed=2), random_bytes(64, seed=3),
               random_bytes(64 * 2048, seed=4).view(torch.float32).view(256, 128)]
    want = 0
    for t in tensors:
        want ^= xor_of(t.view(torch.uint8).view(-1), t.nbytes // 64 * 64)
    assert cpu_decode.read_buffers(tensors, threads) == want
    assert want != 0  # the data are random: a kernel that read nothing would return 0


def test_a_list_refuses_what_it_cannot_read_whole_lines_of():
    base = random_bytes(64 * 4, seed=0)
    with pytest.raises(ValueError, match=r"tensors \[1\] are not"):  # off a 64-byte line: refused before any read
        cpu_decode.read_buffers([base, base[8:]], 2)
    with pytest.raises(ValueError, match=r"tensors \[0\] are not"):
        cpu_decode.read_buffers([torch.zeros(64, 64)[:, 0]], 2)


def test_tensors_read_rate_reads_each_tensor_once(monkeypatch):
    """roofline.tensors_read_rate (a model's weights where they lie): a tied weight read once, every pass timed over
    the same list."""
    from harness import roofline

    seen = []
    monkeypatch.setattr(cpu_decode, "read_buffers", lambda tensors, threads: seen.append([id(t) for t in tensors]))
    tied, other = torch.zeros(64 * 100, dtype=torch.uint8), torch.zeros(64 * 50, dtype=torch.uint8)
    rate = roofline.tensors_read_rate([tied, other, tied], repeats=3)
    assert rate > 0 and len(seen) == 4  # one untimed pass, then three
    assert all(ids == [id(tied), id(other)] for ids in seen)
