"""What crosses the wire, for both sides: messages, envelopes, codecs, channel, keys."""
