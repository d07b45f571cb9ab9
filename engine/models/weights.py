"""Checkpoint weights as the models' load_weights reads them: a mapping of tensor names to
tensors, plus `copy_to`, which copies one tensor into a parameter (converting its dtype)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class Weights(Mapping[str, torch.Tensor]):
    def copy_to(self, name: str, dest: torch.Tensor) -> None:
        """dest[...] = self[name], converted to dest's dtype and device; a shape that differs
        is a ValueError."""
        source = self[name]
        if source.shape != dest.shape:
            raise ValueError(f"the checkpoint's {name!r} is {list(source.shape)}; the model's "
                             f"config implies {list(dest.shape)}")
        dest.copy_(source)


class SafetensorsWeights(Weights):
    """The tensors of a checkpoint directory (model.safetensors, or the shards its
    model.safetensors.index.json names), each read from disk when it is looked up, in the
    checkpoint's dtype, on the CPU.

    Plain reads, not safetensors' memory map: mapped pages stay resident while the file is
    open, so loading through the map would hold the whole checkpoint beside the model."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [f.name for f in sorted(path.glob("*.safetensors"))]
        if not files:
            raise ValueError(f"no .safetensors weights in {path}; convert the checkpoint first")
        self._entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for name in files:
            self._entries.update(_read_header(path / name))

    def __getitem__(self, name: str) -> torch.Tensor:
        _, dtype, shape, start, end = self._entries[name]
        data = torch.empty(end - start, dtype=torch.uint8)
        self._read(name, data)
        return data.view(dtype).view(shape)

    def copy_to(self, name: str, dest: torch.Tensor) -> None:
        _, dtype, shape, _, _ = self._entries[name]
        if tuple(dest.shape) != shape:
            raise ValueError(f"the checkpoint's {name!r} is {list(shape)}; the model's config "
                             f"implies {list(dest.shape)}")
        if dest.device.type != "cpu" or dest.dtype != dtype or not dest.is_contiguous():
            dest.copy_(self[name])  # converted (and moved) as it is copied in
            return
        self._read(name, dest.detach().view(torch.uint8))  # already in the model's dtype

    def _read(self, name: str, out: torch.Tensor) -> None:
        """The bytes of tensor `name` into `out` (contiguous uint8 on the CPU, sized to fit)."""
        file, _, _, start, end = self._entries[name]
        with open(file, "rb") as f:
            f.seek(start)
            if f.readinto(out.numpy().data) != end - start:
                raise ValueError(f"{file} ends inside tensor {name!r}: the file is truncated")

    def __contains__(self, name: object) -> bool:  # (Mapping's default would read the tensor)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _read_header(file: Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]]:
    """{tensor name: (file, dtype, shape, first byte, end byte)} from a .safetensors header (an
    8-byte little-endian length, then that many bytes of JSON; offsets count from its end)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which the "
                             "loader does not read")
        begin, end = info["data_offsets"]
        entries[name] = (file, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                         8 + size + begin, 8 + size + end)
    return entries
