"""``tests/test_backpressure.py`` again, every controller with a relay (see ``tests/relayed.py``)."""

from relayed import take

take(globals(), "test_backpressure")
