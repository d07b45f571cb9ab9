"""Kernel launches planned once per step and replayed by every layer.

A step's launches depend on its metadata (block tables, lengths, grids, scratch buffers) and on
the shapes of the layer tensors, which every layer shares; between layers only the layer tensors'
addresses change (the query, this step's keys and values, the output, the layer's K and V cache).
`LayerLaunches` takes the first layer's launch records, marshals them once (engine/kernels.py's
`launch_params`, the same for CuPy and the CPU shim) and notes which parameters are the layer
tensors' addresses; every layer then writes its own addresses there and launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels

LayerTensors = tuple[torch.Tensor, ...]


@dataclass
class _Prepared:
    fn: kernels.KernelFn
    grid: kernels.Dim3
    block: kernels.Dim3
    params: list[kernels.Param]
    holes: list[tuple[int, int]]  # (parameter position, index of the layer tensor)


class LayerLaunches:
    """The launches of one attention call, for the layer tensors of every layer in a step."""

    def __init__(self, launches: list[kernels.Launch], layer: LayerTensors,
                 launcher: kernels.Launcher) -> None:
        self.launches = launches  # keeps the step's tensors that the launches point at alive
        # What the marshalled parameters assume of every layer's tensors. (Not the device: a
        # layer's tensors stay on the device of the cache they attend to.)
        self._expected = [(t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in layer]
        bases = {t.data_ptr(): j for j, t in enumerate(layer) if t.numel()}
        assert len(bases) == sum(1 for t in layer if t.numel()), "layer tensors share an address"
        spans = [_span(t) for t in layer if t.numel()]
        self._prepared = []
        for launch in launches:
            params = list(kernels.launch_params(launch.args))
            holes = []
            for i, (arg, param) in enumerate(zip(launch.args, params)):
                if isinstance(arg, torch.Tensor) and arg.numel():
                    ptr = int(param)
                    if ptr in bases:
                        holes.append((i, bases[ptr]))
                    else:  # a step tensor: it must not lie inside a layer tensor
                        assert not any(lo <= ptr < hi for lo, hi in spans), launch.kernel
            self._prepared.append(_Prepared(launcher.function(launch.kernel, launch.variant),
                                            launch.grid, launch.block, params, holes))

    def launch(self, layer: LayerTensors) -> None:
        """Runs the planned launches on this layer's tensors (shaped like the first layer's)."""
        ptrs = []
        for t, (shape, stride, dtype, alignment) in zip(layer, self._expected):
            address = t.data_ptr()
            if (t.shape != shape or t.stride() != stride or t.dtype != dtype
                    or address % 16 != alignment):
                raise ValueError("a layer's attention tensors differ in shape, strides, dtype or "
                                 "alignment from the step's first layer")
            ptrs.append(address)  # (an empty tensor is never a hole)
        for p in self._prepared:
            params = p.params
            for i, j in p.holes:
                params[i] = ptrs[j]
            p.fn(p.grid, p.block, tuple(params))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] of a strided tensor (non-negative strides)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
