"""kernels/cpu_memory.py: a CPU engine's weights moved into 2 MiB pages keep every tensor object and value, each in a
storage of its own on a cache line; what cannot move safely stays; nothing moves twice; and a placed model still saves
and loads (safetensors refuses tensors that share a storage none of them covers)."""
import gc
import mmap

import pytest
import torch
from torch import nn

import zoo
from harness import Engine, SamplingParams
from harness.engine.model_runner import place_weights
from kernels import cpu_memory
from zoo import checkpoint

PLACES = cpu_memory.huge_pages_off() == ""  # this kernel grants huge pages for the asking


def model_past_a_page(seed: int):
    """A "tiny" model made wide enough that its weights fill more than one 2 MiB page (smaller ones stay put)."""
    torch.manual_seed(seed)
    return zoo.build("gqa", preset="tiny", d_model=512).eval()


def test_a_region_starts_on_a_huge_page_and_lives_while_viewed():
    if not PLACES:
        pytest.skip(f"no 2 MiB pages to ask for: {cpu_memory.huge_pages_off()}")
    region = cpu_memory.huge_page_bytes((3 << 20) + 5)
    assert region.numel() == (3 << 20) + 5 and region.data_ptr() % cpu_memory.HUGE_PAGE == 0
    tail = region[-7:]
    del region
    gc.collect()
    tail.fill_(9)  # the mapping is still there: only the views hold it now
    assert tail.sum().item() == 63


@torch.no_grad()
def test_placing_keeps_every_tensor_object_and_value():
    model = model_past_a_page(0)  # a tied head: one tensor, moved once
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    before = model(tokens)
    tensors = {name: (t, t.detach().clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert place_weights(model) == cpu_memory.huge_pages_off()
    if not PLACES:
        return
    for name, (t, value) in tensors.items():
        now = dict([*model.named_parameters(), *model.named_buffers()])[name]
        assert now is t and torch.equal(t, value), name
        assert t.data_ptr() % cpu_memory.LINE == 0 and not t.untyped_storage().resizable(), name
        assert t.untyped_storage().nbytes() == t.nbytes, name  # a storage of its own over its stretch
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(tokens), before)
    assert cpu_memory.movable(model) == []  # a second engine over the same model moves nothing


def test_what_cannot_move_safely_stays_where_it_is():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            whole = torch.randn(8, 6)
            self.half_a, self.half_b = nn.Parameter(whole[:4]), nn.Parameter(whole[4:])  # one storage, two tensors
            self.strided = nn.Parameter(torch.randn(6, 8).t())  # not contiguous
            self.shared = nn.Parameter(torch.randn(5).share_memory_())  # another process may map it
            self.empty = nn.Parameter(torch.empty(0))
            self.plain = nn.Parameter(torch.randn(3, 3))

    module = Odd()
    assert cpu_memory.movable(module) == [module.plain]
    pointers = {name: p.data_ptr() for name, p in module.named_parameters()}
    cpu_memory.place_on_huge_pages(cpu_memory.movable(module))
    moved = {name for name, p in module.named_parameters() if p.data_ptr() != pointers[name]}
    assert moved == ({"plain"} if PLACES else set())


def test_a_placed_model_saves_and_loads(tmp_path):
    model = model_past_a_page(1)
    assert place_weights(model) == cpu_memory.huge_pages_off()
    checkpoint.save(model, tmp_path / "ckpt")
    loaded = checkpoint.load(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_an_engine_places_its_weights_or_says_why_not(monkeypatch):
    model = model_past_a_page(2)
    engine = Engine(model, max_batch=1, max_seq_len=32)
    assert engine.runner.huge_pages_off == cpu_memory.huge_pages_off()
    if PLACES:  # a second engine over the same model finds nothing left to move
        assert "nothing left to move" in Engine(model, max_batch=1, max_seq_len=32).runner.huge_pages_off
    small = zoo.build("gqa", preset="tiny").eval()  # under one page: stays
    assert ("less than one 2 MiB page" if PLACES else cpu_memory.huge_pages_off()) in place_weights(small)
    assert all(not p.untyped_storage().resizable() for p in model.parameters()) == PLACES
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4
    other = model_past_a_page(3)
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", "1000")  # less than the copy the move makes: nothing moves
    pointers = [p.data_ptr() for p in other.parameters()]
    reason = place_weights(other)
    assert "ZOO_MEMORY_LIMIT" in reason if PLACES else reason == cpu_memory.huge_pages_off()
    assert [p.data_ptr() for p in other.parameters()] == pointers


def test_the_kernel_mode_decides(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(cpu_memory, "THP_MODE", mode)
    mode.write_text("always [madvise] never\n")
    advised = hasattr(mmap, "MADV_HUGEPAGE")
    assert cpu_memory.huge_pages_off() == ("" if advised else "this platform has no MADV_HUGEPAGE advice")
    mode.write_text("always madvise [never]\n")
    assert ("[never]" if advised else "no MADV_HUGEPAGE") in cpu_memory.huge_pages_off()
    mode.unlink()
    assert ("unreadable" if advised else "no MADV_HUGEPAGE") in cpu_memory.huge_pages_off()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_cache_zeros_are_zeros_of_their_shape(dtype):
    """The engine's caches: from a fresh 2 MiB-page mapping where at least one such page is asked for, else torch's."""
    big, small = cpu_memory.zeros(3, 1024, 1024, dtype=dtype, device="cpu"), cpu_memory.zeros(5, 7, dtype=dtype,
                                                                                                device="cpu")
    for t, shape in ((big, (3, 1024, 1024)), (small, (5, 7))):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.view(torch.uint8).any()
    assert small.untyped_storage().resizable()  # under a page: torch's own
    if PLACES:
        assert big.data_ptr() % cpu_memory.HUGE_PAGE == 0 and not big.untyped_storage().resizable()
    big[1, 2, 3] = 1  # writable, and only there
    assert big.float().count_nonzero() == 1
