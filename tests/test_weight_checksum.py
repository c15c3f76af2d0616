"""weight_checksum.tensor_checksums: the weight-equality check's digest. Its definition (in the docstring) is
re-computed here in plain Python integers; single changed bits in any word are always seen; the digest depends on
the bytes only, on any device (the GPU test: CUDA digests equal the CPU's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_lite import weight_checksum as wt
from slime_lite.weight_checksum import tensor_checksums

M64 = (1 << 64) - 1
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8]


def reference(t: torch.Tensor) -> str:
    """The docstring's definition, word by word, with Python integers."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    n = len(data)
    data += bytes(-n % 8)
    words = [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    size = wt.CHECKSUM_BLOCK_WORDS
    m = [int(x) for x in wt.checksum_multipliers("word", np.arange(size))]
    blocks = np.arange(-(-len(words) // size))
    a_mult = [int(x) for x in wt.checksum_multipliers("block_a", blocks)]
    c_mult = [int(x) for x in wt.checksum_multipliers("block_b", blocks)]
    a = c = 0
    for j, w in enumerate(words):
        p = (w * m[j % size]) & M64
        signed = p - (1 << 64) if p >> 63 else p
        a += a_mult[j // size] * p
        c += c_mult[j // size] * p * (signed >> 32)
    c += n * wt._LENGTH_MULT
    return f"{a & M64:016x}{c & M64:016x}"


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**62), min(info.max, 2**62), shape, generator=gen, dtype=dtype)


def test_digests_follow_the_definition_in_any_batching(monkeypatch):
    words = wt.CHECKSUM_BLOCK_WORDS
    tensors = [random_tensor(torch.float32, (2 * words + 5,)),   # three blocks, the last one short
               random_tensor(torch.bfloat16, (3,)),              # 6 bytes: padded inside one word
               random_tensor(torch.int64, (words,)),             # exactly one block
               torch.zeros(0), torch.tensor(3.5),                # empty and 0-dim
               random_tensor(torch.float16, (40, 30)).t(),       # not contiguous
               random_tensor(torch.int32, (7,))]
    want = [reference(t) for t in tensors]
    assert tensor_checksums(tensors) == want
    assert all(len(d) == 32 for d in want) and len(set(want)) == len(want)
    for batch in (8 * words, 1):  # one block per batch; blocks of one tensor split over batches
        monkeypatch.setattr(wt, "CHECKSUM_BATCH_BYTES", batch)
        assert tensor_checksums(tensors) == want
    assert tensor_checksums(tensors[::-1]) == want[::-1]  # a digest does not depend on the other tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 5, 2 * wt.CHECKSUM_BLOCK_WORDS + 3])
def test_every_single_flipped_bit_changes_the_digest(dtype, numel):
    t = random_tensor(dtype, (numel,), seed=numel)
    raw = t.view(torch.uint8)
    base = tensor_checksums([t])[0]
    nbytes = raw.numel()
    # every bit of small tensors; for the large one, every bit of bytes at block edges and some in between
    edges = {0, 1, 7, 8, nbytes - 1, 8 * wt.CHECKSUM_BLOCK_WORDS - 1, 8 * wt.CHECKSUM_BLOCK_WORDS}
    places = range(nbytes) if nbytes <= 32 else sorted(i for i in {*edges, *range(0, nbytes, 997)} if i < nbytes)
    flipped = []
    for i in places:
        for bit in range(8):
            u = raw.clone()
            u[i] ^= 1 << bit
            flipped.append(u.view(dtype))
    digests = tensor_checksums(flipped)
    assert base not in digests
    assert len(set(digests)) == len(digests)  # and no two single-bit changes collide either


def test_digest_is_of_the_bytes():
    x = random_tensor(torch.float32, (33, 17))
    assert tensor_checksums([x])[0] == tensor_checksums([x.clone()])[0]  # equal bytes, another tensor
    assert tensor_checksums([x.t().contiguous().t()])[0] == tensor_checksums([x])[0]  # strides do not matter
    assert tensor_checksums([x.view(torch.int32)])[0] == tensor_checksums([x])[0]  # a view of the same bytes
    assert tensor_checksums([x[:, 1:]])[0] == reference(x[:, 1:].contiguous())  # a non-contiguous slice
    same_values = [x, x.double(), x.bfloat16(), x.half()]
    assert len(set(tensor_checksums(same_values))) == 4  # the same values in other dtypes are other bytes
    ints = torch.arange(10, dtype=torch.int32)
    assert tensor_checksums([ints])[0] != tensor_checksums([ints.float()])[0]
    # zero bytes of other lengths, and a value moved to another place, differ
    assert len(set(tensor_checksums([torch.zeros(n, dtype=torch.uint8) for n in (0, 1, 4, 8, 9)]))) == 5
    one_hot = [torch.zeros(64, dtype=torch.int64).index_fill_(0, torch.tensor([i]), 1) for i in range(64)]
    assert len(set(tensor_checksums(one_hot))) == 64
    swapped = x.clone().reshape(-1)
    swapped[[3, 400]] = swapped[[400, 3]]
    assert tensor_checksums([swapped])[0] != tensor_checksums([x.reshape(-1)])[0]


def test_digests_do_not_depend_on_where_they_are_computed():
    x = [random_tensor(torch.bfloat16, (3 * wt.CHECKSUM_BLOCK_WORDS + 5,)), random_tensor(torch.float32, (7, 3)).t()]
    assert tensor_checksums(x, device="cpu") == tensor_checksums(x)
    assert tensor_checksums(x, dtype=torch.float16, device="cpu") == tensor_checksums(x, dtype=torch.float16)


def test_cast_is_done_before_hashing():
    x = random_tensor(torch.float32, (3 * wt.CHECKSUM_BLOCK_WORDS + 1,))  # more than one block per cast piece
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert tensor_checksums([x, x[::2]], dtype=dt) == tensor_checksums([x.to(dt), x[::2].to(dt)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digests_equal_the_cpu_digests():
    cpu = [random_tensor(dt, shape, seed=i) for i, (dt, shape) in enumerate(
        (dt, shape) for dt in DTYPES for shape in ((1,), (5, 3), (4097, 31), (151, 896)))]
    cpu.append(random_tensor(torch.bfloat16, (896, 4864)).t())  # not contiguous
    want = tensor_checksums(cpu)
    cuda = [t.cuda() for t in cpu]
    assert tensor_checksums(cuda) == want
    mixed = [t if i % 2 else t.cuda() for i, t in enumerate(cpu)]  # both devices in one call
    assert tensor_checksums(mixed) == want
    assert tensor_checksums(mixed, device="cuda") == want  # host tensors hashed on the GPU (the trainer's check)
    assert tensor_checksums(cuda, device="cpu") == want
    x = random_tensor(torch.float32, (1000, 333))
    for dt in (torch.bfloat16, torch.float16):  # the dtype fallback's cast, on the GPU
        assert tensor_checksums([x.cuda()], dtype=dt) == tensor_checksums([x.to(dt)])


def _fused_kernel_on_cpu() -> None:
    """Run by ``test_the_fused_kernel_in_the_triton_interpreter`` with TRITON_INTERPRET=1 (CPU tensors count as
    usable): the kernel against the torch ops and the definition, on the GPU test's kinds of tensors, smaller."""
    wt._fused_usable = lambda device: wt._block_sums_kernel() is not None
    words = wt.CHECKSUM_BLOCK_WORDS
    base = random_tensor(torch.uint8, (8 * words + 11,))
    tensors = [random_tensor(torch.bfloat16, (64, 700), seed=1),   # 89.6 KB: 6 blocks
               random_tensor(torch.float32, (2 * words + 5,), seed=2),  # a short last block
               random_tensor(torch.bfloat16, (3,), seed=3),             # 6 bytes: not a whole word
               base[1:],                                                # not 8-byte aligned
               torch.zeros(0),                                          # no blocks
               random_tensor(torch.int64, (words,), seed=4),            # exactly one block
               base[8:],                                                # a view at an offset: no copy
               random_tensor(torch.bfloat16, (64, 300), seed=5).t()]    # not contiguous: a copy
    device = torch.device("cpu")
    nbytes = [t.numel() * t.element_size() for t in tensors]
    nblocks = [-(-n // (8 * words)) for n in nbytes]
    fused = wt._fused_digests(device, tensors, None, nbytes, nblocks)
    assert fused is not None, "the fused path was not taken"
    assert torch.equal(fused, wt._combine(device, wt._torch_block_sums(device, tensors, None, nbytes, nblocks), nblocks))
    assert tensor_checksums(tensors) == [reference(t) for t in tensors]


def test_the_fused_kernel_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.test_weight_checksum:_fused_kernel_on_cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_kernel_gives_the_torch_ops_sums():
    """The Triton kernel (one read of each byte) against the torch ops on the same CUDA tensors, tensor by tensor:
    short last blocks, byte counts that are not whole words, a misaligned view, empty tensors, many blocks."""
    pytest.importorskip("triton")
    words = wt.CHECKSUM_BLOCK_WORDS
    base = random_tensor(torch.uint8, (8 * words + 11,)).cuda()
    tensors = [random_tensor(torch.bfloat16, (896, 4864), seed=1).cuda(),    # 4.4 MB: 533 blocks
               random_tensor(torch.float32, (2 * words + 5,), seed=2).cuda(),  # a short last block
               random_tensor(torch.bfloat16, (3,), seed=3).cuda(),             # 6 bytes: not a whole word
               base[1:],                                                       # not 8-byte aligned
               torch.zeros(0, device="cuda"),                                  # no blocks
               random_tensor(torch.int64, (words,), seed=4).cuda(),            # exactly one block
               base[8:],                                                       # a view at an offset: no copy
               random_tensor(torch.bfloat16, (64, 300), seed=5).cuda().t()]    # not contiguous: a copy
    device = tensors[0].device
    nbytes = [t.numel() * t.element_size() for t in tensors]
    nblocks = [-(-n // (8 * words)) for n in nbytes]
    fused = wt._fused_digests(device, tensors, None, nbytes, nblocks)
    assert fused is not None, "Triton is installed but the fused path was not taken"
    assert torch.equal(fused, wt._combine(device, wt._torch_block_sums(device, tensors, None, nbytes, nblocks), nblocks))
    assert tensor_checksums(tensors) == [reference(t.cpu()) for t in tensors]
