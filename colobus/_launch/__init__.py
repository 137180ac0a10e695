"""Launchers: a controller plus workers it starts on machines you have.

:mod:`.base` holds what they share (relay, restart, reaping); :mod:`.local`,
:mod:`.ssh` and :mod:`.slurm` one kind of cluster each; :mod:`.cli` the
``colobus launch`` command and :mod:`.kubernetes` ``colobus manifest
kubernetes``; :mod:`.remote` the worker's side (``--exit-on-stdin-eof``).
"""
