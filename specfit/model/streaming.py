"""Streaming a safetensors checkpoint into a model built on the meta device: one copy of the weights.

The model is built from its config with its parameters on the meta device (no memory; buffers such
as rotary ``inv_freq`` are real), then the checkpoint is read tensor by tensor: dense weights go
straight to the device in their dtype, experts into the :class:`HostExpertStore`, their only host
copy. Nothing ever holds a whole state dict, so building an engine peaks near the checkpoint's size
(transformers' own load, then the runtime's copy into its store, peaked at 2.3-3.5x; issue 13).

Tensors are read with plain reads into a tensor of their own dtype, not through a memory map: the pages
of a mapped file count as the process's resident memory until it is unmapped, which would double
the peak of a one-file checkpoint. Checkpoint key layouts (those transformers 5.24's
``conversion_mapping.py`` converts for the supported families, and its own fused layout):

- per expert: ``<experts>.N.gate_proj/up_proj/down_proj.weight`` (Qwen2/3-MoE, OLMoE, DeepSeek) and
  ``block_sparse_moe.experts.N.w1/w3/w2.weight`` with ``block_sparse_moe.gate`` (Mixtral);
- fused, as transformers 5 modules hold them: ``<experts>.gate_up_proj [E, 2I, H]`` and
  ``down_proj [E, H, I]``; gpt-oss: ``gate_up_proj [E, H, 2I]`` (gate/up interleaved),
  ``down_proj [E, I, H]`` and their ``_bias`` tensors, normalised to the store's canonical rows.

Every shape is checked against the model before any data is read (the headers say them), and
missing or unexpected tensors are one ModelError naming the first few.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import nn

from specfit.errors import ModelError

if TYPE_CHECKING:
    from specfit.offload.store import HostExpertStore
    from specfit.types.moe import MoESpec

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}

# Per-expert checkpoint names of the three projections (Qwen/OLMoE/DeepSeek and Mixtral spellings).
PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
PER_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
FUSED = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


# --------------------------------------------------------------------------- reading safetensors


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(file: Path) -> tuple[int, dict[str, Any]]:
    """The data offset and header of a safetensors file (``check_safetensors`` has vetted it)."""
    import json

    with file.open("rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        return 8 + length, json.loads(fh.read(length))


class SafetensorsReader:
    """The tensors of one checkpoint's safetensors files, read one at a time (plain reads, no mmap)."""

    def __init__(self, files: Iterable[Path], what: str) -> None:
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            base, header = read_header(file)
            for name, info in sorted(header.items(), key=lambda kv: _offset(kv[1])):
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ModelError(f"{what}: {file.name}: tensor {name} has dtype {info['dtype']}, which specfit cannot read")
                begin, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(s) for s in info["shape"])
                numel = 1
                for size in shape:
                    numel *= size
                if end - begin != numel * dtype.itemsize:
                    raise ModelError(f"{what}: {file.name}: tensor {name} has {end - begin} bytes, its shape {list(shape)} "
                                     f"and dtype {info['dtype']} need {numel * dtype.itemsize} (a corrupt header)")
                self.entries[name] = TensorEntry(file, dtype, shape, base + begin, end - begin)
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        """Every tensor, shard by shard, in file order (sequential reads)."""
        return list(self.entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            fh = self._handles.get(entry.file)
            if fh is None:
                fh = self._handles[entry.file] = entry.file.open("rb", buffering=0)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
            fh.seek(entry.start)
            done = 0
            while done < entry.nbytes:
                n = fh.readinto(view[done:])
                if not n:
                    raise ModelError(f"{entry.file.name}: tensor {name} is cut short")
                done += n
        return tensor

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()


def _offset(info: Any) -> int:
    return int(info["data_offsets"][0]) if isinstance(info, dict) and "data_offsets" in info else -1


# --------------------------------------------------------------------------- building on meta


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside live on the meta device (shapes only); buffers stay real.

    Rotary ``inv_freq`` and similar buffers are computed in ``__init__`` and not stored in
    checkpoints: building under ``torch.device("meta")`` would lose their values."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------- where each tensor goes


@dataclass(frozen=True)
class Dense:
    name: str  # the model's parameter (or persistent buffer) name
    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype the model declares for it (transformers' keep-in-fp32 plan applied)


@dataclass(frozen=True)
class Expert:
    layer: int  # MoE layer index (the store's)
    experts: int | slice
    part: str  # the store's part: gate | up | down | gate_up | down_bias | gate_up_bias
    module: nn.Module  # the model's experts module (meta): its layout decides the normalisation
    fused: str | None  # the module's attribute a fused tensor has the layout of; None: one expert


class CheckpointPlan:
    """Maps checkpoint names to model parameters or store parts, and checks shapes from headers."""

    def __init__(self, model: nn.Module, experts: list[tuple[str, nn.Module]], spec: MoESpec, dtype: torch.dtype,
                 what: str) -> None:
        self.model, self.spec, self.what = model, spec, what
        self.experts = {name: (layer, module) for layer, (name, module) in enumerate(experts)}
        expert_params = {f"{name}.{p}" for name, module in experts for p, _ in module.named_parameters()}
        keep_fp32 = _keep_in_fp32(model, dtype)
        self.dense: dict[str, Dense] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            if module_name in self.experts:
                continue
            persistent = [(n, b) for n, b in module._buffers.items()
                          if b is not None and n not in module._non_persistent_buffers_set]
            for attr, tensor in [*module._parameters.items(), *persistent]:
                if tensor is None:
                    continue
                name = f"{module_name}.{attr}" if module_name else attr
                if name in expert_params:
                    continue
                target = torch.float32 if keep_fp32 and keep_fp32.search(name) and tensor.is_floating_point() else tensor.dtype
                self.dense[name] = Dense(name, module, attr, tuple(tensor.shape), target)
        self.non_persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                               for b in mod._non_persistent_buffers_set}
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
        self.ignore = [re.compile(p) for p in ignore]
        self.rename_mixtral = not any(".block_sparse_moe." in n for n in self.dense) and not any(
            ".block_sparse_moe" in n for n in self.experts)
        prefix = getattr(model, "base_model_prefix", "") or ""
        self.prefix = f"{prefix}." if prefix and any(n.startswith(f"{prefix}.") for n in self.dense) else ""
        self.loaded_dense: set[str] = set()
        self.covered: set[tuple[int, int, str]] = set()

    def model_name(self, key: str) -> str:
        """The name ``key`` has in the model: Mixtral's ``block_sparse_moe`` is the module's ``mlp``,
        and a base-model checkpoint (no ``model.`` prefix) loads into the causal LM."""
        if self.rename_mixtral and ".block_sparse_moe." in key:
            key = key.replace(".block_sparse_moe.", ".mlp.")
        if self.prefix and not key.startswith(self.prefix) and (
                self.prefix + key in self.dense or _experts_prefix(self.prefix + key, self.experts)):
            key = self.prefix + key
        return key

    def target(self, key: str, shape: tuple[int, ...]) -> Dense | Expert | None:
        """Where the checkpoint tensor ``key`` of ``shape`` goes; None: the model has no use for it
        (ignored when transformers ignores it, else unexpected). A shape the config does not imply
        is a ModelError naming the tensor."""
        name = self.model_name(key)
        dense = self.dense.get(name)
        if dense is not None:
            if shape != dense.shape:
                raise self.mismatch(key, shape, dense.shape)
            return dense
        found = _experts_prefix(name, self.experts)
        if found is None:
            return None
        module_name, rest = found
        layer, module = self.experts[module_name]
        spec = self.spec
        match = PER_EXPERT.match(rest)
        if match:
            expert, part = int(match.group(1)), PER_EXPERT_PART[match.group(2)]
            want = (spec.hidden_size, spec.intermediate_size) if part == "down" else (spec.intermediate_size, spec.hidden_size)
            if expert >= spec.num_experts:
                raise ModelError(f"{self.what}: weights do not fit config.json: {key} is expert {expert}, the config "
                                 f"implies {spec.num_experts} experts per layer")
            if shape != want:
                raise self.mismatch(key, shape, want)
            return Expert(layer, expert, part, module, None)
        if rest in FUSED and isinstance(getattr(module, rest, None), torch.Tensor):
            want = tuple(getattr(module, rest).shape)
            if shape != want:
                raise self.mismatch(key, shape, want)
            part = {"gate_up_proj": "gate_up", "down_proj": "down", "gate_up_proj_bias": "gate_up_bias",
                    "down_proj_bias": "down_bias"}[rest]
            return Expert(layer, slice(0, spec.num_experts), part, module, rest)
        return None

    def ignored(self, key: str) -> bool:
        """Tensors transformers skips silently: its ``_keys_to_ignore_on_load_unexpected`` (DeepSeek-V3's
        MTP layer, qwen3_next's ``mtp``) and non-persistent buffers some checkpoints carry (``inv_freq``)."""
        name = self.model_name(key)
        return name in self.non_persistent or any(p.search(key) or p.search(name) for p in self.ignore)

    def record(self, target: Dense | Expert) -> None:
        if isinstance(target, Dense):
            self.loaded_dense.add(target.name)
            return
        parts = {"gate_up": ("gate", "up")}.get(target.part, (target.part,))
        experts = range(self.spec.num_experts)[target.experts] if isinstance(target.experts, slice) else [target.experts]
        for e in experts:
            for p in parts:
                self.covered.add((target.layer, e, p))

    def missing_experts(self) -> list[str]:
        """Expert parts no checkpoint tensor covers, named by their module (``...experts expert 3 up``)."""
        parts = ["gate", "up", "down"] + (["gate_up_bias", "down_bias"] if self.spec.layout.bias else [])
        names = list(self.experts)
        return [f"{names[layer]} expert {e} {p}" for layer in range(self.spec.num_layers)
                for e in range(self.spec.num_experts) for p in parts if (layer, e, p) not in self.covered]

    def mismatch(self, key: str, ckpt: tuple[int, ...], model: tuple[int, ...]) -> ModelError:
        return ModelError(f"{self.what}: weights do not fit config.json: {key} has shape {tuple(ckpt)} in the "
                          f"checkpoint, the config implies {tuple(model)}")


def _experts_prefix(name: str, experts: dict[str, Any]) -> tuple[str, str] | None:
    """(experts module name, the rest of ``name``) when ``name`` lies under an experts module."""
    head, sep, _ = name.rpartition(".experts.")
    if not sep:
        return None
    module_name = f"{head}.experts"
    return (module_name, name[len(module_name) + 1:]) if module_name in experts else None


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """transformers' keep-in-fp32 plan: ``_keep_in_fp32_modules`` for fp16, ``..._strict`` for fp16 and bf16."""
    names: list[str] = []
    if dtype == torch.float16:
        names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        names += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return re.compile("|".join(n.replace("*", ".*") for n in names)) if names else None


# --------------------------------------------------------------------------- loading


def stream_into(model: nn.Module, store: HostExpertStore, plan: CheckpointPlan,
                tensors: Iterable[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]],
                device: torch.device, dense_dtype: Callable[[torch.dtype], torch.dtype]) -> list[str]:
    """Read ``tensors`` ((name, read, shape) in order) into ``model`` and ``store``; returns the
    unexpected names (the caller reports them with the missing ones)."""
    unexpected: list[str] = []
    for key, read, shape in tensors:
        target = plan.target(key, tuple(shape))
        if target is None:
            if not plan.ignored(key):
                unexpected.append(key)
            continue
        tensor = read()
        if isinstance(target, Dense):
            if tensor.is_floating_point():
                tensor = tensor.to(target.dtype)  # the model's dtype first: exact upcasts these values
                tensor = tensor.to(device=device, dtype=dense_dtype(target.dtype))
            else:
                tensor = tensor.to(device)
            if target.attr in target.module._parameters:
                target.module._parameters[target.attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                target.module._buffers[target.attr] = tensor
        else:
            if target.fused is not None:
                tensor = canonical_fused(target.module, target.part, tensor)
            store.write(target.layer, target.experts, target.part, tensor)
        plan.record(target)
        del tensor
    return unexpected


def canonical_fused(module: nn.Module, part: str, tensor: torch.Tensor) -> torch.Tensor:
    """A fused experts tensor in the store's canonical layout, from the layout of the module it
    was saved from (transformers' ``is_transposed``, ``is_concatenated``: gpt-oss stores
    ``[E, H, 2I]`` with gate/up interleaved), by the store's own normaliser."""
    from specfit.offload.store import canonical

    return canonical(part, tensor, transposed=bool(getattr(module, "is_transposed", False)),
                     interleaved=not getattr(module, "is_concatenated", True))
