"""``python -m ckptplan.cli``: the same as the ``ckptplan`` command."""

from ckptplan.cli.main import main

main()
