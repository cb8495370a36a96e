"""A skeleton's copy is what ``copy.deepcopy`` makes, for every model of every family:
the same modules, tensors, attributes and sharing, nothing mutable shared with the
template, and the garbage collector left as it was."""

from __future__ import annotations

import copy
import copyreg
import gc
import types

import pytest
import torch

from ondeck.loading.model_folder import ModelFolder
from ondeck.loading.skeleton import copy_module, set_tensor
from tests.core.helpers import TorchOperations

from .breadth_pipelines import ALL_FAMILIES

# Values deepcopy hands back as they are: a copy may share them with its original.
_SHARED_OK = (
    type(None), bool, int, float, complex, str, bytes, type, torch.dtype, torch.device,
    torch.Size, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
)  # fmt: skip


def shape_of(root) -> list:
    """Everything deepcopy would copy from ``root``, as a list comparable between two
    copies: types, plain values, tensors' kinds and, for every object, the index of its
    first appearance (so sharing inside the tree shows, object identity does not)."""
    seen: dict[int, int] = {}
    out: list = []

    def walk(value) -> None:
        if isinstance(value, _SHARED_OK) and not isinstance(value, tuple):
            out.append(("value", value if not callable(value) else getattr(value, "__name__", "")))
            return
        if id(value) in seen:
            out.append(("seen", seen[id(value)]))
            return
        seen[id(value)] = len(seen)
        out.append(("new", type(value).__name__))
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), value.dtype, value.device.type, value.requires_grad))
        elif isinstance(value, dict):
            for key, item in value.items():
                out.append(("key", key))
                walk(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            for item in items:
                walk(item)
        elif hasattr(value, "__dict__"):
            walk(vars(value))

    walk(root)
    return out


def mutable_objects(root) -> dict[int, str]:
    """id -> where, for every object below ``root`` that a copy must not share."""
    found: dict[int, str] = {}

    def walk(value, where: str) -> None:
        if isinstance(value, _SHARED_OK) or id(value) in found:
            return
        if isinstance(value, tuple) and all(isinstance(v, _SHARED_OK) for v in value):
            return
        found[id(value)] = where
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, (list, tuple, set, frozenset)):
            for index, item in enumerate(value):
                walk(item, f"{where}[{index}]")
        elif hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            walk(vars(value), where)

    walk(root, "")
    return found


def templates(path):
    folder = ModelFolder.open(path)
    for name in folder.component_names:
        if folder.is_model(name):
            yield name, folder.template(name).module


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_a_copy_is_what_deepcopy_makes_and_shares_nothing_mutable(family, folders):
    checked = 0
    for name, template in templates(folders[family]):
        copied = copy_module(template)
        assert shape_of(copied) == shape_of(copy.deepcopy(template)), f"{family}/{name}"
        shared = mutable_objects(template).keys() & mutable_objects(copied).keys()
        where = sorted(mutable_objects(template)[i] for i in shared)[:5]
        assert not shared, f"{family}/{name}: the copy shares {where}"
        checked += 1
    assert checked, f"{family}: no model component"


class _Settings:
    def __init__(self):
        self.sizes = [1, 2]


class _Pickled(torch.nn.Linear):
    """A class with its own pickling: deepcopy copies it, as it would anywhere."""

    def __getstate__(self):
        state = super().__getstate__()
        state["pickled"] = True
        return state


def _shared_parts() -> torch.nn.Module:
    with torch.device("meta"):
        root = torch.nn.Module()
        root.embed = torch.nn.Embedding(8, 4)
        root.head = torch.nn.Linear(4, 8, bias=False)
        root.head.weight = root.embed.weight  # one parameter under two names
        root.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        root.again = root.blocks[1]  # one module under two names
        root.odd = _Pickled(4, 4)
    root.blocks[0]._compiled_call_impl = print  # what Module.compile() sets; not copied
    settings = _Settings()
    root.settings = settings
    root.blocks[0].settings = settings  # one value reached twice
    root.blocks[0].cache = settings.cache = {}  # one empty table reached twice
    return root


def test_what_is_shared_inside_stays_shared_in_the_copy():
    template = _shared_parts()
    copied = copy_module(template)
    assert shape_of(copied) == shape_of(copy.deepcopy(template))
    assert copied.head.weight is copied.embed.weight
    assert copied.again is copied.blocks[1]
    assert copied.settings is copied.blocks[0].settings
    assert copied.blocks[0].cache is copied.settings.cache is not template.settings.cache
    assert copied.settings is not template.settings
    assert copied.odd.pickled and not hasattr(template.odd, "pickled")
    assert "_compiled_call_impl" not in vars(copied.blocks[0])
    assert not mutable_objects(template).keys() & mutable_objects(copied).keys()


def test_a_skeletons_weights_are_copied_without_a_torch_operation():
    # Each operation gives up the interpreter's lock: a load beside a running pipeline
    # then waits to get it back, once per weight.
    with torch.device("meta"):
        template = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    template[0].weight.requires_grad_(False)
    with TorchOperations() as operations:
        copied = copy_module(template)
    assert operations.called == []
    assert copied[0].weight is not template[0].weight
    assert copied[0].weight.is_meta and not copied[0].weight.requires_grad
    assert copied[1].bias.requires_grad


def test_filling_a_copy_leaves_the_template_as_it_was(folders):
    template = dict(templates(folders["sd3"]))["transformer"]
    before = {name: p.requires_grad for name, p in template.named_parameters()}
    copied = copy_module(template)
    for name, parameter in list(copied.named_parameters()):
        parameter.requires_grad_(not parameter.requires_grad)  # in place, on the copy's
        value = torch.zeros(parameter.shape, dtype=parameter.dtype)
        set_tensor(copied, name, torch.nn.Parameter(value), parameter=True)
    copied.register_forward_hook(lambda *args: None)
    copied.transformer_blocks[0].processor_note = "set on the copy"
    assert {p.device.type for p in template.parameters()} == {"meta"}
    assert {name: p.requires_grad for name, p in template.named_parameters()} == before
    assert not template._forward_hooks
    assert not hasattr(template.transformer_blocks[0], "processor_note")


class _Sized(torch.nn.Linear):
    """Made again from its arguments, as pickling does."""

    def __new__(cls, in_features, out_features, **kwargs):
        return super().__new__(cls)

    def __getnewargs__(self):
        return (self.in_features, self.out_features)


class _Registered(torch.nn.Linear):
    pass


class _CopiesModules:
    """A value whose own __deepcopy__ copies a module in turn."""

    def __init__(self, module):
        self.module = module

    def __deepcopy__(self, memo):
        return _CopiesModules(copy_module(self.module))


def test_classes_that_copy_their_own_way_are_copied_as_deepcopy_copies_them():
    with torch.device("meta"):
        root = torch.nn.Module()
        root.sized = _Sized(2, 3)
        root.registered = _Registered(2, 3)
        root.inner = torch.nn.Linear(3, 3)
    root.holder = _CopiesModules(root.inner)
    copyreg.pickle(_Registered, lambda m: (_Registered, (4, 5)))
    try:
        copied = copy_module(root)  # nested copy_module: no deadlock
        assert shape_of(copied) == shape_of(copy.deepcopy(root))
    finally:
        del copyreg.dispatch_table[_Registered]
    assert copied.registered.in_features == 4  # copyreg's reducer was asked
    assert copied.sized.out_features == 3
    assert copied.holder.module is not root.inner
    assert gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(enabled, folders):
    template = dict(templates(folders["sd3"]))["transformer"]
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        copy_module(template)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
