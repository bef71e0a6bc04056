"""Every QuantSpec field travels with its spec wherever the spec goes: an NVFP4Tensor holds it
(built, flattened and unflattened, viewed, pickled, compiled), FSDP2's fp4 all-gather hooks carry
it, and the backend operators encode and decode it (and every enum and dataclass of spec.py)
across the torch.compile boundary. The specs are made from ``dataclasses.fields(QuantSpec)``, so
a new field fails here until it has a non-default value (derived from its type, or given in
``_NON_DEFAULT``) and until every carrier keeps it.
"""

import dataclasses
import enum
import io
import pickle
import types
import typing
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from nvfp4_recipe import NVFP4Tensor
from nvfp4_recipe import reference as R
from nvfp4_recipe import spec as spec_module
from nvfp4_recipe.backends import operators
from nvfp4_recipe.fsdp import FP4AllGatherWeight, GatherState
from nvfp4_recipe.operand import GroupedOperand, NVFP4Operand
from nvfp4_recipe.spec import Block, Form, FourOverSix, GemmRole, MSEden, Override, QuantSpec

from nvfp4_cases import rand, signs_for

# The non-default values that a field's type does not give (an enum's other member, a bool's
# negation and a spec dataclass with every field non-default are derived), by class and field.
_NON_DEFAULT = {(QuantSpec, "amax_scale"): 0.75, (FourOverSix, "e4m3_max"): 448,
                (MSEden, "rotation"): 32}
# Fields whose non-default value excludes the others' (an MS-EDEN spec brings its own rotation,
# rounding and scales): at their defaults in the specs with every other field non-default, and
# non-default alone.
_EXCLUSIVE = ("ms_eden",)


def _non_default(cls: type, field: dataclasses.Field):
    """A valid value of ``cls``'s field ``field`` other than its default.

    Raises:
        AssertionError: naming the field, when no such value is known: give it one in
            ``_NON_DEFAULT``.
    """
    kind = field.type
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # Optional[X]: X
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    if (cls, field.name) in _NON_DEFAULT:
        value = _NON_DEFAULT[cls, field.name]
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        value = next(m for m in kind if m != field.default)
    elif kind is bool:
        value = not field.default
    elif dataclasses.is_dataclass(kind):
        value = _all_non_default(kind)
    else:
        raise AssertionError(f"no non-default value known for {cls.__name__}.{field.name} "
                             f"({field.type}): add one to _NON_DEFAULT in {__name__}")
    assert value != field.default, (cls.__name__, field.name)
    return value


def _all_non_default(cls: type):
    return cls(**{f.name: _non_default(cls, f) for f in dataclasses.fields(cls)})


def _specs() -> dict:
    """Every field non-default but one of block and scaling (2d blocks take no per-token scaling)
    and the _EXCLUSIVE ones, and each field alone non-default (so that no dropped or swapped field
    hides behind another)."""
    fields = {f.name: _non_default(QuantSpec, f) for f in dataclasses.fields(QuantSpec)}
    default = {name: getattr(QuantSpec(), name) for name in _EXCLUSIVE}
    specs = {f"all but {name}": QuantSpec(**dict(fields, **default, **{name: getattr(QuantSpec(), name)}))
             for name in ("block", "scaling")}
    return dict(specs, **{name: dataclasses.replace(QuantSpec(), **{name: value})
                          for name, value in fields.items()})


SPECS = _specs()


def _tensor(spec: QuantSpec, seed: int) -> NVFP4Tensor:
    """A fresh (32, 64) tensor quantized under ``spec`` by the reference (with RHT signs where
    the spec has the RHT, rotation signs for MS-EDEN, which the tensor does not hold)."""
    signs = signs_for(seed) if spec.rht else None
    rotation = R.rotation_signs(seed, 0, spec.ms_eden.rotation) if spec.ms_eden else signs
    op = R.quantize(rand((32, 64), seed=seed), spec, seed=seed, rht_signs=rotation)
    return NVFP4Tensor.from_operand(op, torch.bfloat16, signs, "reference")


def test_the_specs_set_every_field_of_quantspec_and_fouroversix():
    for f in dataclasses.fields(QuantSpec):
        assert getattr(SPECS[f.name], f.name) != f.default
    for f in dataclasses.fields(FourOverSix):
        assert getattr(SPECS["four_over_six"].four_over_six, f.name) != f.default
    for f in dataclasses.fields(MSEden):
        assert getattr(SPECS["ms_eden"].ms_eden, f.name) != f.default


# ---------------------------------------------------------------------------- NVFP4Tensor
@pytest.mark.parametrize("name", SPECS)
def test_an_nvfp4_tensor_keeps_every_field(name):
    """The tensor holds the spec whole: through flatten/unflatten (torch.compile's view of it),
    views, slices, moves, pickle, torch.save/load (weights_only) and a compiled function."""
    spec = SPECS[name]
    t = _tensor(spec, seed=len(name))
    names, attributes = t.__tensor_flatten__()
    assert attributes["spec"] is spec
    unflattened = NVFP4Tensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, attributes,
                                                   t.shape, t.stride())
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    torch._dynamo.reset()  # one compile per spec: more specs than Dynamo's recompile limit
    compiled = torch.compile(lambda a: a.clone(), backend="aot_eager", fullgraph=True)(t)
    values = t.dequantize(torch.float32)
    for u, want in ((unflattened, values), (t.t().t(), values), (t[16:32], values[16:32]),
                    (t.to(torch.float32), values), (t.detach(), values),
                    (pickle.loads(pickle.dumps(t)), values),
                    (torch.load(buf, weights_only=True), values), (compiled, values)):
        assert type(u) is NVFP4Tensor and u.spec == spec and u.operand.spec == spec
        assert torch.equal(u.dequantize(torch.float32), want)
    assert (t.block, t.scaling, t.rounding, t.amax_scale, t.four_over_six) == (
        spec.block, spec.scaling, spec.rounding, spec.amax_scale, spec.four_over_six)


# ---------------------------------------------------------------------------- FSDP2 hooks
@pytest.fixture(scope="module")
def mesh():
    """A one-rank CPU (gloo) mesh: the hooks' amax all-reduce runs, on one shard."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _layer(spec: QuantSpec):
    """What the hooks read of an NVFP4Linear (32, 64): a recipe whose W spec is ``spec`` (2d
    weights flag, no override, the reference backend)."""
    recipe = types.SimpleNamespace(spec={GemmRole.W_FPROP: spec}.__getitem__, weight_2d=True,
                                   forward_override=None, backward_override=None,
                                   backend="reference")
    return types.SimpleNamespace(recipe=recipe, out_features=32, in_features=64)


# a weight takes no RHT nor MS-EDEN (the recipe puts them on backward operands only): the shard is
# quantized without signs
GATHERED = {name: dataclasses.replace(spec, rht=False) for name, spec in SPECS.items()
            if name not in ("rht", "ms_eden")}


@pytest.mark.parametrize("name", GATHERED)
def test_the_fsdp_all_gather_hooks_carry_every_field(mesh, name):
    """fsdp_pre_all_gather quantizes the shard under the layer's W spec, fsdp_post_all_gather
    makes the unsharded NVFP4Tensor under that spec, with the reference's bits (one rank: the
    shard is the weight); a later gather into the same tensor (``out``) carries it too."""
    spec = GATHERED[name]
    w = rand((32, 64), dtype=torch.float32, seed=len(name))
    weight = FP4AllGatherWeight(w, GatherState(name))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    inputs, metadata = weight.fsdp_pre_all_gather(mesh, w.shape, w.stride(), _layer(spec), policy)
    gathered, _ = weight.fsdp_post_all_gather(inputs, metadata, torch.bfloat16)
    want = R.quantize(w.bfloat16(), spec)
    assert gathered.spec == spec and gathered.dtype == torch.bfloat16
    assert torch.equal(gathered.qdata, want.qdata) and torch.equal(gathered.outer_scale,
                                                                   want.outer_scale)
    assert torch.equal(gathered.scale.view(torch.uint8), want.scale.view(torch.uint8))
    earlier = NVFP4Tensor(gathered.qdata, gathered.scale, torch.ones(()), QuantSpec(),
                          torch.bfloat16, False)
    assert weight.fsdp_post_all_gather(inputs, metadata, torch.bfloat16, out=earlier) is None
    assert earlier.spec == spec and torch.equal(earlier.outer_scale, want.outer_scale)


# ---------------------------------------------------------------------------- the operators
def _round_trip(value):
    """``value`` encoded as an operator call's key and decoded, as registered operators do."""
    tensors = []
    key = repr(operators._encode(value, tensors))
    return operators._decode(operators._parse(key), iter(tensors))


def _spec_enums():
    return [v for v in vars(spec_module).values() if isinstance(v, type)
            and issubclass(v, enum.Enum) and v.__module__ == spec_module.__name__ and len(v)]


def test_every_enum_member_of_spec_crosses_the_operator_boundary():
    enums = _spec_enums()
    assert {Block, Form, Override, GemmRole} <= set(enums)
    for kind in enums:
        for member in kind:
            assert _round_trip(member) is member


@pytest.mark.parametrize("name", SPECS)
def test_every_field_crosses_the_operator_boundary(name):
    """A spec alone, in an operand, in a grouped operand and in a dict comes back equal, with the
    same tensors."""
    spec = SPECS[name]
    t = _tensor(spec, seed=len(name))
    op = t.operand
    grouped = GroupedOperand(op, torch.tensor([16, 32], dtype=torch.int32), True, spec.per_token)
    got_spec, got_op, got_grouped, got_kw = _round_trip(
        (spec, op, grouped, {"spec": spec, "role": GemmRole.X_WGRAD, "dtype": torch.bfloat16}))
    assert got_spec == spec and got_op.spec == spec and got_grouped.data.spec == spec
    assert got_kw == {"spec": spec, "role": GemmRole.X_WGRAD, "dtype": torch.bfloat16}
    assert type(got_op) is NVFP4Operand and type(got_grouped) is GroupedOperand
    assert got_op.qdata is op.qdata and got_grouped.offs is grouped.offs
    assert got_grouped[2:] == (True, spec.per_token)


def _echo(ops, *values):
    return ops, values


ECHO = operators.register("test_spec_fields_echo", _echo, traced=False)


def test_every_field_and_enum_crosses_a_compiled_operator():
    """Operands under every spec and a member of every enum of spec.py through a registered
    operator under torch.compile (fullgraph): the specs and members come back as they went."""
    ops = tuple(_tensor(spec, seed=i).operand for i, spec in enumerate(SPECS.values()))
    members = tuple(kind(next(iter(kind)).value) for kind in _spec_enums())
    torch._dynamo.reset()
    got_ops, got_members = torch.compile(lambda o: ECHO(o, *members), backend="aot_eager",
                                         fullgraph=True)(ops)
    assert got_members == members
    for got, op, spec in zip(got_ops, ops, SPECS.values()):
        assert got.spec == op.spec == spec and torch.equal(got.qdata, op.qdata)
        assert torch.equal(got.scale.view(torch.uint8), op.scale.view(torch.uint8))


def test_a_type_outside_the_registry_is_refused_where_it_is_encoded():
    """Not a KeyError in a decode: a TypeError naming the type, whatever its name."""
    Local = enum.Enum("Block", {"D1": "1d"})  # named like spec.Block, not it
    Point = namedtuple("Point", "x")

    @dataclasses.dataclass(frozen=True)
    class QuantSpec:  # noqa: F811 (named like spec.QuantSpec, not it)
        block: str = "1d"

    for value in (Local.D1, Point(1), QuantSpec()):
        with pytest.raises(TypeError, match=f"{type(value).__name__} cannot be passed to an "
                                            f"NVFP4 operator"):
            operators._encode(value, [])
