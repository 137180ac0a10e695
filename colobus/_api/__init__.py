"""The caller's side: decorators, handles, arguments and what the API returns."""

from . import lane as lane  # sets the common call's lane in ColocatedFunction (if on)
