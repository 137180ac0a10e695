"""The caller's side: decorators, handles, arguments and what the API returns."""

from . import fetch as fetch  # sets what the arrays' JAX methods call (array.WAYS)
from . import lane as lane  # sets the common call's lane in ColocatedFunction (if on)
from . import ready as ready  # (array.WAYS, as fetch)
