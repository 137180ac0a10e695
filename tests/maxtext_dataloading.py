# Copyright 2023–2025 Google LLC
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#    https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# pylint: disable=unused-import
# ruff: noqa: E501, F401, I001, RUF003, UP035
"""A small copy of maxtext's colocated data loader (AI-Hypercomputer/maxtext,
``src/maxtext/input_pipeline/multihost_dataloading.py``: ``RemoteIterator`` and
``RemoteIteratorWrapper``), ported to colobus for ``tests/test_clients.py``.

What changed, and nothing else:

- the imports: ``jax.experimental.colocated_python`` is colobus; ``etils.epath`` is
  ``pathlib`` (its ``Path`` does what this code asks of ``epath.Path``); maxtext's
  ``max_logging`` is a stand-in that logs; tensorflow stays optional, as there;
- ``RemoteIterator``, the host side, is maxtext's own code;
- ``RemoteIteratorWrapper``, the driver side, makes its shardings and arrays with
  colobus's ``NamedSharding`` and ``device_put`` instead of JAX's (the controller's JAX
  cannot address the hosts' devices; ``docs/jax_comparison.md``, "Porting a real
  client"). ``get_next``'s result is used as maxtext uses JAX's.
"""

import json
import logging
import pathlib as epath  # (was: from etils import epath)
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Sequence, Union

try:
  import tensorflow as tf

  _TF_RETRYABLE_ERRORS = (tf.errors.FailedPreconditionError,)
except ImportError:
  tf = None  # type: ignore[assignment]
  _TF_RETRYABLE_ERRORS = ()

import numpy as np

import jax
import jax.tree_util as jtu
from jax.sharding import PartitionSpec
import colobus as colocated_python  # (was: from jax.experimental import colocated_python)
import jax.numpy as jnp


class max_logging:  # (was: from maxtext.utils import max_logging)
  log = staticmethod(logging.getLogger("maxtext").info)


def _colocated_cpu_devices(
    devices: Sequence[jax.Device],
) -> Sequence[jax.Device]:
  """Returns CPU devices colocated with the given devices."""
  return colocated_python.colocated_cpu_devices(devices)


def _colocated_cpu_mesh(mesh):
  """Returns a CPU mesh that has colocated CPU devices."""
  return colocated_python.colocated_cpu_devices(mesh)


class RemoteIterator:
  "iterator class for using colocated python class"

  def __init__(self, get_ds_fn, preprocessing_fn, global_shape, checkpoint_path, elastic=False):
    self.get_ds_fn = get_ds_fn
    self.preprocessing_fn = preprocessing_fn
    self.global_shape = global_shape
    self.checkpoint_path = checkpoint_path
    self.elastic = elastic
    self.reset()
    max_logging.log("RemoteIterator initiated")

  def reset(self):
    ds = self.get_ds_fn(dataloading_host_index=jax.process_index(), dataloading_host_count=jax.process_count())
    dataloader = self.preprocessing_fn(dataset=ds)
    if hasattr(dataloader, "as_numpy_iterator"):
      self.iterator = dataloader.as_numpy_iterator()
    elif isinstance(dataloader, Iterable):
      self.iterator = iter(dataloader)
    else:
      raise ValueError("Type error: dataloader should be Iterable.")

  def get_next(self, dummy_array):
    """Gets the next batch of data and forms a global array."""
    local_data = next(self.iterator)

    def form_global_array_colocated_python(path, array, devices, global_shape, sharding):
      try:
        device_arrays = np.split(array, len(devices), axis=0)
      except ValueError as array_split_error:
        raise ValueError(
            f"Unable to put to devices shape {array.shape} with "
            f"local device count {len(devices)} "
            f"at {jtu.keystr(path)}"
        ) from array_split_error
      device_arrays = jax.device_put(device_arrays, devices)
      return jax.make_array_from_single_device_arrays(shape=global_shape, sharding=sharding, arrays=device_arrays)

    return jtu.tree_map_with_path(
        partial(
            form_global_array_colocated_python,
            devices=list(dummy_array.sharding.addressable_devices),
            global_shape=self.global_shape,
            sharding=dummy_array.sharding,
        ),
        local_data,
    )

  def save_state(self, step_array):
    """Saves the iterator state to a file."""
    step = step_array.addressable_data(0).item()
    directory = epath.Path(self.checkpoint_path) / str(step) / "iter"
    if self.elastic:
      # ElasticIterator state is a single global scalar shared by all shards,
      # so we write one fixed file (from process 0 only) and every process
      # reads the same file on restore — this survives elastic resizes that
      # change `jax.process_count()`.
      if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        filename = directory / "process_0.json"
        filename.write_text(json.dumps(self.iterator.get_state(), indent=4))  # pyrefly: ignore[missing-attribute]
      return step_array
    directory.mkdir(parents=True, exist_ok=True)
    filename = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    state = json.dumps(self.iterator.get_state(), indent=4)  # pyrefly: ignore[missing-attribute]
    filename.write_text(state)
    return step_array

  def restore_state(self, step_array):
    step = step_array.addressable_data(0).item()
    directory = epath.Path(self.checkpoint_path) / str(step) / "iter"
    if self.elastic:
      filename = directory / "process_0.json"
    else:
      filename = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    state = json.loads(filename.read_text())
    self.iterator.set_state(state)  # pyrefly: ignore[missing-attribute]
    return step_array


class RemoteIteratorWrapper:
  """Wrapper for RemoteIterator that handles device placement."""

  def __init__(self, get_ds_fn, preprocessing_fn, global_mesh, global_shape, checkpoint_path="", elastic=False):
    self.cpu_devices = _colocated_cpu_devices(tuple(global_mesh.devices.flat))
    self.cpu_mesh = _colocated_cpu_mesh(global_mesh)
    # (ported: colobus's NamedSharding and device_put, which takes the jnp array)
    self.tpu_sharding = colocated_python.NamedSharding(global_mesh, PartitionSpec(global_mesh.axis_names))
    self.cpu_sharding = colocated_python.NamedSharding(self.cpu_mesh, PartitionSpec(self.cpu_mesh.axis_names))
    self.dummy_array = jnp.zeros((self.cpu_mesh.size,))
    self.dummy_array = colocated_python.device_put(self.dummy_array, self.cpu_sharding)
    # This is a proxy to a RemoteIterator running in a colocated process,
    # named "local_iterator" to match MultiHostDataLoadIterator's interface.
    remote_iterator_cls = colocated_python.colocated_python_class(RemoteIterator)
    self.local_iterator = remote_iterator_cls(
        get_ds_fn,  # pyrefly: ignore[bad-argument-count]
        preprocessing_fn,
        global_shape,
        checkpoint_path,
        elastic=elastic,  # pyrefly: ignore[unexpected-keyword]
    )
    max_logging.log("RemoteIteratorWrapper initiated")

  def __iter__(self):
    return self

  def reset(self):
    self.local_iterator.reset()  # pyrefly: ignore[missing-attribute]

  def __next__(self):
    out = self.local_iterator.get_next(self.dummy_array)  # pyrefly: ignore[missing-attribute]
    # use tree_map is out is a dict
    return colocated_python.device_put(out, self.tpu_sharding)

  def save_state(self, step):
    replicated_cpu_sharding = colocated_python.NamedSharding(self.cpu_mesh, PartitionSpec())
    step_array = jnp.array(step, dtype=jnp.int32)
    step_array = colocated_python.device_put(step_array, replicated_cpu_sharding)
    self.local_iterator.save_state(step_array)  # pyrefly: ignore[missing-attribute]

  def restore_state(self, step):
    replicated_cpu_sharding = colocated_python.NamedSharding(self.cpu_mesh, PartitionSpec())
    step_array = jnp.array(step, dtype=jnp.int32)
    step_array = colocated_python.device_put(step_array, replicated_cpu_sharding)
    self.local_iterator.restore_state(step_array)  # pyrefly: ignore[missing-attribute]
