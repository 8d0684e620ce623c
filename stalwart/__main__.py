"""``python -m stalwart``: the same as the ``stalwart`` command."""

from stalwart.cli import main

main()
