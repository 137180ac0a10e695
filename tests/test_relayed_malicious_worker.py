"""``tests/test_malicious_worker.py`` again: hostile hosts behind a relay (``tests/relayed.py``)."""

from relayed import take

take(globals(), "test_malicious_worker")
