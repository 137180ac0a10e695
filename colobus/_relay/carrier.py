"""What a relay's fast paths (:mod:`.fanout`, :mod:`.inflow`) use of the relay.

The relay (:class:`colobus._relay.relay.Relay`) owns them; they name what they read
and change of it here, so that neither imports the module that imports them.
"""

from __future__ import annotations

from typing import Any, Protocol

from .._wire.channel import Channel, Peer
from .._wire.links import PeerLinks
from .._wire.relaywire import Gather
from .hold import ReplyHold

__all__ = ["Carrier"]


class Carrier(Protocol):
    """The hosts a relay carries, and what it gathers for the controller."""

    peers: dict[int, Peer]  # host index -> its session, as the controller's
    by_identity: dict[bytes, int]
    arrived: set[int]  # hosts heard from on the relay's socket
    last_seen: dict[int, float]
    links: PeerLinks  # the hosts' connections (.relay: whose closed since they spoke)
    released: set[int]  # hosts whose acknowledgements freed bytes since the last report
    given: dict[int, int]  # host -> the payload and buffer bytes FORWARDs gave it
    ups: Gather  # what goes up next
    hold: ReplyHold
    ctl_session: bytes
    times: bool  # each host's call times go up (the controller traces)
    whole: int  # hosts' envelopes sent at once
    sent_down: bool  # sent on the hosts' socket outside the channel since its last flush
    _due: bool  # what is gathered holds more than heartbeats

    @property
    def down(self) -> Channel: ...  # the hosts' channel

    def _health_news(self, h: int, body: Any) -> bool: ...
