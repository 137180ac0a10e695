"""colobus: run Python colocated with the devices of many hosts, from one controller.

The API follows ``jax.experimental.colocated_python``; every remote operation
returns a :class:`Future` that can be awaited from any event loop.
"""

from ._api import colocated_cpu_devices as colocated_cpu_devices
from ._api import devices as devices
from ._array import Array as Array
from ._array import block_until_ready as block_until_ready
from ._array import device_get as device_get
from ._array import device_put as device_put
from ._cluster import init as init
from ._cluster import local_cluster as local_cluster
from ._cluster import shutdown as shutdown
from ._controller import Controller as Controller
from ._controller import HostInfo as HostInfo
from ._errors import AuthenticationError as AuthenticationError
from ._errors import ColobusError as ColobusError
from ._errors import ControllerClosedError as ControllerClosedError
from ._errors import HostLostError as HostLostError
from ._errors import NoControllerError as NoControllerError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteError as RemoteError
from ._errors import SerializationError as SerializationError
from ._func import colocated_python as colocated_python
from ._future import Future as Future
from ._gather import gather as gather
from ._keys import load_key as load_key
from ._launch.slurm import slurm_cluster as slurm_cluster
from ._launch.ssh import ssh_cluster as ssh_cluster
from ._obj import colocated_python_class as colocated_python_class
from ._sharding import Device as Device
from ._sharding import Mesh as Mesh
from ._sharding import NamedSharding as NamedSharding
from ._sharding import PartitionSpec as PartitionSpec
from ._sharding import ShapeDtypeStruct as ShapeDtypeStruct
from ._sharding import Sharding as Sharding
from ._sharding import SingleDeviceSharding as SingleDeviceSharding
from ._trace import CallTimings as CallTimings
from ._trace import HostTimings as HostTimings

__version__ = "0.1.0"

__all__ = [
    "Array",
    "AuthenticationError",
    "CallTimings",
    "ColobusError",
    "Controller",
    "ControllerClosedError",
    "Device",
    "Future",
    "HostInfo",
    "HostLostError",
    "HostTimings",
    "Mesh",
    "NamedSharding",
    "NoControllerError",
    "PartitionSpec",
    "ProtocolError",
    "RemoteError",
    "SerializationError",
    "ShapeDtypeStruct",
    "Sharding",
    "SingleDeviceSharding",
    "block_until_ready",
    "colocated_cpu_devices",
    "colocated_python",
    "colocated_python_class",
    "device_get",
    "device_put",
    "devices",
    "gather",
    "init",
    "load_key",
    "local_cluster",
    "shutdown",
    "slurm_cluster",
    "ssh_cluster",
]
