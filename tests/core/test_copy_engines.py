"""Copy engines: Triton copy == torch copy bit for bit, emulated link charges, profiles, factory."""
import os

import torch

if not torch.cuda.is_available():  # Triton runs on CPU tensors only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
import time

import pytest

from specfit.offload.copy import base as copy_base
from specfit.offload.copy import triton as copy_triton
from specfit.offload.copy.base import CopyEngine, CopyRecord
from specfit.offload.copy.emulated import EmulatedLinkEngine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.offload.copy.triton import TritonCopyEngine
from specfit.offload.copy.factory import make_copy_engine
from specfit.types.link_profiles import LinkSettings
from specfit.types.link_profiles import PROFILES, UnknownLinkProfileError, get_profile

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _store(E: int, P: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(E, P, generator=g).to(dtype)
    return store.pin_memory() if DEVICE.type == "cuda" else store


def _slots(S: int, P: int, dtype: torch.dtype) -> torch.Tensor:
    # A recognisable fill, so rows that must stay untouched can be checked bit for bit.
    return torch.full((S, P), -7.0, dtype=dtype, device=DEVICE)


@pytest.fixture(scope="module")
def triton_engine() -> TritonCopyEngine:
    # Small blocks so odd P spans several chunks with a ragged last one.
    return TritonCopyEngine(DEVICE, block_bytes=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "P, src, dst",
    [
        (37, [5], [2]),  # n = 1, odd P
        (101, [9, 0, 4, 7, 3, 11, 1], [6, 1, 0, 3, 7, 2, 5]),  # n = many, permuted ids
        (64, [11, 10, 9, 8], [0, 1, 2, 3]),  # P a multiple of every word size
        (33, list(range(12)), [7, 3, 9, 0, 11, 5, 1, 10, 2, 8, 4, 6]),  # all rows, permuted
    ],
)
def test_triton_equals_torch_bit_for_bit(triton_engine, dtype, P, src, dst):
    E, S = 12, 12
    store = _store(E, P, dtype, seed=P)
    s_ids, d_ids = torch.tensor(src), torch.tensor(dst)
    out_tr, out_to = _slots(S, P, dtype), _slots(S, P, dtype)
    before = out_tr.clone()

    rec_tr = triton_engine.copy(store, s_ids, out_tr, d_ids)
    rec_to = TorchCopyEngine(DEVICE).copy(store, s_ids, out_to, d_ids)

    assert torch.equal(_bits(out_tr), _bits(out_to))
    for s, d in zip(src, dst):
        assert torch.equal(_bits(out_tr[d]), _bits(store[s]))
    untouched = [r for r in range(S) if r not in dst]
    assert torch.equal(_bits(out_tr[untouched]), _bits(before[untouched]))
    for rec in (rec_tr, rec_to):
        assert rec.experts == len(src)
        assert rec.bytes == len(src) * P * store.element_size()
        assert rec.seconds >= 0


def test_triton_bit_exact_on_nan_payloads(triton_engine):
    """Copies move raw words, so NaN payloads and -0.0 survive (a float path could canonicalise)."""
    raw = torch.tensor([0x7FC1, 0xFFFF, 0x8000, 0x7F81, 0x0001], dtype=torch.int32).to(torch.int16)
    store = raw.repeat(3, 3).view(torch.bfloat16)  # [3, 15]
    store = store.pin_memory() if DEVICE.type == "cuda" else store
    slots = torch.zeros(2, 15, dtype=torch.bfloat16, device=DEVICE)
    triton_engine.copy(store, torch.tensor([2, 0]), slots, torch.tensor([1, 0]))
    assert torch.equal(_bits(slots), _bits(store[[0, 2]]))


def test_triton_word_size_follows_alignment(triton_engine):
    """Rows of 3 bf16 (6 bytes) only tile as 2-byte words; a strided store view still copies right."""
    base = _store(6, 10, torch.bfloat16)
    store = base[:, :3]  # row stride 10 elements, rows of 3: not contiguous overall
    slots = _slots(4, 3, torch.bfloat16)
    triton_engine.copy(store, torch.tensor([5, 0]), slots, torch.tensor([3, 1]))
    assert torch.equal(_bits(slots[3]), _bits(store[5]))
    assert torch.equal(_bits(slots[1]), _bits(store[0]))
    assert copy_triton._word_size(store, slots) == 2
    assert copy_triton._word_size(_store(2, 8, torch.bfloat16), _slots(2, 8, torch.bfloat16)) == 8


def test_triton_rows_longer_than_grid_limit(triton_engine, monkeypatch):
    """Rows with more chunks than CUDA's grid-y limit loop over them (limit shrunk to test it)."""
    monkeypatch.setattr(copy_triton, "_MAX_GRID_Y", 3)
    store = _store(4, 301, torch.float32)
    slots = _slots(3, 301, torch.float32)
    triton_engine.copy(store, torch.tensor([3, 1]), slots, torch.tensor([0, 2]))
    assert torch.equal(slots[0].cpu(), store[3])
    assert torch.equal(slots[2].cpu(), store[1])


def test_empty_batch(triton_engine):
    store, slots = _store(4, 8, torch.float32), _slots(2, 8, torch.float32)
    empty = torch.empty(0, dtype=torch.int64)
    for eng in (triton_engine, TorchCopyEngine(DEVICE), EmulatedLinkEngine()):
        assert eng.copy(store, empty, slots, empty) == CopyRecord(0, 0, 0.0)
    assert (slots == -7.0).all()


def test_argument_errors(triton_engine):
    store, slots = _store(4, 8, torch.float32), _slots(2, 8, torch.float32)
    for eng in (triton_engine, TorchCopyEngine(DEVICE)):
        with pytest.raises(IndexError, match="src_ids out of range"):
            eng.copy(store, torch.tensor([4]), slots, torch.tensor([0]))
        with pytest.raises(IndexError, match="dst_slots out of range"):
            eng.copy(store, torch.tensor([0]), slots, torch.tensor([2]))
        with pytest.raises(ValueError, match="duplicate"):
            eng.copy(store, torch.tensor([0, 1]), slots, torch.tensor([1, 1]))
        with pytest.raises(TypeError, match="dtype"):
            eng.copy(store, torch.tensor([0]), slots.to(torch.float16), torch.tensor([0]))
        with pytest.raises(ValueError, match="row size"):
            eng.copy(store, torch.tensor([0]), _slots(2, 9, torch.float32), torch.tensor([0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned-memory check is CUDA-only")
def test_triton_cuda_rejects_pageable_store(triton_engine):
    store = torch.randn(4, 8)  # pageable
    slots = _slots(2, 8, torch.float32)
    with pytest.raises(ValueError, match="pinned"):
        triton_engine.copy(store, torch.tensor([0]), slots, torch.tensor([0]))


def test_triton_without_interpreter_names_the_fixes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1") as err:
        TritonCopyEngine("cpu")
    assert "cache.copy=torch" in str(err.value)


def test_import_does_not_import_triton():
    code = "import sys, specfit.offload.copy.factory, specfit.types.link_profiles; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------
# Emulated link


def test_emulated_charges_at_least_the_modelled_time():
    link = LinkSettings(profile=None, bandwidth_gbps=1.0, latency_us=500.0, ref_expert_bytes=2_000_000)
    eng = EmulatedLinkEngine(link=link, device=DEVICE)
    store = _store(16, 50, torch.bfloat16)
    src, dst = torch.tensor([3, 9, 14]), torch.tensor([1, 0, 2])
    out, ref = _slots(4, 50, torch.bfloat16), _slots(4, 50, torch.bfloat16)

    t0 = time.perf_counter()
    rec = eng.copy(store, src, out, dst)
    elapsed = time.perf_counter() - t0

    expected = 500e-6 + 3 * 2_000_000 / 1e9  # 6.5 ms
    assert rec.seconds == pytest.approx(expected)
    assert elapsed >= rec.seconds  # never charges less wall time than the model says
    assert rec.experts == 3 and rec.bytes == 3 * 50 * 2  # real bytes, not reference bytes
    TorchCopyEngine(DEVICE).copy(store, src, ref, dst)
    assert torch.equal(_bits(out), _bits(ref))
    assert eng.emulated is True


def test_emulated_real_bytes_when_no_reference_size():
    eng = EmulatedLinkEngine(link=LinkSettings(profile=None, bandwidth_gbps=0.001, latency_us=0.0))
    store, slots = _store(4, 100, torch.float32), _slots(2, 100, torch.float32)
    t0 = time.perf_counter()
    rec = eng.copy(store, torch.tensor([0, 1]), slots, torch.tensor([0, 1]))
    assert time.perf_counter() - t0 >= rec.seconds
    assert rec.seconds == pytest.approx(2 * 400 / 1e6)
    assert eng.describe()["charged_bytes"] == "real"


def test_emulated_default_profile_and_describe():
    eng = make_copy_engine("emulated", DEVICE, None)
    d = eng.describe()
    assert d["emulated"] is True and d["name"] == "emulated"
    assert d["profile"] == "qwen3-30b-a3b-pcie4"
    assert d["bandwidth_gbps"] == 25.0 and d["latency_us"] == 10.0
    assert d["ref_expert_bytes"] == 9_437_184 == 3 * 768 * 2048 * 2
    assert d["inner"]["name"] == "torch"
    import json

    json.dumps(d)  # results files need it JSON-able
    # one Qwen3-30B-A3B expert over PCIe 4.0: 10 us + 9.437 MB / 25 GB/s = 387.5 us
    assert eng.charge_seconds(1, 123) == pytest.approx(10e-6 + 9_437_184 / 25e9)


def test_link_settings_override_profile():
    bw, lat, ref = LinkSettings(profile="qwen3-30b-a3b-pcie5", latency_us=3.0).resolve()
    assert (bw, lat, ref) == (50.0, 3.0, 9_437_184)
    assert LinkSettings(profile="mixtral-8x7b-pcie4").resolve()[2] == 3 * 14336 * 4096 * 2
    assert LinkSettings(profile="olmoe-1b-7b-pcie4").resolve()[2] == 3 * 1024 * 2048 * 2
    with pytest.raises(ValueError, match="bandwidth_gbps is required"):
        LinkSettings(profile=None).resolve()
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        LinkSettings(bandwidth_gbps=0).resolve()
    eng = make_copy_engine("emulated", DEVICE, {"profile": "qwen3-30b-a3b-pcie3", "bandwidth_gbps": 8})
    assert eng.describe()["bandwidth_gbps"] == 8.0
    with pytest.raises(ValueError, match="unknown cache.link key"):
        make_copy_engine("emulated", DEVICE, {"bandwith_gbps": 8})


def test_profile_lookup_errors():
    assert get_profile("qwen3-30b-a3b-pcie4").ref_expert_bytes == 9_437_184
    with pytest.raises(UnknownLinkProfileError) as err:
        get_profile("qwen3-pcie9")
    msg = str(err.value)
    assert "qwen3-pcie9" in msg
    for name in PROFILES:
        assert name in msg
    with pytest.raises(ValueError, match="known profiles"):
        LinkSettings(profile="nope").resolve()


# --------------------------------------------------------------------------------------------------
# Factory


def test_factory_kinds_and_error():
    assert isinstance(make_copy_engine("torch", DEVICE, None), TorchCopyEngine)
    assert isinstance(make_copy_engine("triton", DEVICE, None), TritonCopyEngine)
    assert isinstance(make_copy_engine("emulated", DEVICE, LinkSettings()), EmulatedLinkEngine)
    for kind in ("torch", "triton", "emulated"):
        eng = make_copy_engine(kind, DEVICE, None)
        assert isinstance(eng, CopyEngine)
        assert eng.describe()["name"] == kind == eng.name
        assert eng.describe()["emulated"] is (kind == "emulated")
    with pytest.raises(ValueError, match="cache.copy") as err:
        make_copy_engine("cuda-memcpy", DEVICE, None)
    for kind in ("triton", "torch", "emulated"):
        assert kind in str(err.value)


def test_waits_are_measured_on_the_emulated_link_and_on_cuda_with_a_measuring_timing():
    """Where a ticket's wait is the host's real block, a pass's time holds its stall rather than its
    copies' time (stats, calibration and the report's breakdown use the stall there)."""
    assert copy_base.waits_measured(EmulatedLinkEngine())
    assert not copy_base.waits_measured(TorchCopyEngine("cpu"))  # synchronous: the copy is in the pass's time
    assert copy_base.waits_measured(TorchCopyEngine("cuda")) and copy_base.waits_measured(TorchCopyEngine("cuda", timing="events"))
    assert not copy_base.waits_measured(TorchCopyEngine("cuda", timing="none"))  # the host never blocks: nothing seen
