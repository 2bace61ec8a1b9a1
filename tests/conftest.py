"""Shared fixtures. Triton runs on the CPU only through its interpreter, so CI sets it here; on a
machine with CUDA the Triton kernels run compiled (tests/core/test_cuda.py), not interpreted."""

from __future__ import annotations

import copy
import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("SPECFIT_DISABLE_PLUGIN_AUTOLOAD", "0")

import pytest  # noqa: E402

torch.set_num_threads(1)  # tiny models: threads only add overhead and noise on a shared machine

from specfit.model.builtin import build_builtin  # noqa: E402
from specfit.offload.copy.triton import triton_interpret_enabled  # noqa: E402

ARCHITECTURES = ["tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral"]

# Triton on CPU tensors runs only in its interpreter, set above where CUDA is absent; on a CUDA
# machine tests/core/test_cuda.py runs the kernels compiled instead.
TRITON_ON_CPU = pytest.mark.skipif(not triton_interpret_enabled(),
                                   reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (CUDA machines: test_cuda.py)")


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory, monkeypatch):
    """Calibrations a test makes go to a temporary SPECFIT_HOME, never the user's cache."""
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path_factory.getbasetemp() / "specfit-home"))


@pytest.fixture(autouse=True)
def _fresh_hydra():
    """Each test composes from scratch (Hydra keeps global state: the loader, and the config of the last
    in-process ``specfit <command>``, which bench reads to know which command it runs)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    yield
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None


@pytest.fixture(autouse=True)
def _notes_said_afresh():
    """Each test sees its own notes: ``note_once`` says a note once per process (a bench builds one
    engine per method), and a test run is one process."""
    from specfit import messages as config_messages
    config_messages._noted.clear()


_MODELS: dict[tuple, torch.nn.Module] = {}


def tiny_model(name: str = "tiny-qwen3-moe", seed: int = 0, **overrides) -> torch.nn.Module:
    """A fresh copy of a built-in tiny model (built once per session, then deep-copied)."""
    key = (name, seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_builtin(name, seed=seed, **overrides)
    return copy.deepcopy(_MODELS[key])


def tiny_model_with_scaled_norms() -> torch.nn.Module:
    """The tiny Qwen3-MoE with its post-attention norms' scales drawn in [0.2, 3]: a router fold
    that drops the scales picks other experts on it."""
    model = tiny_model()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("post_attention_layernorm"):
                module.weight.uniform_(0.2, 3.0, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.fixture
def make_model():
    return tiny_model
