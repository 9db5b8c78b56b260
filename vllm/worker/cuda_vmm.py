"""Device memory whose virtual address outlives its physical pages (CUDA driver VMM).

Sleep mode gives the KV cache's memory back while a colocated trainer runs. CUDA
graphs captured for decode hold raw pointers into the cache, so the cache must come
back at the SAME address. torch's allocator cannot promise that; the driver's virtual
memory API can: the address range is reserved once (cuMemAddressReserve), and physical
pages are created and mapped into it (cuMemCreate + cuMemMap + cuMemSetAccess) or
unmapped and released (cuMemUnmap + cuMemRelease) independently of it.

The region is exposed to torch through `__cuda_array_interface__` (zero copy), so the
KV cache tensors are ordinary CUDA tensors viewing this range. Touching them while the
region is unmapped is an illegal access: the engine refuses work while asleep.
"""
from __future__ import annotations

import torch


def _driver():
    from cuda.bindings import driver  # package cuda-bindings (installed with CUDA builds of torch)
    return driver


def _call(name: str, *args):
    drv = _driver()
    result = getattr(drv, name)(*args)
    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call {name} failed: {err!r}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class _CudaArray:
    """The minimal object torch.as_tensor accepts for zero-copy wrapping of a device pointer."""

    def __init__(self, ptr: int, nbytes: int, owner: "VirtualMemoryRegion"):
        self.owner = owner  # the tensor keeps this object (and so the region) alive
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class VirtualMemoryRegion:
    """`nbytes` (rounded up to the allocation granularity) of device memory at a fixed
    virtual address; `unmap()` releases the physical pages, `map()` takes new ones."""

    def __init__(self, nbytes: int, device: torch.device):
        drv = _driver()
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self.index):
            torch.cuda.init()
            torch.zeros(1, device=self.device)  # makes the primary context current on this thread
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.index
        self._prop = prop
        gran = int(_call("cuMemGetAllocationGranularity", prop,
                         drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.size = -(-int(nbytes) // gran) * gran
        self._ptr = _call("cuMemAddressReserve", self.size, gran, drv.CUdeviceptr(0), 0)
        self.ptr = int(self._ptr)
        self._handle = None
        self.map()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the range with new physical memory (contents undefined)."""
        if self._handle is not None:
            return
        drv = _driver()
        handle = _call("cuMemCreate", self.size, self._prop, 0)
        try:
            _call("cuMemMap", self._ptr, self.size, 0, handle, 0)
        except BaseException:
            _call("cuMemRelease", handle)
            raise
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            _call("cuMemSetAccess", self._ptr, self.size, [access], 1)
        except BaseException:
            _call("cuMemUnmap", self._ptr, self.size)
            _call("cuMemRelease", handle)
            raise
        self._handle = handle

    def unmap(self) -> None:
        """Give the physical memory back to the driver; the address range stays reserved."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still be using the pages
        _call("cuMemUnmap", self._ptr, self.size)
        _call("cuMemRelease", self._handle)
        self._handle = None

    def as_tensor(self) -> torch.Tensor:
        """A uint8 CUDA tensor over the whole range (views of it are the KV caches)."""
        t = torch.as_tensor(_CudaArray(self.ptr, self.size, self), device=self.device)
        if t.data_ptr() != self.ptr or t.device.type != "cuda":
            raise RuntimeError("wrapping the reserved range as a torch tensor did not keep its address")
        return t

    def close(self) -> None:
        self.unmap()
        _call("cuMemAddressFree", self._ptr, self.size)

    def __del__(self):  # pragma: no cover - interpreter shutdown order is not ours to test
        try:
            if getattr(self, "_ptr", None) is not None:
                self.close()
                self._ptr = None
        except Exception:
            pass
