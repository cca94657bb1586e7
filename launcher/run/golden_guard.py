"""What the golden and the judges can reach, as it was before any implementation ran in this process.

An implementation's module, constructor or call may replace a function the harness also runs
(kernel libraries monkey-patch torch or model functions on import): a golden computed after
that is the implementation's math, not the reference, and stored in the golden cache it would
fail every later run of a correct implementation; a patched comparator could pass anything.
`record()` notes, once per process and before any implementation is imported (the
forkserver's preload, the launcher's preflight, a spawned rank's start; a forked rank inherits
its parent's note), the identity of every callable those reach:

* every module-level callable of the harness's modules (all of `layers.*`, and the `launcher.*`
  modules imported by then: the worker's, the golden cache's, the judges'), the methods of the
  classes they define, and each Python function's code object (swapping `__code__` keeps the
  function's identity); a new callable there (which would shadow a builtin) counts too;
* torch's functional surface the harness calls: `torch.*`, `torch.nn.functional.*`,
  `torch.distributed.*` (the group golden's collectives) and the methods of `torch.Tensor` (a
  method added there shadows the C one), where torch may rebind a name to another of its own
  objects (`set_default_dtype` rebinds `torch.Storage`, importing `torch._dynamo` wraps
  `torch.manual_seed`): only a value from outside torch counts (a Python function whose code
  is not in torch's folder, whatever `functools.wraps` copied onto it);
* `math.*` (the RoPE tables);
* torch's function- and dispatch-mode stacks (a mode pushed for good reroutes every op).

`changes()` names what differs now. Not covered: kernels registered with torch's dispatcher
(`torch.library`) for an aten op, which swap no Python object.
"""

from __future__ import annotations

import importlib
import math
import os
import pkgutil
import sys
import types

import torch
import torch.distributed
import torch.nn.functional

import layers

_HARNESS = ("layers", "launcher")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_RECORD: dict | None = None


def _is_harness(name: str) -> bool:
    return name.split(".")[0] in _HARNESS


def _function(value):
    """The Python function a value is or wraps (a method, static or class method), else None.
    Reads no attribute of anything else: some objects warn or compute when asked."""
    if issubclass(type(value), (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    return value if issubclass(type(value), types.FunctionType) else None


def _watched(value) -> bool:
    # `type()`, not `isinstance`: that reads `__class__`, which some of torch's objects warn on
    return callable(value) or issubclass(type(value), (staticmethod, classmethod, property))


def _torchs_own(value) -> bool:
    function = _function(value)
    if function is not None:
        return function.__code__.co_filename.startswith(_TORCH_DIR)
    named = value if issubclass(type(value), (type, types.BuiltinFunctionType)) else type(value)
    return (named.__module__ or "").split(".")[0] == "torch"


# Which values bound anew in a namespace count (beside a function's swapped code, which always
# does): in the harness's, any callable replaced or added (an added one shadows a builtin or a base
# class's method); in torch's, one replaced or added that is not torch's own; in math's, one replaced.
_ANY, _FOREIGN, _NONE = "any", "foreign", "none"


def _namespaces() -> dict[str, tuple[dict, str]]:
    """`{label: (namespace dict, which values added or rebound there count)}` of everything watched."""
    spaces = {m.__name__: (vars(m), _FOREIGN) for m in (torch, torch.nn.functional, torch.distributed)}
    spaces["torch.Tensor"] = (vars(torch.Tensor), _FOREIGN)
    spaces["math"] = (vars(math), _NONE)
    for name, module in list(sys.modules.items()):
        if not _is_harness(name) or module is None:
            continue
        spaces[name] = (vars(module), _ANY)
        for value in list(vars(module).values()):
            if issubclass(type(value), type) and value.__module__ == name:
                spaces[f"{name}.{value.__qualname__}"] = (vars(value), _ANY)
    return spaces


def _take() -> dict:
    spaces = _namespaces()
    return {
        "modules": {name: module for name, module in sys.modules.items() if _is_harness(name)},
        "spaces": spaces,
        # Every value, watched or not, so that the check passes over what is unchanged by identity alone.
        "entries": {label: {key: _noted(value) for key, value in list(space.items())}
                    for label, (space, _) in spaces.items()},
        "modes": _modes(),
    }


def _noted(value) -> tuple:
    """`(value, its Python function or None, that function's code)`."""
    function = _function(value)
    return value, function, function.__code__ if function is not None else None


def _modes() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def record() -> None:
    """Note what is reachable now, once per process (later calls keep the first note): call it
    before this process imports any implementation. Every `layers` module is imported first,
    so that one an implementation imports later is watched too."""
    global _RECORD
    if _RECORD is not None:
        return
    for info in pkgutil.walk_packages(layers.__path__, "layers."):
        importlib.import_module(info.name)
    _RECORD = _take()


def _name_of(value) -> str:
    """`module.qualname` of a function or class, else its type; and where a function's code
    is when its names were copied from another (`functools.wraps`)."""
    function = _function(value)
    named = function or (value if issubclass(type(value), (type, types.BuiltinFunctionType)) else None)
    if named is None:
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    name = f"{named.__module__ or '?'}.{named.__qualname__}"
    if function is not None and function.__code__.co_qualname != function.__qualname__:
        name += f" (the code of {function.__code__.co_qualname} in {function.__code__.co_filename})"
    return name


def changes() -> list[str]:
    """What differs from the note `record` took, one line each (empty: nothing)."""
    if _RECORD is None:
        raise RuntimeError("golden_guard.record() was not called before any implementation was imported")
    found = [f"sys.modules[{name!r}] was replaced" for name, module in _RECORD["modules"].items()
             if sys.modules.get(name) is not module]
    # The namespaces noted: one replaced as a whole (a module, a class) is named where it was bound.
    entries, spaces = _RECORD["entries"], _RECORD["spaces"]
    recoded = set()  # a function whose code was swapped is named once, not in every module that imports it
    for label, (space, counts) in spaces.items():
        noted = entries[label]
        for key, value in list(space.items()):
            before = noted.get(key)
            if before is not None and before[0] is value:
                function = before[1]
                if function is not None and function.__code__ is not before[2] and id(function) not in recoded:
                    recoded.add(id(function))
                    found.append(f"{function.__module__}.{function.__qualname__} had its code replaced by that of "
                                 f"{function.__code__.co_qualname} in {function.__code__.co_filename}")
                continue
            if not _watched(value) or (counts == _FOREIGN and _torchs_own(value)):
                continue
            if before is not None:
                found.append(f"{label}.{key} was replaced by {_name_of(value)}")
            elif counts != _NONE:
                found.append(f"{label}.{key} was added: {_name_of(value)}")
    found += [f"{label}.{key} was deleted" for label, noted in entries.items()
              for key in noted.keys() - spaces[label][0].keys() if _watched(noted[key][0])]
    if _modes() != _RECORD["modes"]:
        found.append(f"a torch function or dispatch mode was left active (mode stack depths {_RECORD['modes']} "
                     f"before, {_modes()} now)")
    return found
