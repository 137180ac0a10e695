"""Relays: processes on the controller's machine that carry many hosts' sessions for it.

The controller starts them (:mod:`colobus._controller.relays`) when it has many
hosts; each binds a socket of its own, joined hosts move their session to it,
and the controller's loop then handles one message per relay where it handled
one per host. See ``docs/architecture.md`` ("Relays").
"""
