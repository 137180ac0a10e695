"""``tests/test_held.py`` again, every controller with a relay (see ``tests/relayed.py``):
a relay judges its hosts by their links, and the controller its relays."""

from relayed import take

take(globals(), "test_held")
