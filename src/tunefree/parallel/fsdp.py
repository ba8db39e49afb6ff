"""Sharded private training on FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``torchrun``.

The user shards the model as usual (``fully_shard`` on each layer or block, then on the root); every
parameter is then a ``DTensor`` holding rank r's rows (dim-0 shard, padded as FSDP2 pads) of a full
parameter. tunefree keys everything by these sharded parameters: the optimizer holds them and receives
their released ``.grad``.

In each layer's forward FSDP2 all-gathers the layer's full, *unsharded* parameters and swaps them into
the module (its pre-forward hook runs before the engine's). The engine takes those tensors out of
autograd's graph for the call (``capture.tensors_in_call``), so autograd computes no ordinary gradient
for them and FSDP2's own reduce-scatter has nothing to reduce (it is switched off as well, from
:meth:`ShardedDataParallel.take_over` to :meth:`ShardedDataParallel.release_model`). The per-sample
norms need no communication: a layer rule computes them from the layer's inputs and output gradients,
which are whole on each rank (each rank holds its own examples and the full layer during its call).

The clipped sums never wait, full size, for the step: the accumulator's sink (:class:`ShardSink`)
reduce-scatters each parameter's sum into FSDP2's dim-0 shards the moment the engine completes it
(per-layer groups: in the backward pass, as each layer is clipped; all-layer groups: as each weighted sum
is formed) and keeps only this rank's shard, the sum over all ranks of its own rows. At the step, the
release (:meth:`ShardedDataParallel.noisy_sum`) has the ranks agree that none found an ordinary
gradient, then adds the Gaussian noise of this rank's shard (each coordinate noised by exactly one rank:
total variance σ²S² whatever the world size) and writes the result as the sharded ``.grad``. Every rank
records the same event. The step components' few numbers (clip counts) are summed over the ranks and
noised once (:meth:`ShardedDataParallel.noisy_values`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ..clipping.groups import ClipGroup
from ..dtypes import accumulation_dtype
from ..errors import PrivacyError
from ..privacy.mechanisms import add_shard_noise
from ..privacy.randomness import NoiseSource
from ..rules import rule_for
from .base import FSDP2, DataParallelBase
from .ddp import all_ranks, first_rank, reduce_values

_RECIPE = ("call fully_shard on each layer (or block) and then on the root module, e.g. "
           "`for layer in model: fully_shard(layer)`, then `fully_shard(model)` (docs/distributed.md)")


class ShardedDataParallel(DataParallelBase):
    """A model sharded by FSDP2 and taken over by tunefree (a :class:`~.base.Parallelism`): its examples
    are split across the ranks of the model's process group, and FSDP2's own gradient reduce-scatter is
    off from :meth:`take_over` to :meth:`release_model` (the engine leaves no raw gradient to reduce; one
    that appears anyway stays on its rank and is refused before the release)."""

    kind = FSDP2

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        if not dist.is_initialized():
            raise ValueError("the model's parameters are sharded DTensors but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group first")
        if not isinstance(model, FSDPModule):
            raise ValueError(
                f"the model has sharded DTensor parameters but its root is not sharded by FSDP2: {_RECIPE}. "
                "Parameters outside every fully_shard module (or tensor parallelism) are not supported")
        self.module = model
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        meshes = {_check_sharded(name, p) for name, p in model.named_parameters()}
        if len(meshes) != 1:
            raise ValueError("the model's parameters are sharded over different device meshes: tunefree "
                             "supports one FSDP2 mesh for the whole model")
        _check_layer_rules(model)
        self.group = meshes.pop().get_group()
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._resharding: dict[int, tuple] = {}

    def take_over(self) -> None:
        """Switch FSDP2's gradient reduce-scatter off (tunefree reduce-scatters the clipped sums) and
        have every module reshard after its forward, the root included (FSDP2 keeps the root's
        parameters gathered until the backward): a forward without a backward (evaluation, the
        independence check) then leaves the model holding its sharded parameters, the ones the run's
        clip groups and optimizer hold."""
        self._resharding = {id(group): (state, group, state._auto_reshard_after_forward,
                                        group.post_forward_mesh_info)
                            for state, group in self._param_groups()}
        self.module.set_requires_gradient_sync(False)
        self.module.set_reshard_after_forward(True)

    def release_model(self) -> None:
        """Give FSDP2 its gradient reduce-scatter (FSDP2's default: on) and its resharding back."""
        self.module.set_requires_gradient_sync(True)
        for state, group, auto, mesh_info in self._resharding.values():
            state._auto_reshard_after_forward, group.post_forward_mesh_info = auto, mesh_info

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every rank (a collective: every rank must call it). FSDP2's forward
        passes gather parameters from every rank, so a forward that one rank runs alone (the
        independence check) would wait forever: the ranks decide together."""
        return all_ranks(flag, self.group, self._collective_device())

    def from_first(self, value: int) -> int:
        """Rank 0's ``value``, on every rank (a collective)."""
        return first_rank(value, self.group)

    def sink(self, groups: Sequence[ClipGroup]) -> ShardSink:
        """Each clipped sum reduce-scattered into this rank's shard as it is booked."""
        return ShardSink(self, groups)

    def noisy_sum(self, sums: Mapping[nn.Parameter, torch.Tensor], stds: Sequence[tuple[nn.Parameter, float]],
                  randomness: NoiseSource) -> dict[nn.Parameter, torch.Tensor]:
        """This rank's shard of the noisy sum of every rank's clipped sums; ``sums`` holds this rank's
        shards (:meth:`ShardSink.collect`; a parameter without one has sum zero on every rank), and each
        released ``.grad`` is a DTensor placed as its parameter. The ranks first agree that none holds a
        raw gradient (one all-reduce): if any does, every rank refuses the step before any noise is drawn,
        anything is released or recorded. A rank that fails or never arrives makes that agreement fail
        (after the process group's timeout).

        Who draws the noise: with a secret source, each rank its own shard, from its own secret key.
        Seeded, every rank draws the whole noise in one process's order and keeps its own rows: the noise
        is that of one process with that seed, and every rank's stream stays at the same place."""
        leaked = self.raw_gradients()
        if not self.agree(not leaked):
            where = f"parameters {leaked}" if leaked else "parameters on another rank"
            raise PrivacyError(
                f"{where} received ordinary (non-private) gradients in FSDP2's unsharded tensors: a "
                "parameter was used outside the forward of the module that owns it. Use it only "
                "through its module; nothing of this step is released")
        shards = {p: sums[p] if p in sums else _zero_shard(p) for p, _ in stds}
        add_shard_noise(shards, stds, randomness, self.shard)
        return {p: _as_sharded(shards[p], p) for p, _ in stds}

    def noisy_values(self, values: torch.Tensor, noise: torch.Tensor,
                     randomness: NoiseSource) -> torch.Tensor:
        """Every rank's ``values`` summed, each coordinate's noise added by the rank that owns it."""
        return reduce_values(values, noise, randomness, self.shard, self.group, self._collective_device())

    def _collective_device(self) -> torch.device:
        return next(self.module.parameters()).device

    def raw_gradients(self) -> list[str]:
        """Parameters whose unsharded tensor holds an ordinary (non-private) gradient, or, called inside a
        backward pass, will receive one in it: a use the engine did not see (e.g. a parameter read
        outside its module's forward)."""
        return sorted(str(fsdp_param._param_fqn) for fsdp_param in self._fsdp_params()
                      if _receives_raw_gradient(fsdp_param))

    def _param_groups(self) -> Iterator[tuple]:
        """FSDP2's ``(state, parameter group)`` pairs of the model, each once."""
        seen = set()
        for module in self._fsdp_modules:
            state = module._get_fsdp_state()
            for group in state._fsdp_param_groups:
                if id(group) not in seen:
                    seen.add(id(group))
                    yield state, group

    def _fsdp_params(self) -> Iterator:
        for _, group in self._param_groups():
            yield from group.fsdp_params


def _receives_raw_gradient(fsdp_param) -> bool:
    """Whether FSDP2's unsharded tensor of a parameter holds an ordinary gradient, or will receive one
    in the backward pass now running (autograd's graph reaches its gradient accumulator)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if fsdp_param.unsharded_accumulated_grad is not None or getattr(unsharded, "grad", None) is not None:
        return True
    return (unsharded is not None and unsharded.requires_grad and torch._C._current_graph_task_id() != -1
            and torch._C._will_engine_execute_node(get_gradient_edge(unsharded).node))


def _check_layer_rules(model: nn.Module) -> None:
    """Every module owning trainable parameters needs a layer rule that reads no parameter value
    (``LayerRule.reads_parameters`` False: its per-sample gradients need the layer's inputs and output
    gradients only): FSDP2 holds the full parameters only during the layer's forward, not when the engine
    clips in the backward pass. Convolutions (their weighted sum runs the convolution backward with the
    weight) and recurrent layers (per-example autograd through the weights) read them."""
    for name, module in model.named_modules():
        direct = {n for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        rule = rule_for(module, direct) if direct else None
        if direct and (rule is None or rule.reads_parameters):
            what = ("has no layer rule (tunefree's generic fallback re-runs it per example with its "
                    "parameters)" if rule is None else "has a layer rule that reads its parameters")
            raise ValueError(
                f"module '{name or '(root)'}' ({type(module).__name__}) {what}, which FSDP2 holds sharded "
                "when tunefree computes per-sample gradients: not supported with FSDP2 yet. FSDP2 runs "
                "take nn.Linear, nn.Embedding and normalisation layers; train other models with "
                "DistributedDataParallel")


def _check_sharded(name: str, p: nn.Parameter):
    """The device mesh of ``p``, which must be an FSDP2 dim-0 shard over a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        raise ValueError(f"parameter {name!r} is not sharded (a plain tensor) in a model whose other "
                         f"parameters are: {_RECIPE}")
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(
            f"parameter {name!r} is a DTensor placed {tuple(p.placements)} over a {p.device_mesh.ndim}-D "
            "mesh: tunefree supports FSDP2's dim-0 sharding over one 1-D mesh only (no HSDP, tensor "
            "parallelism or shard_placement_fn)")
    return p.device_mesh


def check_sharded_options(physical_batch_size: int | None) -> None:
    """Refuse what an FSDP2 run cannot do: each forward pass gathers parameters from every rank, so
    every rank must run as many forward passes per step, and micro-batches would give ranks with
    more examples more of them."""
    if physical_batch_size is not None:
        raise ValueError(
            f"physical_batch_size={physical_batch_size} is not supported with FSDP2 (fully_shard) yet: "
            "each rank would cut its share of the Poisson batch into a different number of "
            "micro-batches, and every forward pass is a collective of all ranks. Drop it (each rank "
            "then runs its whole share, batch_size / world size examples on average, in one pass)")


def sharded_data_parallel(model: nn.Module) -> ShardedDataParallel | None:
    """The sharded setting of ``model``: a :class:`ShardedDataParallel` for a model with ``DTensor``
    parameters (FSDP2), ``None`` for a model without any."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    return ShardedDataParallel(model)


class ShardSink:
    """The sink of an FSDP2 run's clipped sums, each kept as this rank's shard only: the engine books each
    parameter's full-size sum the moment it is complete, and it is reduce-scattered at once into FSDP2's
    dim-0 shards (:func:`_launch_reduce_scatter`), so that rank r receives the sum over all ranks of its
    own rows; the full-size sum is freed as soon as its reduce-scatter completes. At most one
    reduce-scatter is in flight (asynchronous: it travels while the engine forms the next sum), so a rank
    holds at most two full-size sums at once, not the model's.

    The collectives match across ranks because the engine books every parameter once per backward pass,
    in an order that does not depend on the data (clip group after clip group as the backward pass
    reaches them, each in its parameters' order), a rank with no example included: it sends zeros.

    Fail closed: before sending the first sum of a step, the rank looks for ordinary (non-private)
    gradients, held or coming in the running backward pass (:meth:`ShardedDataParallel.raw_gradients`);
    if it finds any it sends zeros in place of every sum of the step, keeping its place in the
    collectives, and the release refuses the step on every rank. What travels is internal to the run:
    nothing is released before the release's noise, which every rank adds only once all have agreed to
    release.
    """

    def __init__(self, parallel: ShardedDataParallel, groups: Sequence[ClipGroup]):
        self.parallel, self.groups = parallel, list(groups)
        self._shards: dict[nn.Parameter, torch.Tensor] = {}
        self._in_flight: tuple | None = None  # (parameter, padded shard, work, inputs kept alive)
        self._withheld: bool | None = None  # this step's sums replaced by zeros; None: not checked yet

    def add(self, p: nn.Parameter, contribution: torch.Tensor | None) -> None:
        """Send ``p``'s complete clipped sum of this backward pass (zeros for ``None``, or when the step
        is withheld) to the ranks owning its rows, once the previous sum has arrived."""
        if self._withheld is None:
            self._withheld = bool(self.parallel.raw_gradients())
        self._receive_in_flight()
        dtype = accumulation_dtype(p.dtype)
        if contribution is None or self._withheld:
            full = torch.zeros(p.shape, dtype=dtype, device=p.device)
        else:
            full = contribution.to(dtype).reshape(p.shape)
        del contribution  # the full-size sum lives on only as the reduce-scatter's input
        shard, work, inputs = _launch_reduce_scatter(full, self.parallel.group, self.parallel.world_size)
        self._in_flight = (p, shard, work, inputs)

    def _receive_in_flight(self) -> None:
        """Wait for the reduce-scatter in flight, keep this rank's rows of it (added to those of an
        earlier pass of the step, if any) and free its full-size input."""
        if self._in_flight is None:
            return
        p, shard, work, _ = self._in_flight
        self._in_flight = None
        work.wait()
        local = shard.narrow(0, 0, p.to_local().shape[0])
        earlier = self._shards.get(p)
        self._shards[p] = local if earlier is None else earlier.add_(local)

    def collect(self) -> dict[nn.Parameter, torch.Tensor]:
        """This rank's shard of every sum the ranks sent (a parameter no backward pass of the step
        reached on any rank has none: its sum is zero)."""
        self._receive_in_flight()
        shards, self._shards, self._withheld = self._shards, {}, None
        return shards

    def bytes_per_step(self) -> int:
        """Bytes each rank puts into the reduce-scatters of one step: the clipped sums, in their
        accumulation dtype, padded to FSDP2's shards."""
        world = self.parallel.world_size
        return sum(math.ceil(p.shape[0] / world) * world * (p.numel() // p.shape[0])
                   * accumulation_dtype(p.dtype).itemsize for g in self.groups for p in g.params)


def _launch_reduce_scatter(full: torch.Tensor, group: dist.ProcessGroup, world: int
                           ) -> tuple[torch.Tensor, dist.Work, object]:
    """Launch the reduce-scatter of ``full`` into FSDP2's padded dim-0 shards: ⌈rows/W⌉ rows each, the
    last ones shorter or empty (padded with zero rows, which no rank keeps). Returns the padded shard
    this rank receives, the work, and the inputs, which must stay alive until the work completes: the
    tensor itself, or for uneven rows its whole chunks as views and the short ones padded (copies of
    at most one shard each, never of the whole tensor)."""
    rows = math.ceil(full.shape[0] / world)
    shard = full.new_empty(rows, *full.shape[1:])
    full = full.contiguous()
    if rows * world == full.shape[0]:
        return shard, dist.reduce_scatter_single(shard, full, group=group, async_op=True), full
    chunks = [full.narrow(0, min(r * rows, full.shape[0]), max(0, min(rows, full.shape[0] - r * rows)))
              for r in range(world)]
    chunks = [c if c.shape[0] == rows else torch.cat([c, c.new_zeros(rows - c.shape[0], *c.shape[1:])])
              for c in chunks]
    return shard, dist.reduce_scatter(shard, chunks, group=group, async_op=True), chunks


def _zero_shard(p: nn.Parameter) -> torch.Tensor:
    local = p.to_local()
    return torch.zeros(local.shape, dtype=accumulation_dtype(p.dtype), device=local.device)


def _as_sharded(local: torch.Tensor, like: nn.Parameter) -> torch.Tensor:
    """``local`` (this rank's rows) as a DTensor placed and shaped as the sharded parameter ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())
