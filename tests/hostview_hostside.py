"""Host-side helpers of tests/test_hostview.py and tests/test_jaxjob.py.

Importable on the workers (they inherit ``sys.path``): functions here travel by
reference, and this module is imported on each host after the worker set JAX up, as
a user's module is. It names JAX's process functions in the three forms user code
writes them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import process_count, process_index

import colobus as cb


@cb.colocated_python
def process_numbers(x: Any) -> Any:
    """Per device of this host: [jax.process_index(), jax.process_count(), the names
    imported with ``from jax import``, cb.host_index(), cb.host_count(),
    len(jax.process_indices())], as this host's part of an (n, 7) array laid out as ``x`` (1-D)."""
    row = [jax.process_index(), jax.process_count(), process_index(), process_count(),
           cb.host_index(), cb.host_count(), len(jax.process_indices())]

    def rows(index: Any) -> np.ndarray:
        return np.array([row] * len(range(*index[0].indices(x.shape[0]))), dtype=np.int32)

    return jax.make_array_from_callback((x.shape[0], len(row)), x.sharding, rows)
