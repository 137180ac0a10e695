"""Launchers: a controller plus workers it starts on machines you have.

:mod:`.base` holds what they share (relay, restart, reaping); :mod:`.ssh`,
:mod:`.slurm` and :mod:`.kubernetes` one kind of cluster each; :mod:`.cli`
the ``colobus launch`` and ``colobus manifest`` commands.
"""
