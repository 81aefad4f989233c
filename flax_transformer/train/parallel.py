"""Data parallelism: one per-device function mapped over every device, by shard_map or pmap.

Axis legend: B batch rows, G devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_transformer.data.batching import Batch, shard

AXIS = 'data'  # the mapped device axis, in both shard_map and pmap


class DataParallel:
  """Places state and batches on devices and maps per-device functions over them.

  'shard_map': state leaves are global arrays replicated over a `('data',)`
    mesh (`P()`); batch rows are split over it (`P('data')`).
  'pmap': state leaves carry a leading axis over this process's devices
    `[D_local, ...]`; this process's rows of a batch are reshaped to
    `[G_local, B / G, ...]`. The pmap spans the devices of every process.

  Multi-host: every process brings its contiguous block of a step's global batch
  (`batching.shard`'s rows, built alone by a batcher's `local_batch_at`), and
  `jax.make_array_from_process_local_data` assembles the global array; the
  collectives in the step span all processes' devices.
  """

  def __init__(
    self,
    devices: Sequence[jax.Device] | None = None,
    mode: Literal['shard_map', 'pmap'] = 'shard_map',
  ):
    if mode not in ('shard_map', 'pmap'):
      raise ValueError(f"parallel mode must be 'shard_map' or 'pmap', got {mode!r}")
    if devices is None:
      devices = jax.devices()
    elif jax.process_count() > 1 and len(devices) != jax.device_count():
      raise ValueError(
        'with several processes, training uses every device of every process; '
        f'got {len(devices)} of {jax.device_count()}'
      )
    self.mode = mode
    self.devices = tuple(devices)
    self.local_devices = tuple(d for d in self.devices if d.process_index == jax.process_index())
    self.mesh = Mesh(np.array(self.devices), (AXIS,))

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  def map(self, fn: Callable, donate_first: bool = False) -> Callable:
    """`fn(replicated, batch) -> replicated outputs` -> the jitted function over all devices."""
    if self.mode == 'pmap':
      # Every device of every process, the same list on each: pmap given only this
      # process's devices would run its collectives over those alone, and each
      # process would then train its own model on its share of the batch.
      return jax.pmap(
        fn, axis_name=AXIS, devices=self.devices, donate_argnums=(0,) if donate_first else ()
      )
    replicated, split = PartitionSpec(), PartitionSpec(AXIS)
    return jax.jit(
      jax.shard_map(fn, mesh=self.mesh, in_specs=(replicated, split), out_specs=replicated),
      donate_argnums=(0,) if donate_first else (),
    )

  def replicate(self, tree):
    """A host or single-device pytree -> the layout `map`ped functions take."""
    if self.mode == 'pmap':
      count = len(self.local_devices)
      stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (count, *np.shape(x))), tree)
      # Through an identity pmap, so the state has exactly the layout pmap outputs:
      # the step then compiles once, not once for host input and again for its own output.
      return jax.pmap(lambda x: x, axis_name=AXIS, devices=self.devices)(stacked)
    sharding = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )

  def unreplicate(self, tree):
    """Replicated outputs of a `map`ped function -> one host copy (numpy)."""

    def first(x):
      local = np.asarray(x.addressable_data(0))
      return local.reshape(local.shape[1:]) if self.mode == 'pmap' else local

    return jax.tree.map(first, tree)

  def shard_batch(self, batch: Batch) -> Batch:
    """The global batch (identical on every process) -> its rows split over all devices."""
    return self.shard_local_batch(
      shard(batch, jax.process_index(), jax.process_count()), batch.src.shape[0]
    )

  def shard_local_batch(self, local: Batch, global_rows: int) -> Batch:
    """This process's rows of a global batch of `global_rows` rows (`batching.shard`'s block,
    e.g. a batcher's `local_batch_at`) -> the rows split over all devices."""
    if global_rows % self.num_devices:
      raise ValueError(
        f'a batch of {global_rows} rows does not split over {self.num_devices} '
        'devices; build the Batcher with row_multiple = the number of devices'
      )
    if self.mode == 'pmap':
      count = len(self.local_devices)
      return jax.tree.map(lambda x: np.asarray(x).reshape(count, -1, *x.shape[1:]), local)
    sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
        sharding, np.asarray(x), (global_rows, *x.shape[1:])
      ),
      local,
    )
