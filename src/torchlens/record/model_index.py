"""One walk over the model per trace: the address of every module, parameter and buffer by object.

Every part of a trace that needs an address (buffer sources during capture, module records, parameter
records, the save policy) reads this index instead of walking ``named_modules`` again.
"""

from __future__ import annotations

import torch


class ModelIndex:
    def __init__(self, model):
        self.module_addresses: dict = {}  # id(module) -> [every address it is reachable under]
        self.modules: dict = {}  # first address -> module
        self.params: list = []  # (address, Parameter), each parameter once, at its first address
        self.param_addresses: dict = {}  # id(Parameter) -> address
        self.buffers: dict = {}  # id(buffer) -> (buffer, address)
        if isinstance(model, torch.nn.Module):
            self._walk(model)

    def _walk(self, model) -> None:
        for name, module in model.named_modules(remove_duplicate=False):
            if "_orig_mod" in name:  # inside a torch.compile'd submodule: the address it was given
                name = ".".join(part for part in name.split(".") if part != "_orig_mod")
            seen = self.module_addresses.get(id(module))
            if seen is not None:  # an alias: same object, another address
                seen.append(name or "self")
                continue
            self.module_addresses[id(module)] = [name or "self"]
            self.modules.setdefault(name, module)  # a compiled wrapper keeps the address, not its module
            prefix = f"{name}." if name else ""
            for key, p in module._parameters.items():
                if p is not None and id(p) not in self.param_addresses:
                    self.param_addresses[id(p)] = prefix + key
                    self.params.append((prefix + key, p))
            for key, b in module._buffers.items():
                if b is not None and id(b) not in self.buffers:
                    self.buffers[id(b)] = (b, prefix + key)

    def param_names_of(self, module) -> list:
        return [key for key, p in module._parameters.items() if p is not None]
